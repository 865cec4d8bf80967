"""The fault detector on the data plane: every collective of the HSDP groups waited on with eyes open.

A collective on a dead or stuck link blocks its waiters until the backend's timeout (``timeouts.collective_s``;
on GPU clusters often minutes).  Each collective issued on the job's shard or replication group goes through the
tap of :func:`accelpact_slurm.repair.torch_compat.install_collective_tap` (FSDP's own too), is numbered per group,
and its ``wait`` first waits a few milliseconds (the normal case, with no other cost); a longer wait publishes
"waiting in collective k of group G" in this rank's record and then, every :data:`POLL_S`, reads the members'
records and the job's notice in one request and asks
:func:`accelpact_slurm.runtime.detection.liveness.judge_collective`: a member left, the notice, or every member
waiting past the learned bound gives the collective up with :class:`~accelpact_slurm.core.errors.CollectiveAbandoned`
(a communication fault for the vote; a rank that gives one up in forward or backward posts the notice); a member
dead, stopped or hung raises :class:`~accelpact_slurm.core.errors.FailStop` (L2); a straggler is waited for.

The bound is learned per group dimension and size class (:class:`LinkBounds`): :data:`LINK_FACTOR` times the
slowest of the last :data:`SAMPLES` completed collectives of that size or larger (timed from when every member was
seen in them: a wait on a straggler teaches nothing), within ``timeouts.link_floor_s`` and ``timeouts.collective_s``
(the ceiling until :data:`MIN_SAMPLES` completed); each link verdict doubles it for that dimension, so a bound too
tight cannot repair a job into a restart loop.  Only the replication group's collectives are called broken links;
a shard group's (inside a node) runs to the ceiling.  On a GPU (NCCL) the tap only numbers the collectives and the
guard's wait at the boundary is watched instead (:meth:`Detector.wait_device`).  Fault injection:
:meth:`Detector.stall_next` (a stalled link, every member inside), where ``withhold``
(:mod:`accelpact_slurm.repair.discard`) makes the rank leave it.

Who calls: :func:`accelpact_slurm.runtime.job.topology.init_runtime` builds one per rank and installs the tap; the
guard and the phase tracker use the injection; the vote reads :meth:`Detector.take_latched`; the run sets
:attr:`Detector.stop_hook`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable

from accelpact_slurm.core.errors import EXIT_REQUEUE, CollectiveAbandoned, FailStop
from accelpact_slurm.runtime.detection import liveness as lv

log = logging.getLogger(__name__)

#: How long a wait is left alone before it looks at anyone (most collectives complete within it).
FAST_S = 0.02
#: Between two looks at the members' records while a wait lasts (a look is one store request: the records and
#: the job's notice).  It bounds how long a rank waiting in a collective takes to hear that another rank gave its
#: update up; 20 ms read 1.016x (1.000-1.039) in the detector's own cost on the development machine (waits past
#: FAST_S are common there, four ranks sharing two cores), so it stays at 50 ms.
POLL_S = 0.05
#: The learned bound: this many times the slowest recent collective of the dimension...
LINK_FACTOR = 4.0
#: ...over this many recent completed collectives...
SAMPLES = 64
#: ...once this many completed (before: the ceiling).
MIN_SAMPLES = 3

_FAST = timedelta(seconds=FAST_S)
_POLL = timedelta(seconds=POLL_S)


class LinkBounds:
    """The learned bound of each group dimension and collective size (see the module docstring).

    A collective's duration grows with its bytes: a bound learned on the guard's 8-byte all-reduce says nothing of
    a 100 MB all-gather.  Samples are kept per (dimension, power-of-two size class); the bound of a collective is
    :data:`LINK_FACTOR` times the slowest sample of its class or any larger one (a larger collective takes at least
    as long), and the ceiling while neither has :data:`MIN_SAMPLES` samples.
    """

    def __init__(self, floor_s: float, ceiling_s: float) -> None:
        self.floor_s, self.ceiling_s = floor_s, ceiling_s
        self._samples: dict[tuple[str, int], deque[float]] = {}
        self._scale: dict[str, float] = {}

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(0, int(nbytes).bit_length() - 1)

    def add(self, dim: str, seconds: float, nbytes: int = 0) -> None:
        key = (dim, self.size_class(nbytes))
        q = self._samples.get(key)
        if q is None:
            q = self._samples[key] = deque(maxlen=SAMPLES)
        q.append(seconds)

    def bound(self, dim: str, nbytes: int = 0) -> float:
        cls = self.size_class(nbytes)
        qs = [q for (d, c), q in self._samples.items() if d == dim and c >= cls and len(q) >= MIN_SAMPLES]
        if not qs:
            return self.ceiling_s
        learned = LINK_FACTOR * max(max(q) for q in qs) * self._scale.get(dim, 1.0)
        return min(self.ceiling_s, max(self.floor_s, learned))

    def widen(self, dim: str) -> None:
        """After a link verdict on ``dim``: twice the bound from now on (up to the ceiling)."""
        self._scale[dim] = self._scale.get(dim, 1.0) * 2.0


def nbytes_of(args: tuple, kwargs: dict) -> int:
    """The bytes of the tensors a collective's arguments hold (lists of tensors too), for its size class."""
    total = 0
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            for x in (t if isinstance(t, (list, tuple)) else (t,)):
                numel = getattr(x, "numel", None)
                if numel is not None and hasattr(x, "element_size"):
                    total += numel() * x.element_size()
    return total


class _Group:
    __slots__ = ("pg", "dim", "name", "members", "issued", "done")


    def __init__(self, pg: Any, dim: str, members: list[int]) -> None:
        self.pg, self.dim, self.members = pg, dim, members
        self.name = str(getattr(pg, "group_name", dim))
        self.issued = 0
        self.done = 0


class WatchedWork:
    """Stands in for the ``Work`` of one collective on a watched group: its ``wait`` is the detector's."""

    __slots__ = ("_work", "_detector", "_group", "_seq", "_t0", "_settled", "_nbytes")

    def __init__(self, work: Any, detector: "Detector", group: _Group, seq: int, nbytes: int = 0) -> None:
        self._work, self._detector, self._group, self._seq = work, detector, group, seq
        self._t0 = time.monotonic()
        self._settled = False
        self._nbytes = nbytes

    def wait(self, timeout: Any = None) -> bool:
        try:
            return self._detector._wait(self)
        except FailStop as stop:  # waited on by the training code (FSDP's hooks, its own collectives): see stop_hook
            hook = self._detector.stop_hook
            if hook is not None and threading.get_ident() == hook[0]:
                hook[1](stop)
            raise

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Stalled:
    """The work of a collective whose data never arrives (fault injection): it runs until the backend's own
    timeout, ``ceiling_s`` after it was issued, then fails as Gloo's would."""

    def __init__(self, ceiling_s: float) -> None:
        self._end = time.monotonic() + ceiling_s
        self._ceiling_s = ceiling_s

    def is_completed(self) -> bool:
        return time.monotonic() >= self._end

    def is_success(self) -> bool:
        return False

    def wait(self, timeout: Any = None) -> bool:
        left = self._end - time.monotonic()
        if isinstance(timeout, timedelta) and timeout.total_seconds() < left:
            threading.Event().wait(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        threading.Event().wait(max(0.0, left))
        raise RuntimeError(f"Gloo: timed out after {self._ceiling_s:g} s waiting for a peer's part (a stalled link, "
                           f"fault injection)")

    def exception(self) -> None:
        return None


class Detector:
    """One rank's data-plane fault detector (see the module docstring).

    Args:
        rank: this rank.
        groups: returns the rank's current ``(shard_group, replicate_group)`` (an L1 repair replaces them).
        members: ``dim -> the global ranks`` of this rank's group of that dimension.
        state: this rank's record (:class:`~accelpact_slurm.runtime.detection.liveness.LocalState`).
        publisher: its heartbeat thread.
        observer: what this rank saw of the members' records (shared with its liveness thread).
        position: this rank's control-plane position (:meth:`ControlPlane.position`).
        timeouts: the job's ``timeouts`` (``collective_s``, ``heartbeat_s``, ``heartbeat_interval_s``,
            ``link_floor_s``).
        watch: wait with eyes open (Gloo); False numbers the collectives only (NCCL, or the detector off).
        describe: rank -> words for messages.
        store: the training thread's connection to the control plane's store (the observer reads through it).
    """

    def __init__(self, rank: int, groups: Callable[[], tuple[Any, Any]], members: dict[str, list[int]],
                 state: lv.LocalState, publisher: lv.Publisher | None, observer: lv.Observer | None,
                 position: Callable[[], tuple[int, dict[str, int]]], timeouts: Any, *, watch: bool = True,
                 describe: Callable[[int], str] = lambda r: f"rank {r}", store: Any = None) -> None:
        self.rank = rank
        self._groups = groups
        self._members = members
        self.state = state
        self.publisher = publisher
        self.observer = observer
        self._store = store  # the training thread's own connection to the control plane's store
        self._position = position
        self.timeouts = timeouts
        self.watching = watch and publisher is not None and observer is not None
        self.describe = describe
        self.bounds = LinkBounds(timeouts.link_floor_s, timeouts.collective_s)
        self._known: dict[str, _Group] = {}  # by dimension: the current group of each
        self._abandoned: set[int] = set()
        self._stall: set[str] = set()
        self._latched: tuple[str, str] | None = None
        self.verdicts: list[lv.Verdict] = []
        self.slow_waits = 0  # waits that outlasted FAST_S and looked at the members
        #: When (``time.time()``) this rank last gave up a collective; the vote's ``fault`` event reports it and
        #: clears it (the moment of detection, before the error unwinds the training code).
        self.given_up_at: float | None = None
        self.longest_wait_s = 0.0  # the longest of them that completed (a straggler's peers wait that long)
        #: ``(thread ident, stop)`` while the training code runs on that thread (set by the run): a
        #: :class:`FailStop` found in a collective it waits on goes to ``stop``, which raises the ``Stopped``
        #: (a ``BaseException``) in its place, so that no ``except Exception`` of the script can swallow it.
        self.stop_hook: tuple[int, Callable[[FailStop], Any]] | None = None

    def summary(self) -> dict[str, Any]:
        """What the detector saw in this start (the ``detector`` event at the job's end)."""
        return {"bounds_s": {dim: self.bounds.bound(dim) for dim in ("shard", "replicate")},
                "slow_waits": self.slow_waits, "longest_wait_s": self.longest_wait_s,
                "verdicts": [v.kind for v in self.verdicts], "watching": self.watching}

    def publish_stop(self, stop: dict[str, Any], timeout_s: float = 1.0) -> bool:
        """This rank stops (``stop``: cause, reason, exit_code, rank): say so in its record, before it exits."""
        self.state.stop = stop
        return self.publisher.publish_now(timeout_s) if self.publisher is not None else False

    def gone(self, culprit: int | None = None) -> set[int]:
        """Ranks that will not take part in anything again: node peers seen dead, and ``culprit`` (a dead or hung
        rank a verdict named)."""
        out = set(self.publisher.dead) if self.publisher is not None else set()
        if isinstance(culprit, int):
            out.add(culprit)
        return out

    def end_hung_peer(self, rank: int) -> str | None:
        """After a hung-rank verdict on ``rank``: if it is on this node and this rank is its lowest peer, dump its
        stacks into its log and kill it (:func:`~accelpact_slurm.runtime.detection.liveness.dump_and_kill`)."""
        peers = self.publisher.node_peers if self.publisher is not None else {}
        pid = peers.get(rank)
        if pid is None or min([r for r in peers if r != rank] + [self.rank]) != self.rank:
            return None
        self.publisher.mark_ended(rank, f"hung: its stacks dumped into its log and killed by {self.describe(self.rank)}")
        how = lv.dump_and_kill(pid)
        log.warning("%s (pid %d) was hung: %s", self.describe(rank), pid, how)
        return how

    def close(self) -> None:
        """Stop the heartbeat and take the tap out (at the rank's end)."""
        from accelpact_slurm.repair import torch_compat as tc

        tc.remove_collective_tap()
        if self.publisher is not None:
            self.publisher.close()

    # ------------------------------------------------------------------ the tap

    def on_call(self, pg: Any, method: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The collective tap (:func:`~accelpact_slurm.repair.torch_compat.install_collective_tap`)."""
        group = self._group(pg)
        if group is None:
            return original(pg, *args, **kwargs)
        if id(pg) in self._abandoned:
            raise CollectiveAbandoned(f"group {group.name} was given up after a fault: no collective runs on it "
                                      f"until the repair replaces it")
        seq = group.issued
        group.issued += 1
        if group.dim in self._stall:
            self._stall.discard(group.dim)
            log.warning("fault injection: rank %d stalls in collective %d of its %s group", self.rank, seq, group.dim)
            work: Any = _Stalled(self.timeouts.collective_s)
        else:
            work = original(pg, *args, **kwargs)
        if work is None or not self.watching:
            if work is not None:
                group.done = group.issued  # numbered only (NCCL: stream-ordered, no host wait to watch)
            return work
        return WatchedWork(work, self, group, seq, nbytes_of(args, kwargs))

    def _group(self, pg: Any) -> _Group | None:
        """The watched group ``pg`` is, or None: only the rank's current shard and replication groups are watched
        (a group a repair retired is not, whoever still holds it)."""
        shard, replicate = self._groups()
        if pg is replicate:
            dim = "replicate"
        elif pg is shard:
            dim = "shard"
        else:
            return None
        g = self._known.get(dim)
        if g is None or g.pg is not pg:  # a new group of this dimension: numbered from 0
            g = self._known[dim] = _Group(pg, dim, list(self._members[dim]))
            self._abandoned &= {id(x.pg) for x in self._known.values()}
            self.state.done = {x.name: x.done for x in self._known.values()}
        return g

    def timed_from_now(self, work: Any) -> None:
        """``work`` (a collective issued earlier, about to be waited for) is timed from now: its caller did work of
        its own since issuing it, which is no part of how long the collective takes (what the bounds learn)."""
        if isinstance(work, WatchedWork) and not work._settled:
            work._t0 = time.monotonic()

    def renewed(self, pg: Any, generation: int) -> None:
        """A repair gave ``pg`` a new transport in place (reconfigured, the same object): no longer given up, and
        numbered afresh under a name of this generation's, so that no peer compares its counts with the old
        transport's.  Every member calls this with the same ``generation``."""
        self._abandoned.discard(id(pg))
        for dim, g in list(self._known.items()):
            if g.pg is pg:
                fresh = _Group(pg, dim, g.members)
                fresh.name = f"{getattr(pg, 'group_name', dim)}@g{generation}"
                self._known[dim] = fresh
        self.state.done = {x.name: x.done for x in self._known.values()}

    # ------------------------------------------------------------------ fault injection

    def stall_next(self, dim: str = "replicate") -> None:
        """Fault injection: this rank's next collective on its ``dim`` group never completes (a stalled link)."""
        self._stall.add(dim)

    # ------------------------------------------------------------------ waits

    def round_begins(self, prefix: str, generation: int, name: str, round_: int, keys: list[str],
                     ranks: list[int]) -> Any:
        """The control plane blocks in a round: the liveness thread watches it (blind: nobody does)."""
        if not self.watching:
            return None
        return self.publisher.round_begins(prefix, generation, name, round_, keys, ranks)

    def round_ends(self, token: Any) -> None:
        if token is not None:
            self.publisher.round_ends(token)

    def take_latched(self) -> tuple[str, str] | None:
        """``(phase, error)`` of the collective this rank gave up since the last call (so that a vote reports it
        even if the training code swallowed the exception)."""
        latched, self._latched = self._latched, None
        return latched

    def _wait(self, ww: WatchedWork) -> bool:
        if ww._settled:
            return True
        work = ww._work
        try:
            done = try_wait(work, _FAST)
        except BaseException:
            ww._settled = True
            raise
        if done:
            return self._completed(ww)
        return self._watch(ww, lambda: try_wait(work, _POLL))

    def wait_device(self, work: Any, pg: Any, timeout_s: float) -> None:
        """The guard's wait on a GPU collective (NCCL): poll its completion with eyes open, like a CPU wait."""
        group = self._group(pg)
        if group is None or self.publisher is None or self.observer is None:
            work.wait(timedelta(seconds=timeout_s))
            return
        ww = WatchedWork(work, self, group, group.issued - 1)
        end = time.monotonic() + timeout_s

        def step() -> bool:
            if work.is_completed():
                return True
            if time.monotonic() > end:
                work.wait(timedelta(seconds=0.001))  # raises the backend's timeout (and aborts the communicator)
            threading.Event().wait(POLL_S / 5)
            return work.is_completed()

        self._watch(ww, step)
        work.wait()

    def _watch(self, ww: WatchedWork, step: Callable[[], bool]) -> bool:
        """The wait's slow path: publish it, then look at the members every poll until done or a verdict."""
        group, seq = ww._group, ww._seq
        state, publisher = self.state, self.publisher
        state.wait = ["d", group.name, seq]
        publisher.publish()
        episode = lv.Episode(started=time.monotonic())
        fresh_s = lv.FRESH_INTERVALS * self.timeouts.heartbeat_interval_s
        self.slow_waits += 1
        try:
            while True:
                try:
                    if step():
                        self.longest_wait_s = max(self.longest_wait_s, time.monotonic() - episode.started)
                        # What the bound learns is how long a collective takes once every member is in it: a wait
                        # on a straggler says nothing of that (counted from when all were seen in, else not at all).
                        return self._completed(ww, since=episode.all_in_since, sample=episode.all_in_since is not None)
                except BaseException:
                    ww._settled = True
                    raise
                try:
                    seen, (notice,) = self.observer.look_also(group.members, (lv.NOTICE_KEY,), self._store)
                except Exception as exc:  # noqa: BLE001 - the store is gone: rank 0, its host, died
                    raise FailStop(f"lost the control plane while waiting in collective {seq} of group {group.name}: "
                                   f"{type(exc).__name__}: {exc}; its host, rank 0, is probably gone", EXIT_REQUEUE,
                                   cause="control-plane", phase=state.phase, frontier=None,
                                   decided_at=time.monotonic()) from exc
                now = time.monotonic()
                # A broken link is called on the replication group only, where L1 repairs it; a shard group's
                # collective (inside the node; in forward a restart's business) that everyone waits in runs to the
                # ceiling: a false alarm there would cost a restart.
                bound = self.bounds.bound(group.dim, ww._nbytes) if group.dim == "replicate" else float("inf")
                verdict = lv.judge_collective(self.rank, group.members, group.name, seq, seen, now, episode,
                                              bound_s=bound,
                                              heartbeat_s=self.timeouts.heartbeat_s, fresh_s=fresh_s,
                                              position=self._position(), describe=self.describe,
                                              notice=notice, update=state.update)
                if verdict is not None:
                    self._give_up(ww, verdict, now - episode.started)
        finally:
            state.wait = None
            publisher.publish()

    def _completed(self, ww: WatchedWork, since: float | None = None, sample: bool = True) -> bool:
        ww._settled = True
        g = ww._group
        g.done = max(g.done, ww._seq + 1)
        self.state.done[g.name] = g.done
        if sample:
            self.bounds.add(g.dim, time.monotonic() - (ww._t0 if since is None else since), ww._nbytes)
        return True

    def _give_up(self, ww: WatchedWork, verdict: lv.Verdict, waited_s: float) -> None:
        ww._settled = True
        self.given_up_at = time.time()
        g = ww._group
        self.verdicts.append(verdict)
        log.warning("rank %d gives up collective %d of its %s group after %.2f s: %s", self.rank, ww._seq, g.dim,
                    waited_s, verdict.reason)
        if verdict.fails_stop:
            cause = (verdict.cause if verdict.kind == lv.DEAD else None) or \
                {lv.DEAD: "dead-rank", lv.HUNG: "hung-rank"}.get(verdict.kind, verdict.cause or "link")
            code = verdict.exit_code if verdict.kind == lv.STOPPED and verdict.exit_code else EXIT_REQUEUE
            raise FailStop(verdict.reason, code, cause=cause, phase=self.state.phase, frontier=None,
                           decided_at=time.monotonic(), rank=verdict.rank, verdict=verdict.kind)
        if verdict.kind == lv.LINK:
            self.bounds.widen(g.dim)
        self._abandoned.add(id(g.pg))
        text = f"collective {ww._seq} of the {g.dim} group given up after {waited_s:.2f} s: {verdict.reason}"
        if self.state.phase in ("forward", "backward") and not verdict.noticed:
            self._post_notice(g, ww._seq, verdict)
        phase = self.state.phase if self.state.phase in ("forward", "backward") else "backward"
        self._latched = (phase, f"CollectiveAbandoned: {text}")
        raise CollectiveAbandoned(text)

    def _post_notice(self, g: _Group, seq: int, verdict: lv.Verdict) -> None:
        """Tell every rank (:data:`~accelpact_slurm.runtime.detection.liveness.NOTICE_KEY`) that this update's
        collective ``seq`` of ``g`` was given up: the update is discarded at the vote, so each rank gives up whatever
        collective of it it waits in, at its next look, instead of through a chain of ``left`` records.  Not at
        the boundary: a boundary fault repairs only the replication groups of the ranks that report one."""
        if self._store is None:
            return
        try:
            self._store.set(lv.NOTICE_KEY, lv.encode_notice(self._position()[0], self.state.update, self.rank,
                                                            g.name, seq, verdict.kind))
        except Exception as exc:  # noqa: BLE001 - the records still carry the fault, one hop at a time
            log.warning("rank %d could not post its notice of the given-up collective: %s", self.rank, exc)


def try_wait(work: Any, timeout: timedelta) -> bool:
    """Wait up to ``timeout`` for ``work``: True once it completed, False when it still runs; raises its own error.

    ``Work.wait(timeout)`` raises ``RuntimeError("Operation timed out!")`` when the timeout passes first and leaves
    the work running; a work that completed meanwhile (or failed) is waited on once more, which returns or raises
    its own error.
    """
    try:
        work.wait(timeout)
        return True
    except RuntimeError:
        if not work.is_completed():
            return False
    work.wait()
    return True


def stop_from_round(stop: dict[str, Any], round_name: str) -> FailStop:
    """The fail-stop of a control-plane round in which a watcher put a stop in a member's place."""
    kind = stop.get("kind")
    cause = (stop.get("cause") if kind == lv.DEAD else None) or \
        {lv.DEAD: "dead-rank", lv.HUNG: "hung-rank"}.get(kind, stop.get("cause") or "control-plane")
    code = stop.get("exit_code") if kind == lv.STOPPED and stop.get("exit_code") else EXIT_REQUEUE
    return FailStop(f"{stop.get('reason')} (seen while waiting for it in the control plane's {round_name!r} round)",
                    code, cause=cause, frontier=None, decided_at=time.monotonic(), rank=stop.get("rank"),
                    verdict=kind)


__all__ = ["Detector", "LinkBounds", "WatchedWork", "stop_from_round", "try_wait"]
