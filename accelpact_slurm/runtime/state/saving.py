"""Snapshots asked for, not due: ``run.save()`` at a boundary, and the final snapshot at the job's end.

Who calls, on every rank, in the same order (both are collective): :meth:`accelpact_slurm.runtime.job.api.Run.save`
(the script, between two updates, on a job that takes snapshots) and :meth:`accelpact_slurm.runtime.job.api.Run._final`
(the job's end, :func:`accelpact_slurm.runtime.job.entry.run_rank`, before the digests, ``summary.json`` and
``job_end``: no job reports that it completed before its last update is on disk, verified, or says it is not).

Each call snapshots committed update ``step`` unless this start already took a snapshot of it or loaded it; each rank
then waits (within ``timeouts.startup_s``) until its node's daemon settled it; the answers are gathered over the
control plane so every rank returns the same verdict (:func:`verdict`), and rank 0 writes one ``saved`` event and
prints one line.  A snapshot not verified on every node is no error of the job (its result stands): the line and the
event say which node lacks it and why, and that a restart would resume from an older snapshot.
"""

from __future__ import annotations

import logging
import time
from typing import Any, TextIO

from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.events import EventLog
from accelpact_slurm.core.rank import RankContext

log = logging.getLogger(__name__)

#: What rank 0's line and the ``saved`` event call each trigger.
TRIGGERS = {"final": "the final snapshot", "run.save": "run.save()"}


def refusal(*, closed: bool, inside: int | None, every_steps: int, step: int) -> tuple[str, str] | None:
    """``(value, fix)`` of the :class:`UsageError` ``run.save()`` raises, else None.  Pure.

    ``inside``: the update whose ``with run.update()`` block is open (None between updates).
    """
    if closed:
        return "called after run.close()", "call run.save() before the run is closed (between two updates)"
    if inside is not None:
        return (f"called inside update {inside} (its with run.update() block is still open)",
                "call run.save() between updates, after the with block has closed: a snapshot holds committed "
                "updates only")
    if every_steps <= 0:
        return ("a job without snapshots (checkpoint.every_steps is 0)",
                "set checkpoint.every_steps: N in the job file's checkpoint section (the job then starts a "
                "checkpoint daemon per node and snapshots every N updates; run.save() adds one where the script "
                "asks)")
    if step <= 0:
        return ("called before the first update",
                "call run.save() after an update has committed: update 0 is what the script builds itself on "
                "every start")
    return None


def verdict(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's ``{"node", "host", "state", "why"}`` -> ``{"verified", "states", "reason"}``.  Pure.

    A node counts as verified only when every rank of it heard ``verified`` from its daemon; ``states`` maps each
    node's host name to its worst answer (None: no final state).
    """
    worst: dict[int, dict[str, Any]] = {}
    for a in answers:
        node = int(a["node"])
        if node not in worst or worst[node]["state"] == "verified":
            worst[node] = a
    states = {worst[n]["host"]: worst[n]["state"] for n in sorted(worst)}
    lacking = [worst[n] for n in sorted(worst) if worst[n]["state"] != "verified"]
    if not lacking:
        return {"verified": True, "states": states, "reason": f"verified on every node ({len(states)})"}
    reason = "; ".join(f"{a['host']}: {a['state'] or 'no final state'}: {a['why']}" for a in lacking)
    return {"verified": False, "states": states, "reason": reason}


def settle(rt: RankContext, cfg: JobConfig, client: Any, events: EventLog | None, out: TextIO, step: int, trigger: str, *,
           loaded: bool) -> dict[str, Any]:
    """Collective: a snapshot of committed update ``step``, settled by every node's daemon (see the module).

    ``loaded``: this start loaded ``step`` (verified on every rank's copy by the reload's rule): nothing is taken
    and nothing waited for.  Returns :func:`verdict`'s document with ``step``, ``trigger`` and ``wait_s``.

    Raises:
        ControlPlaneError: the ranks' answers could not be gathered (a rank died meanwhile).
    """
    t0 = time.monotonic()
    if loaded:
        state, why = "verified", f"loaded at this start (restart {rt.ctx.restart_count})"
    else:
        state, why = client.settle(step, cfg.timeouts.startup_s)
    mine = {"node": rt.node, "host": rt.ctx.hostname or f"node {rt.node}", "state": state, "why": why}
    answers = rt.control.all_gather("saved", mine, timeout_s=cfg.timeouts.startup_s + cfg.timeouts.control_s)
    doc = {"step": step, "trigger": trigger, **verdict(answers), "wait_s": round(time.monotonic() - t0, 3)}
    what = TRIGGERS.get(trigger, trigger)
    if doc["verified"]:
        line = f"{what}: update {step} verified on every node ({', '.join(doc['states'])})"
    else:
        line = (f"warning: {what} of update {step} is not verified on every node: {doc['reason']}; "
                f"a restart would resume from an older snapshot")
        if rt.rank != 0:
            log.warning("%s", line)  # this rank's log says it too; rank 0 prints it
    if rt.rank == 0:
        if events is not None:
            events.emit("saved", **doc)
        print(f"[accelpact] {line}", file=out, flush=True)
    return doc
