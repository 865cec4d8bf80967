"""L2 Restart: requeue requests and the no-progress rule.

Pure decisions (:func:`frontier_history`, :func:`stalled`) read the event log;
:func:`request_requeue` is the one place that asks Slurm to requeue the job.

Who calls: the training entry point on every start (``stalled``, rank 0 decides
and the control plane tells the others) and on a fail-stop (``request_requeue``,
rank 0 only); the local launcher plays Slurm's part on the embedded default.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from accelpact_slurm.core.events import EVENTS_FILE, EventLog, read_events
from accelpact_slurm.slurm.hostlist import expand_hostlist

log = logging.getLogger(__name__)

SCONTROL_TIMEOUT_S = 30.0
#: How long rank 0 waits for the controller to say the job's state before a requeue after SIGTERM.
STATE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Attempt:
    """One start of the job (restart count ``restart``): where it began and the furthest it committed."""

    restart: int
    start: int
    reached: int


def frontier_history(events: Iterable[dict]) -> list[Attempt]:
    """Per restart count: the frontier loaded at start and the highest committed step (pure)."""
    start: dict[int, int] = {}
    reached: dict[int, int] = {}
    for e in events:
        r = e.get("restart")
        if not isinstance(r, int):
            continue
        kind = e.get("event")
        if kind == "job_start":
            start.setdefault(r, 0)
            reached.setdefault(r, 0)
        elif kind == "restart_load" and isinstance(e.get("step"), int):
            start[r] = e["step"]
            reached[r] = max(reached.get(r, 0), e["step"])
        elif kind == "step" and isinstance(e.get("step"), int):
            reached[r] = max(reached.get(r, 0), e["step"])
        elif kind == "repair" and isinstance(e.get("frontier"), int):
            reached[r] = max(reached.get(r, 0), e["frontier"])
    return [Attempt(r, start.get(r, 0), reached[r]) for r in sorted(reached)]


def stalled(history: list[Attempt], max_stalled: int) -> tuple[bool, str]:
    """True when the last ``max_stalled`` attempts each failed to commit past the best frontier before them."""
    if max_stalled <= 0 or len(history) <= max_stalled:
        return False, f"{len(history)} start(s) so far, limit {max_stalled} without progress"
    best_before = max((a.reached for a in history[:-max_stalled]), default=0)
    recent = history[-max_stalled:]
    if all(a.reached <= best_before for a in recent):
        return True, (f"{max_stalled} consecutive restarts did not advance the committed frontier past "
                      f"F={best_before} (restarts {recent[0].restart}..{recent[-1].restart})")
    return False, "the committed frontier advanced within the last restarts"


def requeue_after_sigterm(job_state: str | None) -> tuple[bool, str]:
    """Whether rank 0 asks for a requeue after a stop that a SIGTERM asked for, from the job's state (pure).

    ``job_state``: what the controller says now (``scontrol show job``), ``None`` when it did not answer.
    A preemption's first SIGTERM (sent to the steps only; ``scancel --signal=TERM JOBID`` does the same) leaves
    the job RUNNING: requeue, or the job would end with our exit 75 and its work would wait for nobody.  Any
    other state means Slurm is ending the job already and sent the SIGTERM itself: ``scancel`` (shown as
    COMPLETING while our processes live), ``scontrol requeue`` or the end of a preemption's grace time (Slurm
    requeues a preempted job itself), the time limit.  Slurm accepts the requeue of a completing job, so asking
    then would bring a cancelled job back or requeue one twice.  Unknown: requeue (a preemption's work is
    kept; a cancelled job's state is known to the controller that cancelled it).
    """
    if job_state is None:
        return True, "the controller did not say the job's state: requeueing"
    if job_state == "RUNNING":
        return True, "the job still runs (a preemption's notice, or scancel --signal=TERM): requeueing"
    return False, (f"the job is {job_state}: Slurm is ending it already (scancel, a requeue, the time limit or the "
                   f"end of a preemption's grace time, after which Slurm requeues it itself): not requeued")


def controller_job_state(job_id: str, environ: Mapping[str, str]) -> str | None:
    """The job's state as ``scontrol show job`` says it (``RUNNING``, ``COMPLETING``, ...); None without an answer."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              timeout=STATE_TIMEOUT_S, env=dict(environ))
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("scontrol show job %s: %s", job_id, exc)
        return None
    if proc.returncode != 0:
        log.warning("scontrol show job %s exited %d: %s", job_id, proc.returncode, proc.stderr.strip())
        return None
    for word in proc.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return None


def request_requeue(job_id: str, reason: str, events: EventLog | None, environ: Mapping[str, str],
                    emulated: bool, after_sigterm: bool = False, exclude: Sequence[str] = ()) -> bool:
    """Ask Slurm to requeue ``job_id`` (``scontrol requeue``); on the embedded default the launcher does it.

    ``after_sigterm``: the stop was asked for by a SIGTERM: first ask the controller whether the job still
    runs (:func:`requeue_after_sigterm`); when Slurm is ending it already, record why and ask nothing.
    ``exclude``: hosts of nodes lost whole: the requeued job never runs there again (:func:`requeue_excluding`;
    Slurm may not have noticed them yet: it takes ~25 s at best, minutes with its defaults).
    Returns True when the request was accepted (or left to the launcher).
    """
    if emulated:
        if events is not None:
            events.emit("requeue", reason=reason, by="launcher", **({"excluded": list(exclude)} if exclude else {}))
        return True
    if exclude:
        ok, detail, excluded = requeue_excluding(job_id, exclude, environ)
        if events is not None:
            events.emit("requeue", reason=reason, by="scontrol", accepted=ok, detail=detail or None,
                        excluded=excluded)
        if not ok:
            log.error("the requeue of %s excluding %s failed: %s", job_id, ",".join(exclude), detail)
        return ok
    if after_sigterm:
        go, why = requeue_after_sigterm(controller_job_state(job_id, environ))
        if not go:
            log.warning("%s", why)
            if events is not None:
                events.emit("warning", step=None, reason=f"{reason}; {why}")
            return False
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S, env=dict(environ))
        ok = proc.returncode == 0
        detail = proc.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        ok, detail = False, str(exc)
    if events is not None:
        events.emit("requeue", reason=reason, by="scontrol", accepted=ok, detail=detail or None)
    if not ok:
        log.error("scontrol requeue %s failed: %s", job_id, detail)
    return ok


def _scontrol(args: list[str], environ: Mapping[str, str]) -> tuple[bool, str, str]:
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
                              env=dict(environ))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, "", f"scontrol {' '.join(args)}: {exc}"
    return proc.returncode == 0, proc.stdout, proc.stderr.strip()


def excluded_nodes(show_job: str) -> list[str]:
    """The hosts in ``ExcNodeList=`` of ``scontrol show job -o``'s line, expanded (pure)."""
    for word in show_job.split():
        if word.startswith("ExcNodeList="):
            value = word.split("=", 1)[1]
            return [] if value in ("", "(null)") else expand_hostlist(value)
    return []


def requeue_excluding(job_id: str, hosts: Sequence[str], environ: Mapping[str, str]) -> tuple[bool, str, list[str]]:
    """Requeue ``job_id`` so that it never runs on ``hosts`` again: ``scontrol requeuehold`` (a running job's
    ``ExcNodeList`` cannot be changed), then ``ExcNodeList`` = what it was plus ``hosts``, then ``scontrol release``,
    which is always asked once the hold was accepted (else the job would wait held for good).  Returns
    ``(requeued, what went wrong, the job's excluded hosts)``."""
    ok, _out, err = _scontrol(["requeuehold", job_id], environ)
    if not ok:
        return False, err, []
    problems = []
    try:
        shown, out, err = _scontrol(["show", "job", "-o", job_id], environ)
        excluded = sorted(set(excluded_nodes(out) if shown else []) | set(hosts))
        updated, _out, err2 = _scontrol(["update", f"JobId={job_id}", f"ExcNodeList={','.join(excluded)}"],
                                        environ)
        if not updated:
            problems.append(f"ExcNodeList not set ({err2}): the job may run on {','.join(hosts)} again")
            excluded = excluded_nodes(out) if shown else []
    finally:
        released, _out, err3 = _scontrol(["release", job_id], environ)
        if not released:
            problems.append(f"the held requeue was not released ({err3}): run 'scontrol release {job_id}'")
    return released, "; ".join(problems), excluded


def step_outcome(events: Iterable[dict], restart: int) -> int | None:
    """The exit code the ranks of start ``restart`` decided on (76 wins over 75), ``None`` when none did (pure).

    The batch script asks this when the training step ended with a status that is none of the documented
    codes: srun reports 143 once ``--kill-on-bad-exit`` terminated the ranks that were still running after
    the first one left, whether that one fail-stopped or crashed.  A decided stop is not a crash.
    """
    codes = {e.get("exit_code") for e in events if e.get("event") == "fail_stop" and e.get("restart") == restart}
    for code in (76, 75):
        if code in codes:
            return code
    return None


#: The causes of a stop that a start repeats where it meets them again (the same rank, the same place): the OOM
#: killer's limit is the same in the next start.
DETERMINISTIC_CAUSES = ("out-of-memory",)


def repeated_failure(events: Iterable[dict], restart: int) -> str | None:
    """Why start ``restart`` is not to be followed by another, or None (pure): it ended with the same deterministic
    failure (:data:`DETERMINISTIC_CAUSES`) as the start before it, on the same rank at the same place (the
    ``oom_at`` of its ``fail_stop`` events: the update and phase the survivors were in; else the frontier).
    """
    if restart < 1:
        return None
    stops: dict[int, dict[tuple, str]] = {restart: {}, restart - 1: {}}
    for e in events:
        if e.get("event") == "fail_stop" and e.get("restart") in stops and e.get("cause") in DETERMINISTIC_CAUSES:
            at = e.get("oom_at") if isinstance(e.get("oom_at"), dict) else {"update": e.get("frontier")}
            key = (e["cause"], e.get("culprit"), at.get("update"), at.get("phase"))
            stops[e["restart"]].setdefault(key, str(e.get("reason")))
    same = sorted(set(stops[restart]) & set(stops[restart - 1]), key=str)
    if not same:
        return None
    cause, culprit, update, phase = same[0]
    where = f"update {update}" + (f" ({phase})" if phase else "")
    return (f"the same failure ({cause}) on rank {culprit} in {where} ended starts {restart - 1} and {restart}: a "
            f"restart would meet it again; not restarted. {stops[restart][same[0]]}")


def main(argv: list[str] | None = None) -> int:
    """``python -m accelpact_slurm.slurm.requeue outcome RUN_DIR RESTART``: print 75, 76 or ``none``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "outcome":
        print("usage: python -m accelpact_slurm.slurm.requeue outcome RUN_DIR RESTART", file=sys.stderr)
        return 2
    path = os.path.join(args[1], EVENTS_FILE)
    code = step_outcome(read_events(path), int(args[2])) if os.path.exists(path) else None
    print(code if code is not None else "none")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
