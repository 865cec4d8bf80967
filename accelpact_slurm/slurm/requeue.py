"""L2 Restart: requeue requests and the no-progress rule.

Pure decisions (:func:`frontier_history`, :func:`stalled`) read the event log;
:func:`request_requeue` is the one place that asks Slurm to requeue the job.

Who calls: the training entry point on every start (``stalled``, rank 0 decides
and the control plane tells the others) and on a fail-stop (``request_requeue``,
rank 0 only); the local launcher plays Slurm's part on the embedded default.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from typing import Iterable, Mapping

from accelpact_slurm.core.events import EventLog

log = logging.getLogger(__name__)

SCONTROL_TIMEOUT_S = 30.0


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


def request_requeue(job_id: str, reason: str, events: EventLog | None, environ: Mapping[str, str],
                    emulated: bool) -> bool:
    """Ask Slurm to requeue ``job_id`` (``scontrol requeue``); on the embedded default the launcher does it.

    Returns True when the request was accepted (or left to the launcher).
    """
    if emulated:
        if events is not None:
            events.emit("requeue", reason=reason, by="launcher")
        return True
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


def main(argv: list[str] | None = None) -> int:
    """``python -m accelpact_slurm.slurm.requeue outcome RUN_DIR RESTART``: print 75, 76 or ``none``."""
    import os
    import sys

    from accelpact_slurm.core.events import EVENTS_FILE, read_events

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
