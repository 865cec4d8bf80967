"""Shared-tier benchmark, the entry point of the job's ranks (``benchmarks/parts/shared.py``).

``bench_shared.py`` starts one job per measured run with the library's launcher (``harness.launch_job``: the
embedded default's ranks and per-node checkpoint daemons); the job file's ``entry:`` names :func:`main` and
its ``params.bench`` holds the plan (``out``: where rank 0 writes, ``deadline_s``).  Each rank builds what the
decoder example builds (``benchmarks.parts.workload.decoder_parts``: its model on the job's mesh, AdamW, schedule, data),
hands it to ``job.protect`` and runs the example's update body inside ``with run.update()`` for the job's
``steps``: the run's own snapshot client snapshots every ``checkpoint.every_steps`` updates and the daemons
write, verify and (with ``checkpoint.shared_every`` > 0) upload to the shared tier, as in any job.

Rank 0 records, for every update, the time from the end of the previous update (its snapshot hand-over
included) to the end of this one: what the training loop pays, background uploads included.  It writes them
to ``out`` as ``{"rank", "update_s"}`` when the loop is done.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).resolve().parents[2]),) if p not in sys.path]

from benchmarks.harness import common as h  # noqa: E402


def main(job: Any) -> None:
    from benchmarks.parts.workload import decoder_parts, update

    plan = job.params["bench"]
    h.guard_rank(plan["deadline_s"])
    parts = decoder_parts(job)
    run = job.protect(parts.model, parts.optimizer, scheduler=parts.scheduler, state={"data": parts.loader})
    times: list[float] = []
    last = time.perf_counter()
    for tokens in run.batches(parts.loader):
        with run.update() as u:
            update(parts, tokens, into=u)
        now = time.perf_counter()  # after the update's commit and, on a snapshot step, its hand-over
        times.append(now - last)
        last = now
    if job.is_lead:
        tmp = plan["out"] + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"rank": job.rank, "update_s": times}, fh)
        os.replace(tmp, plan["out"])
