#!/usr/bin/env python3
"""Recovery: from the fault to training again, per fault class, with the shipped default timeouts.

For each fault class (a stalled link at the boundary and in backward, SIGKILL and SIGSTOP of a rank, a
training-code exception, SIGKILL of a checkpoint daemon) the time from the injection to the next committed
update of the slowest rank (for a bug: to the job's exit), over several trials of ``accelpact-run`` on the
embedded default (2 emulated nodes x 2 ranks, the decoder example), the classes rotated in every round; beside
it torchft and NVRx's in-job restart driving the same FSDP HSDP model on the same four ranks on the faults each
has (``benchmarks/parts/recovery_torchft.py``, ``recovery_nvrx.py``); the first snapshot after a restart on the
110M-parameter model; what the detector costs an update against the code before it (ABBA); and the heartbeat
path alone at 4, 64 and 256 emulated ranks (writes and bytes
per second, the store host's CPU), which must grow as N.

Output: ``--json`` (default ``runs/bench/<date>/recovery.json``) and the block between
``<!-- recovery-bench -->`` markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts' summaries).

Usage: .venv/bin/python benchmarks/parts/recovery.py [--trials 5] [--classes kill,stop] [--peers torchft,nvrx]
       .venv/bin/python benchmarks/parts/recovery.py --render runs/bench/<date>/recovery.json

About 20 minutes here with the defaults (30 of our jobs of 12-25 s, 3 trials of each peer's faults, the 110M job,
six jobs for the cost).

The code is in ``benchmarks/parts/``: ``recovery_entry`` (our ranks' entry point), ``recovery_runs`` (one job),
``recovery_traffic`` (the heartbeat path), ``recovery_cost`` (the ABBA cost), ``recovery_torchft`` and
``recovery_nvrx`` (the peers' drivers), ``recovery_main``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as harness  # noqa: E402

harness.add_paths()

from benchmarks.parts.recovery_main import main, markdown  # noqa: E402

__all__ = ["main", "markdown"]  # bench_all.py renders with markdown

if __name__ == "__main__":
    sys.exit(main(doc=__doc__))
