"""Peers benchmark, our per-update overhead: the entry point of our ranks' job (``benchmarks/parts/peers.py``).

``peers_runs.run_ours_overhead`` starts the job's ranks with the library's launcher (the environment
``accelpact-run`` gives its ranks on the embedded default); the job file's ``entry:`` names :func:`main`
and its ``params.bench`` holds the plan.  Each rank builds what the decoder example builds (FSDP1
HYBRID_SHARD ``CausalDecoder`` on the job's mesh, AdamW, its schedule and data: ``benchmarks.parts.workload.decoder_parts``),
hands them to ``job.protect`` and then runs interleaved segments of

    plain    the example's update body (forward, backward, optimizer step) without the guard
    guarded  the same body inside ``with run.update()`` (then the boundary collective on the replication
             group and the world's vote over the control plane)

``steps`` updates each, the order alternating from round to round, after ``warmup`` plain updates.
A segment is timed on rank 0 from a control-plane barrier to the next one (the same two barriers in
both modes), so it ends when its slowest rank is done.  No snapshots: this is the guard's cost alone.
Rank 0 appends one JSON line per segment to the plan's ``out``.  The entry point then returns and
``accelpact-run`` ends the job as usual (state digest, summary).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).resolve().parents[2]),) if p not in sys.path]

from accelpact_slurm.runtime.job import instrument  # noqa: E402
from benchmarks.harness import common as h  # noqa: E402


def main(job: Any) -> None:
    from benchmarks.parts.workload import batches_forever, decoder_parts, update
    from benchmarks.parts.peers_workers.common import Records

    plan = job.params["bench"]
    h.guard_rank(plan["deadline_s"])
    parts = decoder_parts(job)
    run = job.protect(parts.model, parts.optimizer, scheduler=parts.scheduler)
    control = instrument.runtime(job).control  # the barriers that delimit a segment (the same in both modes)
    batches = batches_forever(parts.loader)
    rec = Records(plan["out"], rank=job.rank) if job.is_lead else None

    def guarded() -> None:
        with run.update() as u:
            update(parts, next(batches), into=u)

    for _ in range(plan["warmup"]):
        update(parts, next(batches))
    for r in range(plan["rounds"]):
        for mode in h.abba(r, "plain", "guarded"):
            control.barrier("bench-segment")
            dts = []
            start = time.perf_counter()
            for _ in range(plan["steps"]):
                t0 = time.perf_counter()
                if mode == "plain":
                    update(parts, next(batches))
                else:
                    guarded()
                dts.append(time.perf_counter() - t0)
            control.barrier("bench-segment-end")  # the segment ends when its slowest rank is done
            if rec is not None:
                rec.emit("segment", mode=mode, round=r, dts=dts, seg_s=time.perf_counter() - start)
    control.barrier("bench-end")
    if rec is not None:
        rec.emit("done", world=job.world_size)
