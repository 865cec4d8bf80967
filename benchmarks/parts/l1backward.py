#!/usr/bin/env python3
"""L1 backward: the share of replication-link faults at random moments recovered in process, and detection to commit.

Our jobs are the decoder example's job file (2 emulated nodes x 2 ranks, FSDP1 HYBRID_SHARD on the device mesh,
25 updates, a snapshot every 10) with a timed entry point (``benchmarks/parts/l1backward_entry.py``: the example's
model, optimizer, schedule, data and update body; each rank times the update's phases and logs every data-plane
collective that crosses nodes, with its start and end), started by ``accelpact-run JOB.yaml --inject-fault
PHASE:STEP:RANK`` itself (collective timeout 2 s, no relaunch).

1. *Share recovered in process.*  The fault is the link between the nodes (the replication group's) failing at a
   uniformly random moment.  Nothing notices it until the next collective that crosses nodes.  Per run, N
   uniformly random moments (seeded ``random.Random``, the seed is in the result) over the run's clean update
   attempts (every rank, the time before each update included) are each mapped to that collective
   (``bench.l1backward_analysis``): before the end of update U's last backward all-reduce -> U's backward, as
   ``backward:16:1`` reproduces; then until the guard's boundary all-reduce ends -> the boundary, as
   ``boundary:15:1`` (it fires in update 16's vote); after it (vote, optimizer step, commit, snapshot copy) -> update
   U+1's backward, as ``backward:17:1``; before any other cross-node collective (here: the capture proof of a
   start's first snapshot, ``get_state_dict`` on the default group) -> there, as the entry point's fault of rank 1
   withholding its part of it after update 10.  Each case takes the outcome of its injection's real runs (L1 when
   there is a ``repair`` event and no ``fail_stop`` or ``restart_load``; a case nothing ran for counts as not
   recovered).  Reported: the share recovered in process now against the share seen at the boundary all-reduce
   (what L1 covered before backward faults were repaired), median over runs, min-max; per case, the detection
   delay estimated from the timings (time to the detecting collective + the collective timeout: an estimate)
   beside the injected runs' measured detection and detection -> commit.  Faults of another kind run too and are
   reported apart: ``forward:16:1`` (a rank skips its forward: the shard group, inside the node) and rank 1's
   optimizer step of update 16 raising (entry point).
2. *Detection to the next committed update.*  ``backward:16:1`` (rank 1 withholds every replication all-reduce
   of update 16's backward; its peers hit the Gloo timeout; every rank discards the update, every group is
   replaced, the update runs again): the last ``fault`` event of update 16 -> the ``step`` event of the redone
   update 16 (``events.jsonl``).  Beside it, interleaved ABBA in each round, torchft's discard-and-heal on the
   same model and fault (``benchmarks/parts/peers_workers/torchft_withhold_worker.py`` in torchft's own venv, built by
   ``bench.peers_venvs``; skipped with the reason when it cannot be built): replica group 1 withholds its part
   of update 16's gradient all-reduce, group 0's all-reduce times out (process group timeout = our collective
   timeout), ``should_commit`` is False, the update runs again after a new quorum; its failed all-reduce ->
   the later group's commit of update 16.  Ratio torchft / ours, paired per round.

Every figure is a ratio against a baseline measured in the same run (median, min-max); absolute times are
printed beside them for reference only (this machine is shared and noisy).

Output: ``runs/bench/<date>/l1backward.json`` and the block between ``<!-- l1backward-bench -->``
markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts'
summaries).

Usage: .venv/bin/python benchmarks/parts/l1backward.py [--repeats 3] [--draws 10000] [--seed N] [--no-torchft]
       .venv/bin/python benchmarks/parts/l1backward.py --render runs/bench/<date>/l1backward.json

About 2-4 minutes here (8 of our jobs, 3 torchft experiments); runs that would not fit the budget (``--budget-s``,
lowered to ``ACCELPACT_BENCH_DEADLINE_S`` - 45 s from ``bench_all.py``) are left out, except the first round,
the boundary run and the next update's backward run.  SIGTERM/SIGINT kill every child.

The code is in ``benchmarks/parts/``: ``l1backward_entry`` (our ranks' entry point), ``l1backward_runs`` (one job,
one torchft experiment), ``l1backward_analysis`` and ``l1backward_report`` (result and markdown),
``l1backward_main``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as harness  # noqa: E402

harness.add_paths()

from benchmarks.parts.l1backward_main import main, markdown  # noqa: E402

__all__ = ["main", "markdown"]  # bench_all.py renders with markdown

if __name__ == "__main__":
    sys.exit(main(doc=__doc__))
