"""The control plane: every out-of-band agreement between ranks.

Built on its own client of the job's store (:mod:`.store`: only holders of the run's key get in; never the data
plane's groups, never the default process group) with a ``PrefixStore`` per generation, so that an agreement of a
retired generation can never be mistaken for one of the current one.  Every call blocks with a deadline and raises
:class:`~accelpact_slurm.core.errors.ControlPlaneTimeout` naming the ranks that did not answer.

A round over N members costs the store O(N), not O(N^2): every member posts its value under a key of its own; the
round's lead (its lowest member) reads the N values in one blocking read and posts them as one result
(``<round>/all``), which every other member reads: three one-key requests a member, one N-key read and one write for
the lead.  :meth:`ControlPlane.all_reduce` (the vote) combines on the lead, so what a member reads does not grow
with N.  Below ``ControlPlane.LEAD_FROM`` members every member reads every value itself, in the same request that
sets its own (``JobStore.set_multi_get``): one round trip a member.

While a round lasts the rank's liveness thread watches those it waits on (:mod:`..detection.liveness`): the lead
the members that have not joined, every other member the lead.  A dead, stopped or hung member gets a stop put in
its place, which the lead posts as the round's result; a dead lead gets one in the place of its result: either way
the round fails with :class:`~accelpact_slurm.core.errors.FailStop` naming it on every rank waiting in it.  A store
that is gone (rank 0 died) fails the round at once; a lead past the deadline posts whose values were missing, so
every member raises the same :class:`ControlPlaneTimeout`.

Who calls: every rank of the world, the same calls in the same order (like a collective).  Values are JSON.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from accelpact_slurm.core.errors import EXIT_REQUEUE, ControlPlaneError, ControlPlaneTimeout, FailStop
from accelpact_slurm.runtime.detection.collectives import stop_from_round
from accelpact_slurm.runtime.detection.liveness import STOP_KEY

log = logging.getLogger(__name__)

#: How often the waits at a rank's end (:meth:`ControlPlane.leave`, :meth:`ControlPlane.wait_posted`) look.
POLL_S = 0.01
#: What a round's lead posts in place of the result when there is none: ``{ROUND_KEY: {"timeout": why}}`` (it ran
#: into the deadline) or ``{ROUND_KEY: {"direct": true}}`` (it contributed and left: read every member's value).
ROUND_KEY = "__accelpact_round__"
#: The key of a round's combined result, beside the members' ``<round>/<rank>``.
RESULT = "all"


def poisoned(raw: bytes) -> dict[str, Any] | None:
    """The stop a watcher put in a member's place in a round, or None for a member's own value (pure)."""
    if not raw.startswith(b'{"' + STOP_KEY.encode()):
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    stop = doc.get(STOP_KEY) if isinstance(doc, dict) else None
    return stop if isinstance(stop, dict) else None


class ControlPlane:
    """Key/value agreements over a dedicated store.

    Args:
        store: the control plane's own client of the job's store (:class:`~.store.JobStore`; any ``dist.Store``).
        rank: this rank in the world.
        world_size: number of ranks.
        timeout_s: default deadline of every call.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float, generation: int = 0) -> None:
        self._base = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._seq: dict[str, int] = {}
        self._stale_full: list[str] = []  # earlier generations' stale keys, deleted with the next batch
        #: The rank's fault detector (:class:`~accelpact_slurm.runtime.detection.collectives.Detector`): None waits
        #: blind.
        self.watch: Any = None
        #: The rank that hosts the store's standby (node 1's first rank), in a job whose store has one: once the
        #: store (beside rank 0) is gone, the standby's host is the one that leaves last.
        self.standby_rank: int | None = None
        self.set_generation(generation)

    def position(self) -> tuple[int, dict[str, int]]:
        """This rank's generation and, per agreement name, how many rounds it entered (pure read)."""
        return self._generation, self._seq

    @property
    def generation(self) -> int:
        return self._generation

    def set_generation(self, generation: int) -> None:
        """Move to a fresh key space; every rank must do this at the same agreed point.

        No request of its own (it is on the repair's critical path): the last generation's leftovers, under its
        prefix, are deleted with this member's next batch of stale keys (:meth:`_clean`).
        """
        old = getattr(self, "_generation", None)
        if old is not None:
            self._stale_full += [f"cp/g{old}/{k}" for k in self._stale]
        self._generation = generation
        self._stale: list[str] = []
        self._store = dist.PrefixStore(f"cp/g{generation}", self._base)
        self._seq.clear()

    @property
    def base_store(self) -> dist.Store:
        """The control plane's own store, unprefixed (replacement groups take a fresh prefix of it)."""
        return self._base

    @property
    def store(self) -> dist.Store:
        """The current generation's prefixed store (for building replacement groups)."""
        return self._store

    # ------------------------------------------------------------------ primitives

    def all_gather(self, name: str, value: Any, ranks: Sequence[int] | None = None,
                   timeout_s: float | None = None) -> list[Any]:
        """Every rank in ``ranks`` (default: the world) contributes ``value``; all get the list in rank order.

        ``name`` must be used once per round; a sequence number is appended so a name may be reused (the n-th call
        with a name on every rank matches).  This rank's value (no answer awaited), then one blocking read bounded by
        the deadline: of every other member's value on the round's lead (which then posts the combined result), of
        that result on every other member (see the module docstring).
        """
        return self._round(name, value, ranks, timeout_s, None)

    def all_reduce(self, name: str, value: Any, combine: Callable[[list[Any]], Any],
                   ranks: Sequence[int] | None = None, timeout_s: float | None = None,
                   meanwhile: Callable[[], None] | None = None) -> Any:
        """Every rank in ``ranks`` contributes ``value``; all get ``combine(values in rank order)``.

        ``combine`` must be pure and JSON-able in its result: from :attr:`LEAD_FROM` members on it runs once, on
        the round's lead, and every other member reads its result only (O(1) in the members when the result is);
        below, every member runs it on every value.  Either way every member returns the same JSON round trip
        of it.  Deadlines, stops and the lead's death as in :meth:`all_gather`.  ``meanwhile``: this rank's own
        work, run once its value is sent and before it waits for the others' (with the job's store, while its one
        request is in flight: a member that came last has it overlap the round trip; one that waits for others, its
        wait); its exception is raised after the round (not taken for the store's).
        """
        return self._round(name, value, ranks, timeout_s, combine, meanwhile)

    def _round(self, name: str, value: Any, ranks: Sequence[int] | None, timeout_s: float | None,
               combine: Callable[[list[Any]], Any] | None, meanwhile: Callable[[], None] | None = None) -> Any:
        ranks, key = self._enter(name, ranks)
        n = self._seq[name] - 1
        mine = json.dumps(value)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        failed: list[Exception] = []
        if meanwhile is not None:
            work = meanwhile

            def meanwhile() -> None:  # its failure is the caller's, raised after the round (not the store's)
                try:
                    work()
                except Exception as exc:  # noqa: BLE001
                    failed.append(exc)
        lead = min(ranks)
        through_lead = self._through_lead(ranks)
        one_trip = not through_lead and hasattr(self._base, "set_multi_get")
        if not one_trip:
            try:
                self._store.set(f"{key}/{self.rank}", mine)
            except Exception as exc:  # noqa: BLE001 - the store's host is gone
                raise self._lost(name, exc) from exc
            if meanwhile is not None:  # this rank's value is in: its work before it waits
                meanwhile()
                meanwhile = None
        if not through_lead:  # with the job's store, this rank's value goes in the same request as the read
            values = self._gather_every(key, name, ranks, timeout, n, mine if one_trip else None, meanwhile)
            if combine is not None:
                values = json.loads(json.dumps(combine(values)))
        elif self.rank == lead:
            values = self._gather_lead(key, name, ranks, mine.encode(), timeout, n, combine)
        else:
            values = self._gather_member(key, name, ranks, lead, timeout, n, combine)
        if n >= 2:  # every member has finished round n-2 once round n-1 is complete
            self._stale.append(f"{name}#{n - 2}/{self.rank}")
            if self.rank == lead and through_lead:
                self._stale.append(f"{name}#{n - 2}/{RESULT}")
            if len(self._stale) + len(self._stale_full) >= self.CLEANUP_BATCH:
                self._clean()
        if failed:
            raise failed[0]
        return values

    #: Stale keys a member deletes in one request (the job's store takes several keys in one delete): a round
    #: costs no request of its own for the cleanup, and the store keeps a bounded number of rounds' keys.
    CLEANUP_BATCH = 16

    def _clean(self) -> None:
        """Delete this member's stale keys, of the current generation and of earlier ones (best effort)."""
        prefix = f"cp/g{self._generation}/"
        stale = self._stale_full + [prefix + k for k in self._stale]
        self._stale, self._stale_full = [], []
        try:
            if hasattr(self._base, "delete_keys"):  # the job's store: one request
                self._base.delete_keys(stale)
            else:  # any other dist.Store: one request a key
                for k in stale:
                    self._base.delete_key(k)
        except Exception:  # noqa: BLE001 - cleanup is best effort
            log.debug("could not delete %d control keys", len(stale))

    #: Every member reading every member's value at any size (O(N^2) a round): for comparisons only.
    all_read_all = False
    #: From this many members on, a round goes through its lead.  Below, every member reads every value (one
    #: request of N keys each): with few members that is cheaper than the lead's two extra hops (measured by
    #: ``make bench`` part ``control``: the two cross between 16 and 64 members on this machine).
    LEAD_FROM = 32

    def _through_lead(self, ranks: Sequence[int]) -> bool:
        return not self.all_read_all and len(ranks) >= self.LEAD_FROM

    def _gather_every(self, key: str, name: str, ranks: list[int], timeout: float, round_: int,
                      mine: str | None = None, meanwhile: Callable[[], None] | None = None) -> list[Any]:
        keys = [f"{key}/{r}" for r in ranks]
        raws = self._read(keys, name, ranks, timeout, round_, None if mine is None else (f"{key}/{self.rank}", mine),
                          meanwhile)
        for v in raws:
            self._raise_stop(v, name)
        return [json.loads(v) for v in raws]

    def _gather_lead(self, key: str, name: str, ranks: list[int], mine: bytes, timeout: float,
                     round_: int, combine: Callable[[list[Any]], Any] | None = None) -> Any:
        """The lead: the other members' values, then the combined result (or the stop, or the timeout) posted."""
        others = [r for r in ranks if r != self.rank]
        try:
            raws = self._read([f"{key}/{r}" for r in others], name, others, timeout, round_) if others else []
        except ControlPlaneTimeout as exc:
            self._post_result(key, name, json.dumps({ROUND_KEY: {"timeout": str(exc)}}).encode(), check=False)
            raise
        got = dict(zip(others, raws))
        got[self.rank] = mine
        ordered = [got[r] for r in ranks]
        stop = next((v for v in ordered if poisoned(v) is not None), None)
        if stop is not None:
            result = stop
        elif combine is None:
            result = b"[" + b",".join(ordered) + b"]"
        else:  # one combined value for everyone: posted as a one-item list, read back the same on every member
            result = json.dumps([combine([json.loads(v) for v in ordered])]).encode()
        self._post_result(key, name, result)
        if stop is not None:
            self._raise_stop(stop, name)
        if combine is not None:
            return json.loads(result)[0]
        return [json.loads(v) for v in ordered]

    def _post_result(self, key: str, name: str, result: bytes, check: bool = True) -> None:
        """Post the round's result unless a watcher already put a stop in its place (this lead was judged dead,
        stopped or hung): then that stop is the round's result here too."""
        try:
            there = self._store.compare_set(f"{key}/{RESULT}", "", result)
        except Exception as exc:  # noqa: BLE001 - the store's host is gone
            if not check:
                return
            raise self._lost(name, exc) from exc
        if check and there != result:
            self._raise_stop(there, name)

    def _gather_member(self, key: str, name: str, ranks: list[int], lead: int, timeout: float,
                       round_: int, combine: Callable[[list[Any]], Any] | None = None) -> Any:
        """Any member but the lead: the lead's one combined result."""
        started = time.monotonic()
        try:
            raw = self._read([f"{key}/{RESULT}"], name, [lead], timeout, round_)[0]
        except ControlPlaneTimeout:
            missing = [r for r in ranks if not self._has(f"{key}/{r}")]
            raise ControlPlaneTimeout(
                f"control-plane agreement {name!r} (generation {self._generation}) incomplete after "
                f"{timeout:g} s: no answer from rank(s) {missing or [lead]}"
                + ("" if missing else " (the round's lead: every value is in, its result is not)")) from None
        if raw.startswith(b"["):
            return json.loads(raw)[0] if combine is not None else json.loads(raw)
        self._raise_stop(raw, name)
        try:
            marker = json.loads(raw).get(ROUND_KEY) or {}
        except (ValueError, AttributeError):
            marker = {}
        if marker.get("timeout"):
            raise ControlPlaneTimeout(marker["timeout"])
        if marker.get("direct"):  # the lead contributed and left: every member's value, as before
            left = max(0.001, timeout - (time.monotonic() - started))  # a store's zero timeout waits forever
            values = self._gather_every(key, name, ranks, left, round_)
            return values if combine is None else json.loads(json.dumps(combine(values)))
        raise ControlPlaneError(f"control-plane agreement {name!r}: unreadable result {raw[:80]!r}")

    @staticmethod
    def _raise_stop(raw: bytes, name: str) -> None:
        stop = poisoned(raw)
        if stop is not None:

            raise stop_from_round(stop, name)

    def contribute(self, name: str, value: Any, ranks: Sequence[int] | None = None) -> None:
        """Take part in this round of the agreement ``name`` without waiting for the others.

        For a rank that is about to fail stop: the members' :meth:`all_gather` of the same round
        returns at once with ``value`` in this rank's place (e.g. why it failed), instead of waiting
        for the deadline.  The round counts as this rank's call of ``name``.  The round's lead, which will not
        gather, tells the members to read every value themselves.
        """
        ranks, key = self._enter(name, ranks)
        self._store.set(f"{key}/{self.rank}", json.dumps(value))
        if self.rank == min(ranks) and self._through_lead(ranks):
            self._store.compare_set(f"{key}/{RESULT}", "", json.dumps({ROUND_KEY: {"direct": True}}))

    def _enter(self, name: str, ranks: Sequence[int] | None) -> tuple[list[int], str]:
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        if self.rank not in ranks:
            raise ControlPlaneError(f"rank {self.rank} is not a member of the agreement {name!r} over {ranks}")
        n = self._seq.get(name, 0)
        self._seq[name] = n + 1
        return ranks, f"{name}#{n}"

    def broadcast(self, name: str, value: Any = None, src: int = 0, timeout_s: float | None = None) -> Any:
        """Return ``src``'s value on every rank."""
        return self.all_gather(name, value if self.rank == src else None, timeout_s=timeout_s)[src]

    def barrier(self, name: str, ranks: Sequence[int] | None = None, timeout_s: float | None = None) -> None:
        self.all_gather(name, 1, ranks=ranks, timeout_s=timeout_s)

    def leave(self, name: str, timeout_s: float, gone: Sequence[int] = ()) -> list[int]:
        """Announce that this rank is leaving; the store's host (rank 0) waits, up to ``timeout_s``, for the others
        (all but ``gone``: ranks known dead or hung).

        Rank 0's process hosts the store: if it exited first, a peer still reading the last agreement would fail
        (once the store went over to its standby, the standby's host waits instead).
        Returns the ranks that did not announce themselves in time (the store's host only; they are probably dead).
        """
        self._store.set(f"leave/{name}/{self.rank}", "1")
        if self.rank != self.store_host():
            return []
        waiting = {r: f"leave/{name}/{r}" for r in range(self.world_size) if r not in set(gone)}
        return sorted(self._poll(waiting, timeout_s))

    def store_host(self) -> int:
        """The rank whose process hosts the store this rank talks to: rank 0, or the standby's host once gone
        over to it."""
        if self.standby_rank is not None and getattr(self._base, "failed_over", False):
            return self.standby_rank
        return 0

    def post(self, name: str) -> None:
        """Raise the flag ``name`` in this generation's store, once, for any rank to see (:meth:`wait_posted`)."""
        self._store.set(f"post/{name}", "1")

    def wait_posted(self, name: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the flag ``name``; False on the deadline or when the store is gone."""
        return not self._poll({0: f"post/{name}"}, timeout_s)

    def _poll(self, keys: dict[int, str], timeout_s: float) -> set[int]:
        """Look every :data:`POLL_S` until every key is set; return whose are not at the deadline (all of them when
        the store is gone).  Polls instead of a blocking wait: a wait that runs out makes the store's client log
        a warning, and these waits often run out (a peer that will not come)."""
        deadline = time.monotonic() + timeout_s
        left = dict(keys)
        while left:
            try:
                left = {r: k for r, k in left.items() if not self._store.check([k])}
            except Exception:  # the store is gone
                return set(left)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        return set(left)

    def _read(self, keys: list[str], name: str, ranks: list[int], timeout_s: float | None,
              round_: int = 0, mine: tuple[str, str] | None = None,
              meanwhile: Callable[[], None] | None = None) -> list[bytes]:
        """The values of ``keys``, once all are set, within the deadline: one blocking read (the store waits for
        missing keys up to its timeout, set here to this call's deadline for the read and put back after).
        ``mine``: this rank's ``(key, value)``, set by the same request before the read (the job's store's
        ``set_multi_get``: one round trip for the whole round; ``meanwhile`` runs while it is in flight).

        With the detector, the rank's liveness thread watches the round while it lasts (past its first slice: the
        records of ``ranks`` whose ``keys`` are missing, every slice); one that will never come gets a stop in the
        place of its key, which ends the read at once
        (:meth:`accelpact_slurm.runtime.detection.liveness.Publisher._look_round`). A stop among the values is the
        caller's to raise.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        watch = self.watch
        token = watch.round_begins(f"cp/g{self._generation}", self._generation, name, round_, keys, ranks) \
            if watch is not None else None
        before = self._base.timeout
        self._base.set_timeout(timedelta(seconds=timeout))  # local: no round trip
        try:
            if mine is None:
                if meanwhile is not None:
                    meanwhile()
                values = self._store.multi_get(keys)
            else:  # full keys: the PrefixStore does not pass this call through
                prefix = f"cp/g{self._generation}/"
                values = self._base.set_multi_get(prefix + mine[0], mine[1], [prefix + k for k in keys],
                                                  **({"meanwhile": meanwhile} if meanwhile is not None else {}))
        except Exception as exc:  # DistStoreError on the deadline; anything else: the store (rank 0) is gone
            if isinstance(exc, dist.DistStoreError) and not isinstance(exc, dist.DistNetworkError):
                raise self._timeout(keys, name, ranks, timeout) from exc
            raise self._lost(name, exc) from exc
        finally:
            self._base.set_timeout(before)
            if token is not None:
                watch.round_ends(token)
        return values

    def _lost(self, name: str, exc: BaseException) -> FailStop:
        return FailStop(f"lost the control plane in its {name!r} round (generation {self._generation}): "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; its store's host, "
                        f"rank 0, is probably gone", EXIT_REQUEUE, cause="control-plane", frontier=None,
                        decided_at=time.monotonic())

    def _timeout(self, keys: list[str], name: str, ranks: list[int], timeout: float) -> ControlPlaneTimeout:
        missing = [r for r, k in zip(ranks, keys) if not self._has(k)]
        return ControlPlaneTimeout(
            f"control-plane agreement {name!r} (generation {self._generation}) incomplete after "
            f"{timeout:g} s: no answer from rank(s) {missing}"
        )

    def _has(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except Exception:
            return False
