"""One rank's whole job: join, train, report.

Called by ``accelpact-run`` on every rank (a local process on the embedded
default, an ``srun`` task on Slurm).  Rank 0 writes the job-level events, prints
progress and writes ``summary.json``; every rank writes its membership.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import Mapping, TextIO

from accelpact_slurm.core.atomic import write_json_atomic
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_OK, EXIT_REQUEUE, FailStop
from accelpact_slurm.slurm.requeue import SCONTROL_TIMEOUT_S, frontier_history, request_requeue, stalled
from accelpact_slurm.core.events import SUMMARY_FILE, EVENTS_FILE, EventLog, read_events
from accelpact_slurm.slurm.env import SlurmContext

log = logging.getLogger(__name__)


def run_rank(cfg: JobConfig, ctx: SlurmContext, run_dir: str, environ: Mapping[str, str] | None = None,
             out: TextIO | None = None) -> int:
    """Train this rank to ``cfg.steps`` updates; return the process exit code."""
    # torch is imported here, not at module level, so the CLI's --help stays fast.
    from accelpact_slurm.runtime.topology import init_runtime
    from accelpact_slurm.runtime.state import state_digest
    from accelpact_slurm.workload.trainer import Trainer
    from accelpact_slurm.runtime.recovery import build_guard

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
    check_progress(cfg, ctx, rt, run_dir, events, out)
    trainer = Trainer(cfg, rt)
    from ckpt_service.client import SnapshotClient

    snapshots = SnapshotClient(cfg, trainer, run_dir, events)
    try:
        snapshots.restore()  # collective: resumes from the newest verified snapshot every rank can reach
    except FailStop as stop:  # no usable snapshot left after a failed replay check: start again
        fail_stop(stop, events, out, lead, rt.control, ctx, environ)
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
            fail_stop(stop, events, out, lead, rt.control, ctx, environ)
        trainer.commit(mean_loss)
        snapshots.after_commit()
        dt = time.monotonic() - t0
        if lead:
            tps = trainer.tokens_per_update / dt if dt > 0 else 0.0
            events.emit("step", step=p.step, loss=mean_loss, tokens_per_s=tps, step_s=dt)
            if p.step % cfg.train.log_every == 0 or p.step == cfg.steps:
                print(f"[accelpact] step {p.step:>5}/{cfg.steps}  loss {mean_loss:.4f}  "
                      f"tokens/s {tps:,.0f}  ({dt * 1000:.0f} ms/update)", file=out, flush=True)
        if guard.stop_requested and p.step < cfg.steps:
            stop_for_requeue(cfg, ctx, trainer, snapshots, events, out, lead)
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


def fail_stop(stop: FailStop, events: EventLog, out: TextIO, lead: bool, control=None,
              ctx: SlurmContext | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Stop this rank now: write the event, flush, exit with the documented code.

    ``os._exit`` skips interpreter teardown on purpose: destroying a process group
    whose peers are gone can block, and nothing may be written after the decision.
    """
    slurm, ctx = ctx, stop.context
    decided = ctx.get("decided_at")
    # srun --kill-on-bad-exit TERMs the remaining ranks as soon as one exits: finish the event and, on rank 0,
    # the requeue request first (SIGKILL follows after Slurm's KillWait, far longer than this takes).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if control is not None:
        try:  # keep the control store (hosted by rank 0) up until every live rank has read the decision
            control.leave("fail-stop", 1.0)
        except Exception:  # the store may be gone already: nothing left to protect
            pass
    decision_s = time.monotonic() - decided if isinstance(decided, float) else None
    events.emit("fail_stop", reason=stop.reason, exit_code=stop.exit_code, phase=ctx.get("phase"),
                frontier=ctx.get("frontier"), decision_s=decision_s,
                decision="restart" if stop.exit_code == EXIT_REQUEUE else "stop", key=ctx.get("key"))
    if lead:
        print(f"[accelpact] fail-stop at F={ctx.get('frontier')}: {stop.reason} (exit {stop.exit_code})",
              file=out, flush=True)
        if stop.exit_code == EXIT_REQUEUE and slurm is not None:
            request_requeue(slurm.job_id, stop.reason, events, environ or os.environ, emulated(environ))
        if control is not None:
            try:
                control.post("fail-stop-requeue-asked")
            except Exception:  # nobody left to tell
                pass
    elif stop.exit_code == EXIT_REQUEUE and control is not None:
        # The first task to exit makes srun --kill-on-bad-exit TERM the rest: leave only once rank 0 has asked
        # Slurm for the requeue (bounded; False when rank 0 is gone, and then nobody can ask anyway).
        control.wait_posted("fail-stop-requeue-asked", SCONTROL_TIMEOUT_S + 5)
    events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(stop.exit_code)


def emulated(environ: Mapping[str, str] | None) -> bool:
    """True on the embedded default, where the local launcher plays Slurm's part."""
    return (environ or os.environ).get("ACCELPACT_EMULATED") == "1"


def check_progress(cfg: JobConfig, ctx: SlurmContext, rt, run_dir: str, events: EventLog, out: TextIO) -> None:
    """On a restart, stop for good when the last restarts did not advance the committed frontier."""
    if ctx.restart_count == 0:
        return
    verdict = None
    if rt.rank == 0:
        history = [a for a in frontier_history(read_events(os.path.join(run_dir, EVENTS_FILE)))
                   if a.restart < ctx.restart_count]
        stop, why = stalled(history, cfg.recovery.max_stalled_restarts)
        verdict = {"stop": stop, "why": why}
    verdict = rt.control.broadcast("progress-check", verdict)
    if verdict["stop"]:
        reason = (f"no progress: {verdict['why']}; not requeueing. Look at the fail_stop and fault events in "
                  f"{os.path.join(run_dir, EVENTS_FILE)} (accelpact-status {run_dir}) for the fault that recurs")
        fail_stop(FailStop(reason, EXIT_NO_REQUEUE, phase="start", frontier=None, decided_at=time.monotonic()),
                  events, out, rt.rank == 0, rt.control)


def stop_for_requeue(cfg: JobConfig, ctx: SlurmContext, trainer, snapshots, events: EventLog, out: TextIO,
                     lead: bool) -> None:
    """Pre-timeout or preemption: snapshot this committed boundary, wait until it is committed, requeue."""
    from accelpact_slurm.slurm import signals

    step = trainer.progress.step
    state = snapshots.snapshot_and_wait(cfg.timeouts.startup_s)
    # Nodes settle at different times. Once one rank exits 75, srun --kill-on-bad-exit TERMs the others: a rank
    # still waiting for its node's daemon (rank 0 among them) would die before the requeue request. So every rank
    # ignores SIGTERM from here and waits for all the others before any of them stops.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        states = trainer.rt.control.all_gather("requeue-stop", state,
                                               timeout_s=cfg.timeouts.startup_s + cfg.timeouts.control_s)
    except Exception as exc:  # a rank died meanwhile: stop anyway, rank 0 still asks for the requeue
        log.warning("not every rank reached the requeue stop: %s", exc)
        states = [state]
    state = states[0] if len(set(states)) == 1 else "/".join(sorted({str(s) for s in states}))
    reason = f"{signals.reason()} received: snapshot of step {step} is {state}; requeueing"
    if lead:
        print(f"[accelpact] {reason}", file=out, flush=True)
    fail_stop(FailStop(reason, EXIT_REQUEUE, phase="committed", frontier=step, decided_at=time.monotonic()),
              events, out, lead, trainer.rt.control, ctx)
