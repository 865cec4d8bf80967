"""How a rank stops: fail-stop (the documented exit codes), the no-progress rule, the requeue stop.

A fail-stop decides and announces the stop, then raises :class:`~accelpact_slurm.core.errors.Stopped` into the
script, whose ``finally`` blocks and context managers run on the way out; :func:`exit_stopped` ends the rank.

Who calls: :class:`accelpact_slurm.runtime.job.api.Run` (a Restart decision, a pre-timeout signal, a
failed replay check) and :func:`accelpact_slurm.runtime.job.entry.run_rank` (the no-progress check at start, and
:func:`exit_stopped` around the entry point).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Mapping, NoReturn, TextIO

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.errors import (EXIT_NO_REQUEUE, EXIT_REQUEUE, EXIT_USAGE, CheckpointError, ConfigError,
                                         ControlPlaneError, FailStop, Stopped)
from accelpact_slurm.core.events import EVENTS_FILE, EventLog, read_events
from accelpact_slurm.core.rank import RankContext
from accelpact_slurm.ops.stops import last_committed_step
from accelpact_slurm.runtime.detection.peers import GONE_CAUSES, name_gone
from accelpact_slurm.slurm import signals
from accelpact_slurm.slurm.env import SlurmContext
from accelpact_slurm.slurm.requeue import (SCONTROL_TIMEOUT_S, frontier_history, repeated_failure, request_requeue,
                                           stalled)
from ckpt_service.client import join_handovers

log = logging.getLogger(__name__)

#: How long a fail-stop waits for a snapshot's hand-over still running on its thread (normally milliseconds).
HANDOVER_JOIN_S = 5.0
#: How long the script may take to unwind once its stop was raised (its ``finally`` blocks and context managers):
#: past it the rank ends anyway (:func:`exit_stopped` from a timer thread), e.g. a ``finally`` blocked in a
#: collective whose peers are gone, or a script that caught :class:`Stopped` and went on.
STOP_GRACE_S = 5.0
#: How long the stop hooks (``job.on_stop``) may run, all together, before the rank exits without them.
STOP_HOOKS_S = 5.0

_raised: Stopped | None = None  # this rank's stop, once raised into the script
_hooks: list[Callable[[Stopped], Any]] = []
_leaving = threading.Lock()  # the hooks run once: the unwound script or the grace's timer, whichever comes first


def fail_stop(stop: FailStop, events: EventLog, out: TextIO, lead: bool, control: Any = None,
              ctx: SlurmContext | None = None, environ: Mapping[str, str] | None = None) -> NoReturn:
    """Stop this rank now: say why to the other ranks, write the event, flush, then raise :class:`Stopped` (with
    the documented exit code) into the script, which unwinds to :func:`exit_stopped`.

    First the rank's heartbeat record says it stops, with the cause and the exit code (a peer waiting on it
    stops the same way at once, instead of calling it dead); a hung rank of this node gets its stacks dumped and
    is killed by its lowest peer (it would otherwise outlive the start).  Nothing of the project is written after
    the decision (the event log is closed).  A second call on this rank (the script's ``finally`` raised, or it
    caught the stop) raises the first stop again: one decision per rank.
    """
    global _raised
    if _raised is not None:
        raise _raised
    slurm, info = ctx, stop.context
    decided = info.get("decided_at")
    # srun --kill-on-bad-exit TERMs the remaining ranks as soon as one exits: finish the event and, on rank 0,
    # the requeue request first (SIGKILL follows after Slurm's KillWait, far longer than this takes).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    detector = getattr(control, "watch", None)
    if detector is not None and detector.publisher is not None and detector.publisher.ended_by_peer():
        # This rank was hung: a peer resumed it only to take its stacks and is killing it; it decides nothing
        # and unwinds nothing (the SIGKILL is on its way).
        os._exit(stop.exit_code)
    culprit = info.get("rank")
    if detector is not None:
        detector.publish_stop({"cause": stop.cause, "reason": stop.reason, "exit_code": stop.exit_code,
                               "rank": culprit})
        if control is not None:  # a verdict names the first rank seen gone: name every one, and a node lost whole
            stop = name_gone(stop, detector, control.world_size)
            info = stop.context

    if join_handovers(HANDOVER_JOIN_S):  # the last snapshot's hand-over to the daemon, cut short by the exit else
        log.warning("a snapshot's hand-over to the checkpoint daemon did not finish within %g s", HANDOVER_JOIN_S)
    killed = None
    if stop.cause == "hung-rank" and detector is not None and isinstance(culprit, int):
        killed = detector.end_hung_peer(culprit)
    if control is not None:
        gone = detector.gone(culprit if stop.cause in GONE_CAUSES else None) \
            if detector is not None else set()
        named: dict[str, Any] = info.get("gone") or {}  # type: ignore[assignment]  # a dict where set (name_gone)
        gone = set(gone) | set(named.get("ranks") or ())
        try:  # keep the control store (hosted by rank 0) up until every live rank has read the decision
            control.leave("fail-stop", 1.0, gone)
        except Exception:  # the store may be gone already: nothing left to protect
            pass
    decision_s = time.monotonic() - decided if isinstance(decided, float) else None
    # Where the job was when the OOM killer struck (this rank's update and phase): a restart that stops at the same
    # place again meets the same limit (the launcher's repeated-failure rule compares it).
    where = {"update": detector.state.update, "phase": detector.state.phase} \
        if stop.cause == "out-of-memory" and detector is not None else None
    exception = info.get("exception")
    events.emit("fail_stop", reason=stop.reason, exit_code=stop.exit_code, cause=stop.cause, phase=info.get("phase"),
                frontier=info.get("frontier"), decision_s=decision_s,
                decision="restart" if stop.exit_code == EXIT_REQUEUE else "stop", key=info.get("key"),
                **({"culprit": culprit} if isinstance(culprit, int) else {}),
                **({"exception": exception} if isinstance(exception, dict) else {}),
                **({"gone_ranks": named_gone["ranks"], "lost_nodes": named_gone["nodes"]}
                   if isinstance(named_gone := info.get("gone"), dict) else {}),
                **({"oom_at": where} if where else {}),
                **({"hung_rank_ended": killed} if killed else {}))
    line = f"fail-stop {_where(info.get('frontier'), events)} ({stop.cause}): {stop.reason} (exit {stop.exit_code})"
    if not lead:
        log.warning("%s", line)  # this rank's log says why it stopped, too
    if lead:
        print(f"[accelpact] {line}", file=out, flush=True)
        if stop.exit_code == EXIT_REQUEUE and slurm is not None:
            gone = info.get("gone")
            lost = gone.get("nodes") or [] if isinstance(gone, dict) else []  # nodes lost whole: not again
            hosts = [slurm.nodelist[n] for n in lost if isinstance(n, int) and 0 <= n < len(slurm.nodelist)]
            request_requeue(slurm.job_id, stop.reason, events, environ or os.environ, settings.emulated(environ),
                            exclude=hosts,
                            after_sigterm=bool(info.get("after_sigterm")))
        if control is not None:
            try:
                control.post("fail-stop-requeue-asked")
            except Exception:  # nobody left to tell
                pass
    elif stop.exit_code == EXIT_REQUEUE and control is not None and stop.cause != "control-plane":
        # The first task to exit makes srun --kill-on-bad-exit TERM the rest: leave only once rank 0 has asked
        # Slurm for the requeue (bounded; False when rank 0 is gone, and then nobody can ask anyway).
        control.wait_posted("fail-stop-requeue-asked", SCONTROL_TIMEOUT_S + 5)
    events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    _raised = Stopped(stop.reason, stop.exit_code, stop.cause)
    grace = threading.Timer(STOP_GRACE_S, exit_stopped,
                            (_raised, f"the script did not unwind within {STOP_GRACE_S:g} s of its stop"))
    grace.daemon = True
    grace.start()
    raise _raised


def reraise() -> None:
    """Raise this rank's stop again if it was raised already (the script caught it and went on): a stop cannot be
    cancelled."""
    if _raised is not None:
        raise _raised


def on_stop(fn: Callable[[Stopped], Any]) -> None:
    """Register a stop hook (``job.on_stop``): called once with the :class:`Stopped` before the rank exits."""
    _hooks.append(fn)


def exit_stopped(stop: Stopped, why: str | None = None) -> NoReturn:
    """End the rank on a stop, once the script has unwound (or ``why`` it did not): the stop hooks, in order, on a
    thread of their own within :data:`STOP_HOOKS_S` (an exception in one is logged, never changes the exit code),
    then ``os._exit`` with the stop's code.  ``os._exit`` skips interpreter teardown on purpose: destroying a
    process group whose peers are gone can block."""
    _leaving.acquire()  # held until the exit: a second caller waits for it
    if why:
        log.warning("%s; the rank exits %d", why, stop.exit_code)
    if _hooks:
        hooks = threading.Thread(target=_run_hooks, args=(stop,), name="accelpact-stop-hooks", daemon=True)
        hooks.start()
        hooks.join(STOP_HOOKS_S)
        if hooks.is_alive():
            log.warning("the stop hooks did not return within %g s; the rank exits %d without them", STOP_HOOKS_S,
                        stop.exit_code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(stop.exit_code)


def _run_hooks(stop: Stopped) -> None:
    for fn in list(_hooks):
        try:
            fn(stop)
        except BaseException:  # the script's own error: logged, the stop's exit code stays
            log.exception("the stop hook %s raised; the rank still exits %d", getattr(fn, "__qualname__", fn),
                          stop.exit_code)


def _where(frontier: Any, events: EventLog) -> str:
    """``at F=N`` for the stop's line: its own frontier, else the newest update the event log committed (a stop
    raised where no update number is at hand: a restore, the control plane), else that none was committed."""
    if isinstance(frontier, int) and not isinstance(frontier, bool):
        return f"at F={frontier}"
    logged = last_committed_step(events.path) if isinstance(getattr(events, "path", None), str) else None
    return "before any committed update" if logged is None else f"at F={logged} (the log's newest committed update)"


def as_fail_stop(exc: BaseException, phase: str | None = None, frontier: int | None = None) -> FailStop:
    """The fail-stop for one of the project's own errors that reached the top of a rank (pure).

    Bad input (a ``ConfigError``, a ``UsageError``) exits 2, not requeued; a control plane that failed or timed out,
    a snapshot that could not be loaded, a repair that failed, ask for the requeue.
    """
    if isinstance(exc, FailStop):
        return exc
    if isinstance(exc, ConfigError):
        return FailStop(str(exc), EXIT_USAGE, cause="config", phase=phase, frontier=frontier,
                        decided_at=time.monotonic())
    cause = "control-plane" if isinstance(exc, ControlPlaneError) else \
        "checkpoint" if isinstance(exc, CheckpointError) else "link"
    return FailStop(f"{type(exc).__name__}: {exc}", EXIT_REQUEUE, cause=cause, phase=phase, frontier=frontier,
                    decided_at=time.monotonic())


def check_progress(cfg: JobConfig, ctx: SlurmContext, rt: RankContext, run_dir: str, events: EventLog, out: TextIO) -> None:
    """On a restart, stop for good when the last restarts did not advance the committed frontier."""
    if ctx.restart_count == 0:
        return
    verdict = None
    if rt.rank == 0:
        events_so_far = list(read_events(os.path.join(run_dir, EVENTS_FILE)))
        history = [a for a in frontier_history(events_so_far) if a.restart < ctx.restart_count]
        stop, why = stalled(history, cfg.recovery.max_stalled_restarts)
        # On Slurm (the embedded default's launcher stops before): the last two starts' same OOM kill recurs here.
        repeated = repeated_failure(events_so_far, ctx.restart_count - 1)
        verdict = {"stop": stop or bool(repeated), "why": repeated or why}
    verdict = rt.control.broadcast("progress-check", verdict)
    if verdict["stop"]:
        reason = (f"no progress: {verdict['why']}; not requeueing. Look at the fail_stop and fault events in "
                  f"{os.path.join(run_dir, EVENTS_FILE)} (accelpact-status {run_dir}) for the fault that recurs")
        fail_stop(FailStop(reason, EXIT_NO_REQUEUE, cause="no-progress", phase="start", frontier=None,
                           decided_at=time.monotonic()), events, out, rt.rank == 0, rt.control)


def stop_for_requeue(step: int, cfg: JobConfig, ctx: SlurmContext, rt: RankContext, snapshots: Any, events: EventLog,
                     out: TextIO) -> None:
    """Pre-timeout (USR2) or preemption (USR2 or SIGTERM): snapshot this committed boundary, wait until it is
    settled, requeue.

    After a SIGTERM on any rank, rank 0 asks for the requeue only while the job still runs (a preemption's
    notice); a job Slurm is already ending (scancel, a requeue, the time limit) is not requeued by us.
    """
    lead = rt.rank == 0
    state = snapshots.snapshot_and_wait(step, cfg.timeouts.startup_s)
    # Nodes settle at different times. Once one rank exits 75, srun --kill-on-bad-exit TERMs the others: a rank
    # still waiting for its node's daemon (rank 0 among them) would die before the requeue request. So every rank
    # ignores SIGTERM from here and waits for all the others before any of them stops.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mine = {"state": state, "signals": signals.received()}
    try:
        gathered = rt.control.all_gather("requeue-stop", mine,
                                         timeout_s=cfg.timeouts.startup_s + cfg.timeouts.control_s)
    except Exception as exc:  # a rank died meanwhile: stop anyway, rank 0 still asks for the requeue
        log.warning("not every rank reached the requeue stop: %s", exc)
        gathered = [mine]
    states = [g["state"] for g in gathered]
    state = states[0] if len(set(states)) == 1 else "/".join(sorted({str(s) for s in states}))
    # A rank's own flag may be empty (the vote stopped it): name what any rank received.
    names = sorted({name for g in gathered for name in g["signals"]}) or ["stop request"]
    reason = f"{'/'.join(names)} received: snapshot of step {step} is {state}; requeueing"
    if lead:
        print(f"[accelpact] {reason}", file=out, flush=True)
    fail_stop(FailStop(reason, EXIT_REQUEUE, cause="signal", phase="committed", frontier=step,
                       decided_at=time.monotonic(), after_sigterm="SIGTERM" in names),
              events, out, lead, rt.control, ctx)
