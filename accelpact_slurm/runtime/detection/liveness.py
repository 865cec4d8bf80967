"""Liveness: every rank's heartbeat, the death of a rank's process, and what a waiting rank concludes.

Every rank publishes one small record under ``hb/<rank>`` in the control plane's store, from a thread and a store
connection of its own (:class:`Publisher`; never the training thread, which may be blocked in a collective): a
counter that advances at every write, what the rank is doing (update, phase, the wait it is in, the collectives of
each group it completed) and, once it stops, why.  It writes every ``timeouts.heartbeat_interval_s`` and at once when
a long wait starts or ends: O(N) writes per interval for the job.  The same thread holds a pidfd of every other rank
of its node: a death is seen within milliseconds and the dead rank's record is overwritten with ``dead`` (a rank
alone on its node has no such witness: its death shows as a heartbeat that stops).

Nobody reads the records while the job trains; a rank reads those of what it waits in, and only while it waits
(past a few milliseconds in a collective, :mod:`.collectives`; past its first slice in a control-plane round,
:mod:`..transport.control`).  What it concludes is a pure function of what it saw and when (:func:`judge_collective`,
:func:`judge_control`): ``dead``, ``stopped`` or ``hung`` fails stop (L2) naming the member; ``left`` (a member in
the vote, or the job's *notice*, :data:`NOTICE_KEY`, of a collective given up in this update) and ``link`` (every
member waits past the learned bound) are a communication fault for the vote; anything else (a straggler) keeps the
wait going.  ``docs/detection.md`` has the table and the numbers.

Who calls: :func:`accelpact_slurm.runtime.job.topology.init_runtime` starts the publisher; the collective tap and
the control plane judge; a fail-stop publishes its reason (:meth:`Publisher.publish_now`) and, for a hung rank
on its own node, dumps its stacks and kills it (:func:`dump_and_kill`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from accelpact_slurm.runtime.detection import oom
from accelpact_slurm.runtime.detection.stacks import (  # noqa: F401 - its API too
                                                      DUMP_GRACE_S, DUMP_SIGNAL, dump_and_kill, dump_stacks,
                                                      install_dump_handler)

log = logging.getLogger(__name__)

#: A member whose counter moved within this many heartbeat intervals is alive.
FRESH_INTERVALS = 3.0

DEAD, HUNG, STOPPED, LEFT, LINK = "dead", "hung", "stopped", "left", "link"


def record_key(rank: int) -> str:
    return f"hb/{rank}"


#: The job's one notice of a given-up collective: ``{"g": generation, "u": update, "r": rank, "grp", "seq",
#: "why": the verdict's kind}`` of the last one (written by :meth:`Detector._give_up
#: <accelpact_slurm.runtime.detection.collectives.Detector._give_up>`), empty until then (rank 0 creates it at the
#: start, so that a read never waits for it).  Only a notice of the reader's own generation and update counts.
NOTICE_KEY = "hb/notice"
#: The value a watcher puts (:meth:`Publisher._look_round`) in the place of a member that will never join a round:
#: ``{STOP_KEY: {...}}``.
STOP_KEY = "__accelpact_stop__"


def encode_notice(generation: int, update: int, rank: int, group: str, seq: int, why: str) -> str:
    """The notice's value; ``why``: the giving-up verdict's kind (``link``, ``left``)."""
    return json.dumps({"g": generation, "u": update, "r": rank, "grp": group, "seq": seq, "why": why[:40]},
                      separators=(",", ":"))


@dataclass
class LocalState:
    """What this rank is doing, as its record shows it; written by the training thread, read by the publisher."""

    update: int = 0
    phase: str = "start"
    #: ``["d", group, seq]`` (a data-plane collective) or ``["c", generation, name, round]`` (control plane).
    wait: list[Any] | None = None
    #: Completed collectives per watched group (by group name).
    done: dict[str, int] = field(default_factory=dict)
    #: Once this rank stops: ``{"cause", "reason", "exit_code"}`` (``cause`` ``completed`` at a normal end).
    stop: dict[str, Any] | None = None


def encode(n: int, pid: int, state: LocalState, mem: dict[str, Any] | None = None) -> str:
    """``mem``: the rank's memory (:func:`accelpact_slurm.runtime.detection.oom.own_memory`), for its death's
    witness."""
    return json.dumps({"n": n, "pid": pid, "u": state.update, "ph": state.phase, "w": state.wait,
                       "d": dict(state.done), "stop": state.stop, "mem": mem}, separators=(",", ":"))


#: Who marks a rank dead when its every connection to the job's store closed (the store's witness).
STORE_WITNESS = "the job's store"


def witness_key(rank: int) -> bytes:
    return record_key(rank).encode()


def witnessed_death(raw: bytes | None) -> bytes | None:
    """The store's witness (pure): a rank's record once every connection of that rank to the store has closed,
    marked ``dead`` as a node peer's pidfd marks it, unless it said it stopped or finished (or is marked already);
    None to leave it.  A process that ends closes its connections; one that hangs, or a link that is cut without a
    reset, keeps them, and its heartbeat tells.  So a node lost whole is named within milliseconds, with no node
    peer left to witness it."""
    rec = decode(raw)
    if rec is None or rec.get("stop") or rec.get("dead"):
        return None
    rec["dead"] = {"by": STORE_WITNESS, "how": "every connection of its process to the job's store closed"}
    rec["n"] = int(rec.get("n") or 0) + 1
    return json.dumps(rec, separators=(",", ":")).encode()


def decode(raw: bytes | str | None) -> dict[str, Any] | None:
    """A record, or None for anything that is not one (a missing key, a torn or foreign value)."""
    if not raw:
        return None
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


# ------------------------------------------------------------------ the publisher


@dataclass
class RoundWatch:
    """A control-plane round this rank waits in, as its liveness thread watches it."""

    prefix: str
    name: str
    round: int
    keys: list[str]
    ranks: list[int]
    since: float
    published: bool = False
    publish_at: float = 0.0
    next_look: float = 0.0
    looks: int = 0
    done: bool = False


#: A round is left alone this long before the liveness thread publishes that this rank waits in it (one write: the
#: members still inside a collective read it there and give the collective up at once, "left")...
PUBLISH_S = 0.02
#: ...and this long before it first looks at the round's missing members (a look costs its rank about 5 store
#: round trips, and every waiting rank looks: at 20 ms, the vote of a guarded update on a busy machine often lasted
#: long enough, and the looks cost the job ~3% of every guarded update; a dead member, marked at once by its node
#: peer's pidfd, is still named within this plus :data:`LOOK_S`)...
FIRST_LOOK_S = 0.2
#: ...and then looks again this often.
LOOK_S = 0.1


class Publisher:
    """This rank's liveness thread: its record at a fixed interval and on demand, its node peers' deaths, and the
    control-plane round the rank waits in.

    Args:
        store: a store connection of its own (the training thread's is blocked in the round it waits in).
        rank: this rank.
        state: what the record shows (:class:`LocalState`).
        interval_s: seconds between two writes.
        heartbeat_s: a member whose counter does not move for this long is hung.
        describe: rank -> words for messages (``rank 3 (node 1)``).
    """

    def __init__(self, store: Any, rank: int, state: LocalState, interval_s: float, heartbeat_s: float = 10.0,
                 describe: Callable[[int], str] = lambda r: f"rank {r}") -> None:
        self._store = store
        self.rank = rank
        self.state = state
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.describe = describe
        self.node_peers: dict[int, int] = {}
        self.n = 0
        self.lost: str | None = None  # why the store cannot be reached (rank 0, its host, is gone)
        self.dead: dict[int, str] = {}  # node peers seen dead, with how
        #: What this rank saw of the others' records; the training thread's waits share it (:class:`Observer`).
        self.observer = Observer(store)
        self._round: RoundWatch | None = None
        self._want_write = False
        self._written = threading.Condition()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Write the first record now (it exists before any peer looks), then run the thread."""
        self._write()
        self._thread = threading.Thread(target=self._run, name="accelpact-liveness", daemon=True)
        self._thread.start()

    def watch_peers(self, node_peers: Mapping[int, int]) -> None:
        """Watch these node peers' processes (rank -> pid); call once, after the pids are known."""
        self.node_peers = dict(node_peers)
        self._wake()

    def publish(self) -> None:
        """Publish the current state as soon as the thread wakes (no wait)."""
        self._want_write = True
        self._wake()

    def publish_now(self, timeout_s: float = 1.0) -> bool:
        """Publish the current state and wait (bounded) until it is written; False on the deadline."""
        with self._written:
            target = self.n + 1
            self.publish()
            return self._written.wait_for(lambda: self.n >= target or self._stop.is_set(), timeout_s)

    def round_begins(self, prefix: str, generation: int, name: str, round_: int, keys: list[str],
                     ranks: list[int]) -> RoundWatch:
        """The training thread is about to block in this control-plane round (its keys under ``prefix``)."""
        w = RoundWatch(prefix, name, round_, list(keys), list(ranks), time.monotonic())
        w.publish_at = w.since + PUBLISH_S
        w.next_look = w.since + FIRST_LOOK_S
        self.state.wait = ["c", generation, name, round_]
        self._round = w
        self._wake()  # the thread schedules its publication and first look
        return w

    def round_ends(self, w: RoundWatch) -> None:
        w.done = True
        if self._round is w:
            self._round = None
        self.state.wait = None
        if w.published:  # its record said this rank waits there: say it no longer does
            self.publish()

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # the pipe is full (the thread is awake anyway) or closed
            pass

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        pidfds: dict[int, int] = {}
        watched: set[int] = set()
        last_write = time.monotonic()
        try:
            while not self._stop.is_set():
                for r, pid in self.node_peers.items():  # peers arrive once, after the start's pid exchange
                    if r in watched or r == self.rank:
                        continue
                    watched.add(r)
                    try:
                        fd = os.pidfd_open(pid)
                    except ProcessLookupError:
                        self._mark_dead(r, "its process had already ended when this rank began to watch it")
                        continue
                    except (OSError, AttributeError) as exc:  # no pidfd here: its heartbeat tells instead
                        log.info("cannot watch the process of %s (%s): its heartbeat tells", self.describe(r), exc)
                        continue
                    pidfds[fd] = r
                    poller.register(fd, select.POLLIN)
                now = time.monotonic()
                w = self._round
                if w is not None and not w.done and not w.published and now >= w.publish_at:
                    w.published = self._want_write = True
                if w is not None and not w.done and now >= w.next_look:
                    w.looks += 1
                    self._look_round(w, now)
                    w.next_look = now + LOOK_S
                if self._want_write or now - last_write >= self.interval_s:
                    self._want_write = False
                    self._write()
                    last_write = time.monotonic()
                wake_at = last_write + self.interval_s
                w = self._round
                if w is not None and not w.done:
                    wake_at = min(wake_at, w.next_look if w.published else w.publish_at)
                for fd, _ev in poller.poll(max(0.0, wake_at - time.monotonic()) * 1000):
                    if fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                    elif fd in pidfds:
                        r = pidfds.pop(fd)
                        poller.unregister(fd)
                        os.close(fd)
                        self._mark_dead(r, "its process ended")
        finally:
            for fd in pidfds:
                os.close(fd)
            with self._written:
                self._written.notify_all()

    def _write(self) -> None:
        with self._written:
            try:
                self._store.set(record_key(self.rank), encode(self.n + 1, os.getpid(), self.state, oom.own_memory()))
            except Exception as exc:  # noqa: BLE001 - the store's host (rank 0) is gone: the waits find out
                if self.lost is None:
                    log.warning("heartbeat not published: %s", exc)
                self.lost = f"{type(exc).__name__}: {exc}"
                return
            self.n += 1
            self._written.notify_all()

    def _look_round(self, w: RoundWatch, now: float) -> None:
        """Look at the members missing from the round; put a stop in the place of any that will never come."""
        import torch.distributed as dist

        try:
            store = dist.PrefixStore(w.prefix, self._store)
            if store.check(list(w.keys)):  # every key is in (one request): the read is about to end
                return
            missing = [(r, k) for r, k in zip(w.ranks, w.keys) if not store.check([k])]
            if not missing or w.done:
                return
            seen = self.observer.look([r for r, _k in missing], self._store)
        except Exception:  # noqa: BLE001 - the store is gone: the training thread's read says so
            return
        verdict = judge_control([r for r, _k in missing], seen, time.monotonic(), heartbeat_s=self.heartbeat_s,
                                describe=self.describe)
        if verdict is None:
            return
        stop = json.dumps({STOP_KEY: {"kind": verdict.kind, "rank": verdict.rank, "reason": verdict.reason,
                                      "exit_code": verdict.exit_code, "cause": verdict.cause}})
        log.warning("control-plane round %r: %s; every rank waiting in it stops", w.name, verdict.reason)
        try:
            for _r, k in missing:  # only where nothing was set: a value that just came stays
                store.compare_set(k, "", stop)
        except Exception:  # noqa: BLE001 - the store is gone
            pass
        w.done = True

    def mark_ended(self, rank: int, how: str) -> None:
        """Record that a node peer is being ended on purpose (a hung rank about to be killed), before it resumes.

        Under a key of its own, not in its record: the hung rank's own liveness thread, resumed for its stacks,
        would overwrite that."""
        try:
            self._store.set(f"ended/{rank}", json.dumps({"by": self.rank, "how": how}))
        except Exception:  # noqa: BLE001 - the store is gone
            pass

    def ended_by_peer(self) -> bool:
        """Whether a node peer marked this rank as ended (it was hung; its resumption is only for its stacks)."""
        try:
            return bool(self._store.check([f"ended/{self.rank}"]))
        except Exception:  # noqa: BLE001
            return False

    def _mark_dead(self, rank: int, how: str) -> None:
        """Overwrite a dead node peer's record with ``dead`` (unless it said it stopped or finished)."""
        self.dead[rank] = how
        key = record_key(rank)
        try:
            cur = decode(self._store.get(key)) if self._store.check([key]) else None
            by_store = isinstance((cur or {}).get("dead"), dict) and cur["dead"].get("by") == STORE_WITNESS
            if cur is not None and (cur.get("stop") or (cur.get("dead") and not by_store)):
                return  # it left on purpose (a fail-stop, the job's end): not a death; or a peer saw it first
            cur = cur or {}
            ended = oom.after_death(cur)  # the OOM killer's doing: a restart meets the same limit at the same place
            how = oom.describe(ended) if ended else how
            cur.update({"dead": {"by": self.rank, "how": how, **({"oom": ended} if ended else {})},
                        "n": int(cur.get("n") or 0) + 1})
            self._store.set(key, json.dumps(cur, separators=(",", ":")))
        except Exception as exc:  # noqa: BLE001 - the store is gone: nobody is left to tell
            log.warning("could not publish the death of %s: %s", self.describe(rank), exc)
            return
        log.warning("%s died: %s (seen by rank %d)", self.describe(rank), how, self.rank)


# ------------------------------------------------------------------ what a waiting rank sees


@dataclass
class Seen:
    """One member's record as this rank last read it, and when (this rank's monotonic clock) it last changed."""

    record: dict[str, Any] | None
    raw: bytes | None
    changed_at: float


class Observer:
    """The records of the members a rank waits on, as this rank saw them, shared by its threads.

    Keeps, per rank, when its record last changed by this rank's clock, across waits and across the threads
    that look (the training thread in a collective, the liveness thread in a control-plane round): a counter
    unchanged since a look a minute ago has been unchanged for that minute (it only ever advances), whichever
    thread looked then.  Each thread reads through a store connection of its own (``store`` of :meth:`look`).
    """

    def __init__(self, store: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._clock = clock
        self._lock = threading.Lock()
        self.seen: dict[int, Seen] = {}

    def look(self, ranks: Iterable[int], store: Any = None) -> dict[int, Seen]:
        """One read of every record of ``ranks`` (one round trip, through ``store``, else the observer's own).
        Raises what the store raises."""
        return self.look_also(ranks, (), store)[0]

    def look_also(self, ranks: Iterable[int], keys: Iterable[str], store: Any = None
                  ) -> tuple[dict[int, Seen], list[bytes]]:
        """:meth:`look`, and the values of ``keys`` (which must exist) in the same round trip."""
        ranks, keys = list(ranks), list(keys)
        raws = (store or self._store).multi_get([record_key(r) for r in ranks] + keys)
        extra = list(raws[len(ranks):])
        now = self._clock()
        with self._lock:
            for r, raw in zip(ranks, raws):
                prev = self.seen.get(r)
                if prev is None or prev.raw != raw:
                    self.seen[r] = Seen(decode(raw), raw, now)
            return {r: self.seen[r] for r in ranks}, extra


@dataclass(frozen=True)
class Verdict:
    """What a wait concluded: ``kind`` (dead, hung, stopped, left, link), about ``rank``, in words."""

    kind: str
    rank: int
    reason: str
    exit_code: int | None = None  # a stopped member's own exit code
    cause: str | None = None  # a stopped member's own cause
    noticed: bool = False  # read from the job's notice (another rank gave up first), not from a member's record

    @property
    def fails_stop(self) -> bool:
        """Dead, hung or stopped members end the start (L2); left and link are communication faults."""
        return self.kind in (DEAD, HUNG, STOPPED)


def _member_gone(r: int, s: Seen, now: float, heartbeat_s: float,
                 describe: Callable[[int], str]) -> Verdict | None:
    rec = s.record
    if rec is None:
        return None
    if rec.get("dead"):
        how = rec["dead"].get("how", "its process ended") if isinstance(rec["dead"], dict) else "its process ended"
        by = rec["dead"].get("by") if isinstance(rec["dead"], dict) else None
        seen_by = f" (seen by rank {by})" if isinstance(by, int) else f" (seen by {by})" if by else ""
        return Verdict(DEAD, r, f"{describe(r)} died: {how}{seen_by}",
                       cause="out-of-memory" if isinstance(rec["dead"], dict) and rec["dead"].get("oom") else None)
    stop = rec.get("stop")
    if isinstance(stop, dict) and stop.get("cause") == "completed":
        return None  # it finished its loop and is on its way to the job's last rounds: it will come
    if isinstance(stop, dict):  # it said why: adopt its reason, and its culprit (a rank that adopted it too)
        code = stop.get("exit_code")
        culprit = stop.get("rank") if isinstance(stop.get("rank"), int) else r
        return Verdict(STOPPED, culprit, f"{stop.get('reason')} (from {describe(r)}, which stopped on it)",
                       code if isinstance(code, int) else None, stop.get("cause"))
    if now - s.changed_at > heartbeat_s:
        return Verdict(HUNG, r, f"{describe(r)} sent no heartbeat for {now - s.changed_at:.1f} s (its last: "
                                f"update {rec.get('u')}, {rec.get('ph')}): hung, or its node is lost")
    return None


def cp_ahead(wait: Any, position: tuple[int, Mapping[str, int]]) -> bool:
    """Whether a member waiting in control-plane round ``wait`` is in a round this rank has not reached (pure).

    ``position``: this rank's control-plane generation and, per agreement name, how many rounds it entered.  A
    member's record may lag (it left that round since): a round this rank already passed says nothing.
    """
    try:
        _c, gen, name, rnd = wait
        gen, rnd = int(gen), int(rnd)
    except (TypeError, ValueError):
        return False
    my_gen, rounds = position
    if gen != my_gen:
        return gen > my_gen
    return rnd >= int(rounds.get(name, 0))


@dataclass
class Episode:
    """One wait in a collective: when it began, and when every member was first seen in it.

    (A member that completed the collective while this rank still waits is not a verdict: on a loaded node the
    waiting rank's backend thread may simply not have run yet, and a peer's next collective on the group would
    meet this rank's pending part; the backend's own timeout decides that case.)"""

    started: float
    all_in_since: float | None = None


def judge_collective(me: int, members: Iterable[int], group: str, seq: int, seen: Mapping[int, Seen], now: float,
                     episode: Episode, *, bound_s: float, heartbeat_s: float, fresh_s: float,
                     position: tuple[int, Mapping[str, int]],
                     describe: Callable[[int], str] = lambda r: f"rank {r}",
                     notice: Any = None, update: int | None = None) -> Verdict | None:
    """The verdict on this rank's wait in collective ``seq`` of ``group``, or None to keep waiting (pure).

    See the module docstring for the rules.  ``episode`` carries the times across calls of one wait;
    ``notice``: the raw value of :data:`NOTICE_KEY` and ``update`` this rank's update (the notice counts when it
    is of this rank's generation and update, from another rank).
    """
    others = [r for r in members if r != me]
    for r in others:
        if r in seen:
            v = _member_gone(r, seen[r], now, heartbeat_s, describe)
            if v is not None:
                return v
    n = decode(notice)
    if n is not None and n.get("g") == position[0] and n.get("u") == update and n.get("r") != me \
            and isinstance(n.get("r"), int):
        return Verdict(LEFT, n["r"], f"{describe(n['r'])} gave up update {update}'s collective {n.get('seq')} of "
                                     f"group {n.get('grp')} ({n.get('why')}): every rank meets it in the vote",
                       noticed=True)
    everyone_in = True
    for r in others:
        s = seen.get(r)
        rec = s.record if s is not None else None
        if rec is None:
            everyone_in = False
            continue
        wait = rec.get("w")
        if isinstance(wait, list) and wait[:1] == ["c"] and cp_ahead(wait, position):
            return Verdict(LEFT, r, f"{describe(r)} left collective {seq} of group {group}: it waits in the "
                                    f"control plane's {wait[2]!r} round, which needs this rank")
        fresh = now - s.changed_at <= fresh_s
        if not (fresh and wait == ["d", group, seq]):
            everyone_in = False
    if not everyone_in or not others:
        episode.all_in_since = None
        return None
    if episode.all_in_since is None:
        episode.all_in_since = now
        return None
    if now - episode.all_in_since > bound_s:
        return Verdict(LINK, others[0], f"every member of group {group} is alive and has waited in its collective "
                                        f"{seq} for {now - episode.started:.2f} s, past the bound of {bound_s:.2f} s "
                                        f"learned from this job's collectives: a broken link")
    return None


def judge_control(missing: Iterable[int], seen: Mapping[int, Seen], now: float, *, heartbeat_s: float,
                  describe: Callable[[int], str] = lambda r: f"rank {r}") -> Verdict | None:
    """The verdict on a control-plane round that ``missing`` have not joined yet, or None to keep waiting (pure).

    A missing member that is dead, stopped or hung will never join: the round fails at once.  One that computes
    or waits in a collective may still come (or give up on its collective and come): keep waiting.
    """
    for r in missing:
        if r in seen:
            v = _member_gone(r, seen[r], now, heartbeat_s, describe)
            if v is not None:
                return v
    return None
