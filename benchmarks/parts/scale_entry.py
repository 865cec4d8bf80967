"""Snapshots at scale, the entry point of the job's ranks (``benchmarks/parts/scale.py``).

``benchmarks/parts/scale_runs.py`` starts every job of the part with the library's launcher (``harness.launch_job``:
the embedded default's ranks and per-node checkpoint daemons); the job file's ``entry:`` names :func:`main` and its
``params.bench`` holds the plan (``deadline_s``: how long a rank may live).  The rank arms its own deadline
(``harness.guard_rank``) and then runs the decoder example's entry point unchanged
(``examples/decoder/train_decoder.py:main``) at the size the job file's ``params`` give.  Everything the part
measures comes from the run's own ``events.jsonl`` and ``summary.json`` and from ``/proc``, so this file records
nothing itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).resolve().parents[2]),) if p not in sys.path]

from benchmarks.harness import common as h  # noqa: E402


def main(job: Any) -> None:
    from benchmarks.parts.workload import train_module

    h.guard_rank(job.params["bench"]["deadline_s"])
    train_module().main(job)
