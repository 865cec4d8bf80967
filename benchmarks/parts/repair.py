#!/usr/bin/env python3
"""L1 Preserve benchmark: per-phase repair timings against a floor, rebinding against model depth, guard overhead.

One job on the embedded default (2 emulated nodes x 2 ranks: four processes, real ``torch.distributed``
over Gloo, FSDP1 ``HYBRID_SHARD`` on the 2-D device mesh), started by the library's own launcher
(``launch_local``, through ``benchmarks/harness/common.py``).  The job file names the benchmark's own entry
point (``benchmarks/parts/repair_entry.py:main``, called by ``accelpact-run`` on every rank with the ``Job``):
it builds the decoder example's model, AdamW, schedule and data (``examples/decoder/``), hands them to
``job.protect`` (the real guard, envelope and repair engine) and runs three scenarios in one go:

1. *Repair vs floor.*  Warm-up updates and one untimed repair, then N real faults injected exactly as the job file's
   ``faults: [boundary:STEP:RANK]`` does (the rank withholds its part of the boundary all-reduce on its
   replication group; the peer hits Gloo's timeout; the vote decides Preserve; the engine repairs).
   The faulting rank rotates, so both replication groups are repaired.  Each repair is paired with
   ``--floor-samples`` *floor* samples taken by the same members right before or right after it, in ABBA
   order within each replication group (``repair_setup.floor_positions``: the position is tied neither to
   the group nor to the faulting rank): one new Gloo group with the same membership under a fresh store
   prefix (as the engine builds its replacement) plus one all-reduce of the boundary all-reduce's size (one
   int64), each sample behind a world barrier and timed on every member.  The repair's detecting member enters
   that barrier the detection time late (as measured in the last faulted update's vote), the others at once
   (the floor in the repair's position: the others woken after that long a wait).  A repair is done when its slowest
   affected rank is: the figure is the max over those ranks of each rank's own total (``repair_rank``),
   against the floor's median over samples of the slowest member's time; a repair below its floor is
   flagged (``below_floor``) and left out of the ratio.  Per-phase timings are the engine's own (its
   ``repair`` event, emitted by the lowest affected rank).  One clean update follows each repair (the new
   group carries training on).  Also reported: both timed from their round's last arrival (the vote's, the
   barrier's) to the slowest member's end (``from_last_arrival_vs_floor``).
2. *Guard overhead.*  On the same model and process groups: blocks of K updates inside
   ``with run.update()`` (forward, backward, optimizer step, then the boundary all-reduce on the
   replication group and the world's vote over the control plane) against blocks of the same update
   body without it (forward, backward, optimizer step), ABBA order.
   Block time = the slowest rank's (each rank times from the same control-plane barrier).
3. *Rebinding vs depth.*  R rounds; each round visits every L in ``--layers`` once (order reversed every
   other round): a fresh FSDP1 HYBRID_SHARD model with L layers (narrow: ``--sweep-width``) on the same
   mesh, with its own guard from ``recovery.build_guard`` (``job.protect`` guards one model per job), one
   injected repair.  The engine's ``rebind`` phase (rebinding + the invariant scan of the
   framework's objects + retiring the old group) divided by the number of references it rebound; the
   parts are timed by thin wrappers around the engine's helper functions (nothing re-implemented).
   Baseline: the smallest L's repair of the same round.

Every figure is a ratio against a baseline measured in the same run (median of paired ratios, min-max);
absolute times are printed beside them for reference only (this machine is shared and noisy).

Output: ``runs/bench/<date>/repair.json`` and the block between ``<!-- repair-bench -->``
markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts'
summaries).

Usage: .venv/bin/python benchmarks/parts/repair.py [--repairs 8] [--floor-samples 5] [--guard-pairs 16] [--rebind-reps 4] ...
       .venv/bin/python benchmarks/parts/repair.py --render runs/bench/<date>/repair.json

About 1.5-3 minutes here with the defaults (28 injected faults, each waiting the 2 s detection timeout);
the job has a deadline (``--deadline``, capped by ``ACCELPACT_BENCH_DEADLINE_S`` from ``bench_all.py``;
each rank stops itself when it passes), SIGTERM/SIGINT stop the ranks, and a rank exits by itself when the
driver is gone.

The code is in ``benchmarks/parts/``: ``repair_setup`` (constants, job file, the job), ``repair_entry`` (the
job's entry point: the three scenarios, rank side), ``repair_analysis`` and ``repair_report`` (result and
markdown), ``repair_main``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as harness  # noqa: E402

harness.add_paths()

from benchmarks.parts.repair_analysis import summary_rows  # noqa: E402
from benchmarks.parts.repair_main import main, markdown  # noqa: E402

__all__ = ["main", "markdown", "summary_rows"]  # bench_all.py renders with markdown and summary_rows

if __name__ == "__main__":
    sys.exit(main(doc=__doc__))
