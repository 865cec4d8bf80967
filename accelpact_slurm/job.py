"""One rank's whole job: join, train, report.

Called by ``accelpact-run`` on every rank (a local process on the embedded
default, an ``srun`` task on Slurm).  Rank 0 writes the job-level events, prints
progress and writes ``summary.json``; every rank writes its membership.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from typing import Mapping, TextIO

from .config import JobConfig
from .errors import EXIT_OK, FailStop
from .events import SUMMARY_FILE, EVENTS_FILE, EventLog
from .slurm_env import SlurmContext

log = logging.getLogger(__name__)


def write_json_atomic(path: str, data: object) -> None:
    """Write JSON under a temporary name, fsync, then rename: readers never see half a file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def run_rank(cfg: JobConfig, ctx: SlurmContext, run_dir: str, environ: Mapping[str, str] | None = None,
             out: TextIO | None = None) -> int:
    """Train this rank to ``cfg.steps`` updates; return the process exit code."""
    # torch is imported here, not at module level, so the CLI's --help stays fast.
    from .topology import init_runtime
    from .workload.state import state_digest
    from .workload.trainer import Trainer
    from .recovery import build_guard

    out = out or sys.stdout
    environ = os.environ if environ is None else environ
    wall0 = time.monotonic()
    events = EventLog(os.path.join(run_dir, EVENTS_FILE), job_id=ctx.job_id, restart=ctx.restart_count,
                      rank=ctx.rank, node=ctx.node_index)
    rt = init_runtime(ctx, cfg, environ)
    lead = rt.rank == 0
    if lead:
        events.emit("job_start", config=cfg.to_dict(), config_digest=cfg.digest(), world_size=rt.layout.world_size,
                    nodes=rt.layout.num_nodes, ranks_per_node=rt.layout.ranks_per_node,
                    hostnames=list(ctx.nodelist), run_dir=os.path.abspath(run_dir))
    events.emit("membership", local_rank=rt.local_rank, hostname=ctx.hostname or socket.gethostname(),
                pid=os.getpid(), shard_ranks=rt.layout.shard_ranks(rt.node),
                replicate_ranks=rt.layout.replicate_ranks(rt.local_rank))
    trainer = Trainer(cfg, rt)
    from ckpt_service.client import SnapshotClient

    snapshots = SnapshotClient(cfg, trainer, run_dir, events)
    snapshots.restore()  # collective: resumes from the newest verified snapshot every rank can reach
    guard = build_guard(cfg, trainer, events)
    if lead:
        print(f"[accelpact] job {ctx.job_id}: {rt.layout.num_nodes} nodes x {rt.layout.ranks_per_node} ranks, "
              f"{cfg.model.fsdp} {cfg.model.mesh}, {cfg.steps} updates, run dir {run_dir}", file=out, flush=True)
    p = trainer.progress
    train_t0 = time.monotonic()
    while p.step < cfg.steps:
        t0 = time.monotonic()
        try:
            mean_loss = guard.run_update()
        except FailStop as stop:
            fail_stop(stop, events, out, lead, rt.control)
        trainer.commit(mean_loss)
        snapshots.after_commit()
        dt = time.monotonic() - t0
        if lead:
            tps = trainer.tokens_per_update / dt if dt > 0 else 0.0
            events.emit("step", step=p.step, loss=mean_loss, tokens_per_s=tps, step_s=dt)
            if p.step % cfg.train.log_every == 0 or p.step == cfg.steps:
                print(f"[accelpact] step {p.step:>5}/{cfg.steps}  loss {mean_loss:.4f}  "
                      f"tokens/s {tps:,.0f}  ({dt * 1000:.0f} ms/update)", file=out, flush=True)
    train_s = time.monotonic() - train_t0
    digest = state_digest(trainer)
    wall_s = time.monotonic() - wall0
    if lead:
        summary = {
            "job_id": ctx.job_id,
            "final_step": p.step,
            "final_loss": p.losses[-1] if p.losses else None,
            "wall_s": wall_s,
            "train_s": train_s,
            "final_state_digest": digest,
            "exit_code": EXIT_OK,
            "world_size": rt.layout.world_size,
            "nodes": rt.layout.num_nodes,
            "ranks_per_node": rt.layout.ranks_per_node,
            "restart_count": ctx.restart_count,
            "losses": p.losses,
        }
        write_json_atomic(os.path.join(run_dir, SUMMARY_FILE), summary)
        events.emit("job_end", final_step=p.step, final_loss=summary["final_loss"], wall_s=wall_s,
                    final_state_digest=digest, exit_code=EXIT_OK)
        print(f"[accelpact] done: {p.step} updates in {wall_s:.1f} s, final loss {summary['final_loss']:.4f}\n"
              f"[accelpact] final_state_digest {digest}\n"
              f"[accelpact] summary: {os.path.join(run_dir, SUMMARY_FILE)}", file=out, flush=True)
    snapshots.close()
    rt.control.barrier("job-end")
    rt.control.leave("job-end", cfg.timeouts.shutdown_s)
    events.close()
    rt.close()
    return EXIT_OK


def fail_stop(stop: FailStop, events: EventLog, out: TextIO, lead: bool, control=None) -> None:
    """Stop this rank now: write the event, flush, exit with the documented code.

    ``os._exit`` skips interpreter teardown on purpose: destroying a process group
    whose peers are gone can block, and nothing may be written after the decision.
    """
    ctx = stop.context
    decided = ctx.get("decided_at")
    if control is not None:
        try:  # keep the control store (hosted by rank 0) up until every live rank has read the decision
            control.leave("fail-stop", 1.0)
        except Exception:  # the store may be gone already: nothing left to protect
            pass
    decision_s = time.monotonic() - decided if isinstance(decided, float) else None
    events.emit("fail_stop", reason=stop.reason, exit_code=stop.exit_code, phase=ctx.get("phase"),
                frontier=ctx.get("frontier"), decision_s=decision_s, decision="restart", key=ctx.get("key"))
    if lead:
        print(f"[accelpact] fail-stop at F={ctx.get('frontier')}: {stop.reason} (exit {stop.exit_code})",
              file=out, flush=True)
    events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(stop.exit_code)
