"""A dead peer is never a bug: before an error is called the training code's, every peer must be alive.

A collective or store call fails when a peer is gone (Gloo's ``Connection closed by peer``, a store whose host is
gone).  Raised outside an update's vote (a snapshot's capture proof, a restore, the user's code between updates) it
reaches the top of the rank like any other error, and calling it a bug would stop the job for good (exit 76) after a
node was lost.  So first a rank asks the heartbeats (:mod:`.liveness`): a rank marked ``dead`` (its node peer's
pidfd) or whose counter has not moved for ``timeouts.heartbeat_s`` is gone, and the stop is L2 (exit 75), naming
every gone rank and every node gone whole; a rank that stopped saying why is adopted, as a collective's wait adopts
it; once every other counter has moved since the error, every peer lives and the error is the training code's.  The
look is bounded (``heartbeat_s`` plus two intervals).  :func:`judge_peers` decides (pure); :func:`dead_peer_stop`
looks.

Who calls: :func:`accelpact_slurm.runtime.job.entry.run_rank`, on an exception that left the entry point (or the
job's end), before it is classified; :func:`accelpact_slurm.runtime.job.stopping.fail_stop`, on a stop on a dead or
hung rank, to name every rank gone with it (:func:`name_gone`).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from accelpact_slurm.core.errors import EXIT_REQUEUE, FailStop
from accelpact_slurm.runtime.detection import liveness as lv

log = logging.getLogger(__name__)

#: The causes of a stop on a rank that is gone (its process ended, it hangs, or the OOM killer ended it).
GONE_CAUSES = ("dead-rank", "hung-rank", "out-of-memory")
#: Between two looks at the other ranks' records while the check lasts.
LOOK_S = 0.05
#: Beyond ``heartbeat_s``, how many heartbeat intervals the check waits before it decides on what it saw.
SLACK_INTERVALS = 2.0


@dataclass(frozen=True)
class PeersVerdict:
    """What the check concluded: ``alive`` (every other rank lives), ``gone`` (these ranks will never answer),
    ``stopped`` (a rank stopped first, saying why: adopt it) or ``lost`` (the control plane's store is gone)."""

    kind: str
    verdicts: tuple[lv.Verdict, ...] = ()
    reason: str = ""


def judge_peers(others: Iterable[int], seen: Mapping[int, lv.Seen], baseline: Mapping[int, bytes | None],
                now: float, *, heartbeat_s: float, describe: Callable[[int], str] = lambda r: f"rank {r}",
                final: bool = False, adopt: bool = True) -> PeersVerdict | None:
    """The verdict on ``others`` after an error, or None to look again (pure).

    ``baseline``: each rank's record as first read after the error.  A rank is alive once its record differs from
    that (its liveness thread still writes) or it said it completed; gone when it is ``dead``, or its record has not
    changed for ``heartbeat_s``; a rank that stopped saying why decides for everyone (adopted).  Decided once every rank is alive or gone; ``final``: decide on what
    was seen (a rank neither yet counts as alive: the deadline passed without it looking dead).  ``adopt=False``:
    a stopped rank is present, not a verdict.
    """
    gone: list[lv.Verdict] = []
    undecided = False
    for r in others:
        s = seen.get(r)
        if s is None or s.record is None:
            undecided = True
            continue
        v = lv._member_gone(r, s, now, heartbeat_s, describe)
        if v is not None and v.kind == lv.STOPPED:
            if adopt:
                return PeersVerdict("stopped", (v,), v.reason)
            continue
        if v is not None:
            gone.append(v)
        elif s.raw == baseline.get(r) and not _completed(s.record):
            undecided = True
    if undecided and not final:
        return None
    if gone:
        return PeersVerdict("gone", tuple(gone))
    return PeersVerdict("alive")


def _completed(record: Mapping[str, Any]) -> bool:
    stop = record.get("stop")
    return isinstance(stop, dict) and stop.get("cause") == "completed"


def gone_names(verdicts: Iterable[lv.Verdict], ranks_per_node: int) -> tuple[str, str, list[int], list[int]]:
    """``(where, how, gone ranks, lost nodes)`` (pure): ``where`` names each node all of whose ranks are gone (``node 1
    lost (every rank of it gone: 2, 3)``) or else the gone ranks; ``how``: every verdict's reason."""
    verdicts = sorted(verdicts, key=lambda v: v.rank)
    ranks = [v.rank for v in verdicts]
    nodes = sorted({r // ranks_per_node for r in ranks})
    lost = [n for n in nodes if set(range(n * ranks_per_node, (n + 1) * ranks_per_node)) <= set(ranks)]
    if lost:
        where = "; ".join(f"node {n} lost (every rank of it gone: "
                          f"{', '.join(str(r) for r in ranks if r // ranks_per_node == n)})" for n in lost)
        rest = [r for r in ranks if r // ranks_per_node not in lost]
        if rest:
            where += f"; rank(s) {rest} gone"
    else:
        where = f"rank(s) {ranks} gone (node {', '.join(map(str, nodes))})"
    return where, "; ".join(v.reason for v in verdicts), ranks, lost


def look(detector: Any, world_size: int, *, adopt: bool = True,
         clock: Callable[[], float] = time.monotonic) -> PeersVerdict | None:
    """Look at every other rank's record until :func:`judge_peers` decides (at most ``heartbeat_s`` plus
    :data:`SLACK_INTERVALS` heartbeat intervals); None without a detector (nothing to ask).  A store that cannot be
    read: ``lost``.  ``adopt=False``: a rank that stopped saying why counts as present, not as the verdict (a stop
    being named already)."""
    observer = getattr(detector, "observer", None)
    if observer is None or world_size < 2:
        return None
    timeouts = detector.timeouts
    others = [r for r in range(world_size) if r != detector.rank]
    # Every rank that looks writes its record at each look (one small write per LOOK_S, only while it looks): the
    # other survivors, looking at the same moment, see its counter move at once instead of at its next interval.
    publisher = getattr(detector, "publisher", None)
    since = clock()
    baseline: dict[int, bytes | None] | None = None
    end = since + float(timeouts.heartbeat_s) + SLACK_INTERVALS * float(timeouts.heartbeat_interval_s)
    while True:
        try:
            seen = observer.look(others, detector._store)
        except Exception as err:  # noqa: BLE001 - the store's host is gone
            return PeersVerdict("lost", reason=f"{type(err).__name__}: {err}")
        now = clock()
        if baseline is None:  # a record is only known to move once it differs from this first read
            baseline = {r: s.raw for r, s in seen.items()}
        verdict = judge_peers(others, seen, baseline, now, heartbeat_s=float(timeouts.heartbeat_s),
                              describe=detector.describe, final=now >= end, adopt=adopt)
        if verdict is not None:
            log.info("the other ranks: %s (%.2f s to tell)", verdict.kind, clock() - since)
            return verdict
        if publisher is not None:
            publisher.publish()
        threading.Event().wait(LOOK_S)


def dead_peer_stop(detector: Any, world_size: int, ranks_per_node: int, exc: BaseException, *,
                   phase: str | None, frontier: int | None,
                   clock: Callable[[], float] = time.monotonic) -> FailStop | None:
    """The L2 stop when ``exc`` was raised with a peer dead or gone, else None (every peer alive: a bug).

    A store that cannot be read is a lost control plane (its host, rank 0, is gone): L2 as well.
    """
    what = f"{type(exc).__name__}: {_first_words(exc)}{_project_frame(exc)}"
    verdict = look(detector, world_size, clock=clock)
    if verdict is None or verdict.kind == "alive":
        return None
    if verdict.kind == "lost":
        return FailStop(f"the control plane's store cannot be read ({verdict.reason}): its host, "
                        f"{detector.describe(0)}, is gone; this rank's {what} failed with it: a dead peer, not a "
                        f"bug: requeue", EXIT_REQUEUE, cause="control-plane", phase=phase, frontier=frontier,
                        decided_at=clock(), rank=0, gone={"ranks": [0], "nodes": []})
    if verdict.kind == "stopped":
        v = verdict.verdicts[0]
        return FailStop(v.reason, v.exit_code or EXIT_REQUEUE, cause=v.cause or "dead-rank", phase=phase,
                        frontier=frontier, decided_at=clock(), rank=v.rank, verdict=v.kind)
    where, how, ranks, lost = gone_names(verdict.verdicts, ranks_per_node)
    reason = f"{where}: {how}; this rank's {what} failed with the peer gone: a dead peer, not a bug: requeue"
    cause = next((v.cause for v in verdict.verdicts if v.kind == lv.DEAD and v.cause), None) or \
        ("dead-rank" if any(v.kind == lv.DEAD for v in verdict.verdicts) else "hung-rank")  # as a verdict says
    return FailStop(reason, EXIT_REQUEUE, cause=cause, phase=phase, frontier=frontier, decided_at=clock(),
                    rank=ranks[0], verdict=verdict.verdicts[0].kind, gone={"ranks": ranks, "nodes": lost})


def name_gone(stop: FailStop, detector: Any, world_size: int) -> FailStop:
    """A dead or hung rank's stop, naming every rank gone with it and each node lost whole (a node's ranks die
    together; a verdict names the first one seen).  The same stop when nothing more is gone or nothing can tell."""
    if stop.cause not in GONE_CAUSES or stop.context.get("gone") or detector is None:
        return stop
    rpn = len(getattr(detector, "_members", {}).get("shard") or ()) or 1
    verdict = look(detector, world_size, adopt=False)
    if verdict is None or verdict.kind != "gone":
        return stop
    where, _how, ranks, lost = gone_names(verdict.verdicts, rpn)
    if ranks == [stop.context.get("rank")] and not lost:
        return stop  # the verdict named it already
    reason = stop.reason if stop.reason.startswith(where) else f"{where}: {stop.reason}"  # adopted: named already
    return FailStop(reason, stop.exit_code, **{**stop.context, "gone": {"ranks": ranks, "nodes": lost}})


def _first_words(exc: BaseException, limit: int = 160) -> str:
    """The error's first sentence (Gloo's ``[.../pair.cc:553] Connection closed by peer [host]:port``), bounded."""
    text = (str(exc).splitlines() or [""])[0]
    text = text.split(". ", 1)[0]
    if text.startswith("[") and "] " in text:  # the backend's source location: no help to an operator
        text = text.split("] ", 1)[1]
    return text[:limit]


def _project_frame(exc: BaseException) -> str:
    """`` (in ckpt_service/capture.py:249, state_dict_plan)``: the innermost frame of this project's code."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    for f in reversed(frames):
        path = f.filename.replace("\\", "/")
        for pkg in ("accelpact_slurm/", "ckpt_service/"):
            if pkg in path:
                return f" (in {pkg}{path.rsplit(pkg, 1)[1]}:{f.lineno}, {f.name})"
    return ""
