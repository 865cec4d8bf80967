#!/usr/bin/env python3
"""Peers on the same machine: our L1 beside torchft 0.2.0 and nvidia-resiliency-ext 0.4.1.

Every system trains the same model (the decoder example's ``CausalDecoder`` at the sizes of the ``params`` of
``examples/decoder/job.yaml``, its AdamW, LR schedule and token stream, 4 sequences per process, 1 thread
per process) on this CPU over Gloo,
and every system gets one fault right after update 15 of a 25-update run (the paper's experiment;
ours also snapshots at update 10).  Measured, per repeat:

ours      ``accelpact-run CONFIG --inject-fault boundary:15:1`` (CONFIG: the example's job file, its entry
          ``train_decoder.py:main`` made absolute): the job's real path, 2 emulated nodes x 2 ranks, FSDP1
          HYBRID_SHARD.  Rank 1 withholds its part of the boundary all-reduce; its
          replication peer hits the Gloo timeout (``timeouts.collective_s``), the vote decides Preserve
          and the engine repairs in process (zero replay).  Fault-to-resume = the ``fault`` event of
          rank 1 -> the ``step`` event of update 16 (``events.jsonl``).  Run once with the job file's
          ``collective_s`` (5 s) and once with the short timeout (``--short-timeout``, 1 s).
          Per-update overhead: a job whose entry point is ``scripts/bench/peers_entry.py`` (the same
          ranks, launcher and runtime as ``accelpact-run``; the example's model, optimizer and data given
          to ``job.protect``), segments of guarded (``with run.update()``) and plain updates (the same
          update body without it), interleaved, each timed between two control-plane barriers.
torchft   a lighthouse (``torchft_lighthouse --min_replicas 1``) and two replica groups of one process
          (``scripts/peers/torchft_worker.py``: Manager, ProcessGroupGloo, ``manager.allreduce`` of the
          flattened gradients).  Group 1 SIGKILLs itself right after committing update 15; the survivor
          resumes once the lighthouse's heartbeat timeout has expired the dead group.  Fault-to-resume =
          the fault record -> the survivor's commit of update 16.  Heartbeat timeout = our collective_s
          (5 s, which is also torchft's default) and = the short timeout.  Once the survivor has committed
          update 16 the harness restarts group 1; rejoin = its start -> its first commit (joined the
          quorum, healed from the survivor's live state), against the same group's first start -> first
          commit.  Per-update overhead: segments of managed updates and plain ``torch.distributed`` Gloo
          updates in the same two processes, interleaved.
nvrx      two ranks under ``nvidia_resiliency_ext.inprocess.Wrapper`` (``scripts/peers/nvrx_worker.py``,
          ``health_check=None``, other arguments at their defaults).  Rank 1 raises right after
          committing update 15; the Wrapper restarts the training function on both ranks in process,
          which resumes from the state kept in memory.  Fault-to-resume = the raise -> update 16
          committed.  Per-update overhead: a window of updates after the experiment, timed between two
          barriers, against the same window without the Wrapper (separate launch, same repeat).

The order of the runs rotates from repeat to repeat.  Figures are medians of ratios paired within one
repeat (min-max over repeats, or over interleaved segments for the overheads); absolute seconds are
printed beside them for reference and are never compared across runs.

Each peer is installed by this script into its own virtual environment under ``benchmarks/.venvs/``
(``torch==2.13.0`` and PyYAML first, then the pinned peer; reused while its stamp file matches).  A peer
that cannot be installed or does not run is skipped with the reason in the JSON and the markdown.

The code is in ``scripts/bench/``: ``peers_runs`` (starting and timing the runs), ``peers_venvs``,
``peers_entry`` (our ranks' overhead loop, the entry point of its job), ``peers_report`` (analysis and markdown), ``peers_main``; the
peers' workers, which run in the peers' venvs, are in ``scripts/peers/``.

Output: ``--json`` (default ``benchmarks/results/<date>-peers.json``) and the block between
``<!-- peers-bench -->`` markers of ``--markdown`` (default ``docs/benchmarks.md``; ``''`` = skip).

Usage: .venv/bin/python scripts/bench_peers.py [--repeats 3] [--short-timeout 1] [--peers torchft,nvrx]
       .venv/bin/python scripts/bench_peers.py --render benchmarks/results/<date>-peers.json   (markdown only)

About 4-5 minutes here with 3 repeats once the venvs exist (creating them takes a few minutes more).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import harness  # noqa: E402

harness.add_paths()

from bench.peers_main import main, markdown  # noqa: E402

__all__ = ["main", "markdown"]  # bench_all.py renders with markdown

if __name__ == "__main__":
    sys.exit(main(doc=__doc__))
