"""One rank of our per-update overhead measurement for ``scripts/bench_peers.py`` (project venv).

The harness starts ``nodes x ranks_per_node`` of these with the environment ``accelpact-run`` gives its
ranks on the embedded default (emulated Slurm variables, rendezvous ports).  Each rank builds exactly
what ``job.run_rank`` builds (``init_runtime``: Gloo world, 2-D mesh, control plane; ``Trainer``: FSDP1
HYBRID_SHARD CausalDecoder, AdamW; ``build_guard``: boundary guard + repair engine) and then runs
interleaved segments of

    plain    forward, backward, optimizer step, commit (the same model trained with no guard)
    guarded  ``guard.run_update()`` (forward, backward, optimizer step, the boundary collective on the
             replication group and the world's vote over the control plane), commit

``--steps`` updates each, the order alternating from round to round, after ``--warmup`` plain updates.
A segment is timed on rank 0 from a control-plane barrier to the next one (the same two barriers in
both modes), so it ends when its slowest rank is done.
No snapshots, no events beyond the guard's own: this is the guard's cost alone.  Rank 0 appends one JSON
line per segment to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=120.0)
    args = ap.parse_args()

    def watchdog() -> None:
        time.sleep(args.deadline_s)
        os._exit(3)

    threading.Thread(target=watchdog, name="deadline", daemon=True).start()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import Records

    from accelpact_slurm.core.config import load_config
    from accelpact_slurm.core.events import EventLog
    from accelpact_slurm.runtime.recovery import build_guard
    from accelpact_slurm.slurm.env import SlurmContext
    from accelpact_slurm.runtime.topology import init_runtime
    from accelpact_slurm.workload.trainer import Trainer, lm_loss

    cfg = load_config(args.config)
    ctx = SlurmContext.from_environ(os.environ)
    rt = init_runtime(ctx, cfg, os.environ)
    trainer = Trainer(cfg, rt)
    events = EventLog(args.out + f".events-{rt.rank}", job_id=ctx.job_id, rank=rt.rank)
    guard = build_guard(cfg, trainer, events)
    rec = Records(args.out, rank=rt.rank) if rt.rank == 0 else None

    def plain() -> None:
        trainer.model.train()
        loss = lm_loss(trainer.model, trainer.batch())
        loss.backward()
        trainer.optimizer_step()
        trainer.commit(float(loss.detach()))

    def guarded() -> None:
        trainer.commit(guard.run_update())

    for _ in range(args.warmup):
        plain()
    for r in range(args.rounds):
        for mode in (("plain", "guarded") if r % 2 == 0 else ("guarded", "plain")):
            rt.control.barrier("bench-segment")
            fn = plain if mode == "plain" else guarded
            dts = []
            start = time.perf_counter()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                fn()
                dts.append(time.perf_counter() - t0)
            rt.control.barrier("bench-segment-end")  # the segment ends when its slowest rank is done
            if rec is not None:
                rec.emit("segment", mode=mode, round=r, dts=dts, seg_s=time.perf_counter() - start)
    rt.control.barrier("bench-end")
    if rec is not None:
        rec.emit("done", world=rt.layout.world_size)
    rt.control.leave("bench-end", cfg.timeouts.shutdown_s)
    events.close()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
