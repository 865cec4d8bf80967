#!/usr/bin/env python3
"""Peers on the same machine: our L1 beside torchft and nvidia-resiliency-ext, each at the newest release that
installs and runs here (torchft's nightly build; nvidia-resiliency-ext 0.4.1, with both its in-process Wrapper
and its in-job restart).

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
          Per-update overhead: a job whose entry point is ``benchmarks/parts/peers_entry.py`` (the same
          ranks, launcher and runtime as ``accelpact-run``; the example's model, optimizer and data given
          to ``job.protect``), segments of guarded (``with run.update()``) and plain updates (the same
          update body without it), interleaved, each timed between two control-plane barriers.
torchft   (its nightly build, ``torchft-nightly``; the newest release, 0.2.0, when that does not work here)
          a lighthouse (``torchft_lighthouse --min_replicas 1``) and two replica groups of one process
          (``benchmarks/parts/peers_workers/torchft_worker.py``: Manager, ProcessGroupGloo, ``manager.allreduce`` of the
          flattened gradients).  Group 1 SIGKILLs itself right after committing update 15; the survivor
          resumes once the lighthouse's heartbeat timeout has expired the dead group.  Fault-to-resume =
          the fault record -> the survivor's commit of update 16.  Heartbeat timeout = our collective_s
          (5 s, which is also torchft's default) and = the short timeout.  Once the survivor has committed
          update 16 the harness restarts group 1; rejoin = its start -> its first commit (joined the
          quorum, healed from the survivor's live state), against the same group's first start -> first
          commit.  Per-update overhead: segments of managed updates and plain ``torch.distributed`` Gloo
          updates in the same two processes, interleaved.
nvrx      in-process restart: two ranks under ``nvidia_resiliency_ext.inprocess.Wrapper`` (``benchmarks/parts/peers_workers/nvrx_worker.py``,
          ``health_check=None``, other arguments at their defaults).  Rank 1 raises right after
          committing update 15; the Wrapper restarts the training function on both ranks in process,
          which resumes from the state kept in memory.  Fault-to-resume = the raise -> update 16
          committed.  Per-update overhead: a window of updates after the experiment, timed between two
          barriers, against the same window without the Wrapper (separate launch, same repeat).
nvrx      in-job restart: ``ft_launcher`` (the peer's torchrun-like launcher: c10d rendezvous, one rank monitor
(job)     per rank, ``--max-restarts 1``) starts two ranks (``benchmarks/parts/peers_workers/nvrx_injob_worker.py``: plain data
          parallel over Gloo, a heartbeat to the rank monitor after every update, each rank's state written
          every ``checkpoint.every_steps`` updates of the job file).  Rank 1's process SIGKILLs itself right after
          committing update 15; the launcher stops the other rank and starts both again in the same job; they
          load the update-10 checkpoint and replay 11-15.  Fault-to-resume = the fault record -> update 16
          committed by the restarted rank 0, with the restart's stages (new processes started, imports, rank
          monitors, Gloo, replay) beside it; restart = fault -> first update committed again, against the same
          job's cold start (launcher started -> update 1 committed).

The order of the runs rotates from repeat to repeat.  Figures are medians of ratios paired within one
repeat (min-max over repeats, or over interleaved segments for the overheads); absolute seconds are
printed beside them for reference and are never compared across runs.

Each peer is installed by this script into its own virtual environment under ``benchmarks/.venvs/``, one per
peer and release (``torch==2.13.0`` and PyYAML first, then the peer held to that torch by a constraints file;
reused while its stamp file matches).  Each peer has candidate releases, newest first (``peers_runs.PEERS``):
nvidia-resiliency-ext 0.7.0, 0.6.0 and 0.5.0 are on the package index only as manylinux_2_39 wheels (glibc
2.39 or newer; 0.7.0 for CPython 3.12 only; 0.7.0 still ships ``inprocess``) and this machine has glibc 2.36
and CPython 3.11, so 0.4.1 runs.
Every candidate's outcome is in the JSON and the markdown; a peer, or one of its entry points, that cannot be
installed or does not import is skipped with the reason.  The result records the commit it measured.

The code is in ``benchmarks/parts/``: ``peers_runs`` (starting and timing the runs), ``peers_venvs``,
``peers_entry`` (our ranks' overhead loop, the entry point of its job), ``peers_report`` (analysis and
markdown), ``peers_main``; the peers' workers, which run in the peers' venvs, are in ``benchmarks/parts/peers_workers/``.

Output: ``--json`` (default ``runs/bench/<date>/peers.json``) and the block between
``<!-- peers-bench -->`` markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts' summaries).

Usage: .venv/bin/python benchmarks/parts/peers.py [--repeats 3] [--short-timeout 1] [--peers torchft,nvrx]
       .venv/bin/python benchmarks/parts/peers.py --setup-only [--recheck-peers]   (make the venvs, run nothing)
       .venv/bin/python benchmarks/parts/peers.py --render runs/bench/<date>/peers.json   (markdown only)

About 4 minutes here with 3 repeats once the venvs exist (creating them takes about 2 minutes more; make them
beforehand with ``--setup-only`` when the part runs under ``bench_all.py``'s deadline).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as harness  # noqa: E402

harness.add_paths()

from benchmarks.parts.peers_main import main, markdown  # noqa: E402
from benchmarks.parts.peers_report import summary_rows  # noqa: E402

__all__ = ["main", "markdown", "summary_rows"]  # bench_all.py renders with markdown and summary_rows

if __name__ == "__main__":
    sys.exit(main(doc=__doc__))
