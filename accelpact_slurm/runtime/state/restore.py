"""L2 reload: on every start, load the newest snapshot verified on any reachable copy that still checks out.

Who calls: every rank, before the training loop, at the same point (collective):
``job.protect`` -> :class:`~accelpact_slurm.runtime.job.api.Run` -> :func:`restore`.

The steps (each round one control-plane ``all_gather``; ``docs/checkpoints.md#resume`` has them in full):
1. **offer**: every rank lists the snapshots it can reach, node directory first, then the shared tier
   (:func:`reachable_verified`; an entry that cannot be a snapshot of this run is skipped with one warning:
   :func:`candidates`).  An offer names each copy by step and place (``node`` or ``shared``), never by a path:
   every rank derives what it opens from its own layout (:meth:`StateIO.path_of`; another shape is dropped,
   :func:`offered`); pure :func:`plan` orders the candidates, newest first, with the ranks that lack each;
2. **copy** (a step some ranks lack): the lowest rank that holds it copies it into the shared tier
   (:meth:`StateIO.share`: temporary name, fsync, rename; node-local disks are not visible across nodes); a copy
   that fails moves every rank to the next older candidate;
3. **re-check**: one rank per copy re-reads every file the manifest lists (size and digest,
   :func:`ckpt_service.verify.check_checksums`) but a file that is still the inode its node's daemon hashed
   (:mod:`ckpt_service.seal`); pure :func:`agree` combines the answers;
4. **load** (verified means loadable, :mod:`~accelpact_slurm.runtime.state.loadfit`): a refused copy moves every
   rank to the next older one, rejected once an older one loads; none loads: one stop, exit 76, nothing rejected;
5. the replay check runs later, on the training path (:mod:`accelpact_slurm.runtime.state.replay`);
6. rank 0 writes one ``restart_load`` event (nothing when there was no snapshot at all).

Rejections are recorded as the daemon records them: ``state.json`` beside the data
(:func:`ckpt_service.index.record_state`, the source of truth), a ``checkpoint`` event and, for a node-local copy, a
republished ``ckpt-index/<node>.json``.  The node's daemon may be running meanwhile:
:func:`ckpt_service.index.publish_index` re-reads every state under a lock, so neither writer can leave an index
older than the state files.  The daemon's in-memory state of that step stays ``verified`` until its next start;
nothing selects from it (selection reads ``state.json``).  A load that fails for the environment (a disk, a link,
files replaced after their re-check) is no rejection: it ends the start, and the no-progress rule bounds the retries.

Test-only: ``TestFaults.skip_reload_check`` skips the re-check and the replay check.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, CheckpointError, FailStop
from accelpact_slurm.core.events import lap
from accelpact_slurm.core.rank import RankContext
from accelpact_slurm.runtime.state import loadfit
from ckpt_service.index import common_step, dir_size, newest_verified, publish_index, record_state, scan
from ckpt_service.layout import DEL_PREFIX, MAX_STEP, node_dir, shared_dir, step_dirname
from ckpt_service import committed
from ckpt_service.auth import load_key, load_or_create_key
from ckpt_service.safeio import is_plain_dir
from ckpt_service.tiers import copy_to_shared
from ckpt_service.verify import check_checksums


log = logging.getLogger(__name__)

__all__ = ["candidates", "reachable_verified", "restore", "newest_verified", "common_step", "plan", "agree",
           "reload", "ReloadOutcome"]
_MAX_HOSTS_NAMED = 4


# --------------------------------------------------------------------------- what this rank can reach


def candidates(ndir: str, sdir: str, max_step: int | None = None, warn: bool = True) -> list[Any]:
    """The snapshot records of the shared tier, then of this node's directory, that may be loaded.

    Left out, each with one warning line naming its path (``warn``): an entry named like a snapshot the
    layout never writes (``step-`` and eleven digits, say), a step name that is no directory, and a step
    beyond ``max_step`` (the job's number of updates: no snapshot of this run can hold a later one).
    None of them reaches the re-check or the load.
    """
    out: list[Any] = []
    bad: list[tuple[str, str]] = []
    for d in (sdir, ndir):
        for rec in scan(d, bad=bad):
            if max_step is not None and rec.step > max_step:
                bad.append((rec.path, f"step {rec.step} is beyond the job's last update ({max_step}): no snapshot "
                                      f"of this run"))
                continue
            out.append(rec)
    if warn:
        for path, why in bad:
            log.warning("%s: %s, skipped", path, why)
    return out


def reachable_verified(ndir: str, sdir: str, max_step: int | None = None) -> dict[int, str]:
    """``{step: path}`` of verified snapshots this rank can load; the node's copy wins over the shared tier."""
    return _verified(candidates(ndir, sdir, max_step))


def _verified(records: Sequence[Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    for rec in records:  # the shared tier's first: the node's copy wins
        if rec.state == "verified":
            out[rec.step] = rec.path
    return out


def make_offer(host: str, ndir: str, sdir: str, max_step: int | None = None) -> dict[str, Any]:
    """This rank's contribution to the offer round (JSON): its verified copies and why others are unusable.

    A copy is named by its step and where it lies (:data:`WHERE`: this node's directory or the shared
    tier), never by a path: each rank derives the path of a copy from its own layout
    (:meth:`StateIO.path_of`), so no path that came through the control plane is ever opened.  Entries
    that cannot be snapshots of this run are left out with one warning each (:func:`candidates`).
    """
    records = candidates(ndir, sdir, max_step)
    verified = _verified(records)
    other: dict[int, tuple[str, str | None]] = {}
    for rec in records:  # the node's record wins, as for verified copies
        if rec.step not in verified:
            other[rec.step] = (rec.state, rec.reason)
    node = os.path.abspath(ndir)
    return {"host": host, "verified": sorted([s, "node" if os.path.dirname(p) == node else "shared"]
                                             for s, p in verified.items()),
            "other": sorted([s, st, why] for s, (st, why) in other.items())}


#: Where a copy of an offer lies: the offering rank's node directory, or the shared tier.
WHERE = ("node", "shared")


def offered(offer: Mapping[str, Any]) -> tuple[dict[int, str], list[str]]:
    """``({step: where}, [why each dropped entry was dropped])`` of one rank's offer.  Pure.

    An offer arrives through the control plane: an entry that is not a step (an integer from 0 to
    :data:`~ckpt_service.layout.MAX_STEP`) with a place in :data:`WHERE` (a path, say) is dropped.
    """
    out: dict[int, str] = {}
    dropped: list[str] = []
    entries = offer.get("verified") if isinstance(offer, Mapping) else None
    for entry in entries if isinstance(entries, list) else []:
        if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and not isinstance(entry[0], bool) and 0 <= entry[0] <= MAX_STEP and entry[1] in WHERE):
            out[entry[0]] = entry[1]
        else:
            dropped.append(f"offered entry {str(entry)[:120]} dropped: not a step with a place in {list(WHERE)} "
                           f"(a path from a message is never opened)")
    return out, dropped


# --------------------------------------------------------------------------- pure decisions


def plan(offers: Sequence[Mapping[str, Any]]) -> tuple[list[int], dict[int, list[int]], str]:
    """Candidates newest first (verified on at least one rank's reach), the ranks lacking each, a summary.

    Pure.  ``offers[r]`` is rank r's :func:`make_offer`.  A step that some ranks lack is still a
    candidate: a rank that holds it copies it to the shared tier first (:func:`reload`), so the
    loss of a node's directory costs a copy, not the progress.
    """
    if not offers:
        return [], {}, "no ranks"
    verified = [set(offered(o)[0]) for o in offers]
    steps = sorted(set().union(*verified), reverse=True)
    lacking = {s: [r for r, v in enumerate(verified) if s not in v] for s in steps}
    if not steps:
        return [], {}, "no verified snapshot on any rank"
    everywhere = [s for s in steps if not lacking[s]]
    why = f"{len(steps)} verified step(s), newest {steps[0]}"
    if lacking[steps[0]]:
        hosts = _names(str(offers[r].get("host", f"rank {r}")) for r in lacking[steps[0]])
        why += (f" (lacking on {', '.join(hosts[:_MAX_HOSTS_NAMED])}"
                f"{f' and {len(hosts) - _MAX_HOSTS_NAMED} more host(s)' if len(hosts) > _MAX_HOSTS_NAMED else ''}: "
                f"copied through the shared tier)")
    if everywhere and everywhere[0] != steps[0]:
        why += f"; newest on every rank {everywhere[0]}"
    return steps, lacking, why


def _names(hosts: Any) -> list[str]:
    """Distinct host names in first-seen order."""
    return list(dict.fromkeys(hosts))


def agree(results: Sequence[Any], hosts: Sequence[str]) -> tuple[bool, str, list[tuple[int, str, str]]]:
    """Combine one round's per-rank answers ``[ok, reason, path]`` (``None``: this rank did not check).  Pure.

    Returns ``(every answer ok, reason, [(rank, path, reason) of every failed answer])``.
    """
    bad = [(r, str(res[2]), str(res[1])) for r, res in enumerate(results) if res is not None and not res[0]]
    if not bad:
        n = sum(res is not None for res in results)
        return True, f"{n} answer(s), all pass", []
    seen, parts = set(), []
    for r, _path, why in bad:
        key = (hosts[r], why)
        if key not in seen:
            seen.add(key)
            parts.append(f"{hosts[r]}: {why}")
    return False, "; ".join(parts), bad


def checker_ranks(paths: Sequence[str]) -> dict[str, int]:
    """``{path: the lowest rank that reaches it}``: one rank re-reads each copy.  Pure."""
    out: dict[str, int] = {}
    for r, p in enumerate(paths):
        out.setdefault(p, r)
    return out


def same_bits(a: Any, b: Any) -> bool:
    """Bitwise float equality (``-0.0`` differs from ``0.0``; NaN never matches a recorded NaN either)."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return False
    a, b = float(a), float(b)
    return a == a and a.hex() == b.hex()


# --------------------------------------------------------------------------- the agreement loop


class ReloadIO(Protocol):
    """What :func:`reload` does to this rank's files and trainer (a fake in the unit tests)."""

    def path_of(self, step: int, where: str) -> tuple[str | None, str]:
        """``(path, reason)`` of this rank's copy of ``step`` in ``where`` (:data:`WHERE`), from its own layout;
        ``None`` when that path does not resolve inside the run's snapshot directories."""

    def check(self, path: str) -> tuple[bool, str]:
        """Re-read the copy at ``path`` (no loading); ``(ok, reason)``."""

    def load(self, path: str) -> Mapping[str, float] | None:
        """Load the copy into the protected state (collective); the seconds of its parts, when it measured them."""

    def fits(self, path: str) -> tuple[bool, str]:
        """Whether the copy holds exactly the model's tensors (:func:`loadfit.model_fit`); optional."""

    def reject(self, step: int, path: str, reason: str) -> None:
        """Record ``rejected`` for the copy (called by one rank per copy)."""

    def share(self, step: int, path: str) -> tuple[bool, str, str | None]:
        """Copy the verified copy at ``path`` to the shared tier for the ranks that lack it; ``(ok, why, new path)``."""


@dataclass
class ReloadOutcome:
    step: int | None
    path: str | None
    reason: str
    skipped: list[dict[str, Any]] = field(default_factory=list)
    offered: bool = False  # some rank could reach a verified snapshot
    copied: dict[str, Any] | None = None  # {from, to, hosts, why}: the step was copied for ranks that lacked it
    stop: str | None = None  # no candidate could be restored: the stop's one line (nothing to resume, no restart)
    parts: dict[str, Any] = field(default_factory=dict)  # where this rank's time went (seconds; restart_load.parts)


def reload(rank: int, offer: Mapping[str, Any], control: Any, io: ReloadIO, *, check: bool = True,
           copy: bool = True, timeout_s: float | None = None) -> ReloadOutcome:
    """Collective (every rank, same order): agree on, copy where lacking, check and load the newest usable snapshot.

    ``control`` is the control plane (``all_gather(name, value, timeout_s=...)``); ``timeout_s`` bounds each round
    (copying, re-reading or loading a large snapshot takes a while).  The loop is bounded by the candidates of the
    offer round: each is tried at most once. ``copy=False`` (test-only) takes only steps every rank reaches.
    """
    mine, dropped = offered(offer)
    for step, where in list(mine.items()):  # this rank's own copies: derived from its own layout, here
        if io.path_of(step, where)[0] is None:
            dropped.append(f"step {step} in {where}: {io.path_of(step, where)[1]}")
            del mine[step]
    offer = {**offer, "verified": sorted([s, w] for s, w in mine.items())}
    parts: dict[str, Any] = {}
    t0 = time.monotonic()
    offers = control.all_gather("reload-offer", dict(offer), timeout_s=timeout_s)
    lap(parts, "offer_round_s", t0)
    hosts = [str(o.get("host")) if isinstance(o, Mapping) else f"rank {r}" for r, o in enumerate(offers)]
    offers = [offer if r == rank else (o if isinstance(o, Mapping) else {}) for r, o in enumerate(offers)]
    for r, o in enumerate(offers):
        dropped += [f"rank {r}: {why}" for why in offered(o)[1]]
    for why in dropped:
        log.warning("reload offer: %s", why)
    order, lacking, summary = plan(offers)
    reach = [offered(o)[0] for o in offers]
    skipped: dict[int, str] = {}
    unloadable: dict[int, tuple[str, list[tuple[int, str, str]], bool, str, str | None]] = {}
    for step in order:
        # Which copy each rank would load, by name ("node:<host>" or "shared"): the same view on every rank.
        copies: list[str | None] = [_copy_id(v.get(step), hosts[r]) for r, v in enumerate(reach)]
        path = io.path_of(step, reach[rank][step])[0] if step in reach[rank] else None
        copied: dict[str, Any] | None = None
        failed_check = None
        passed: set[str] = set()  # copies already re-read in this start (not re-read again)
        for _attempt in range(2):  # a second attempt only after some copies failed their re-check
            if any(c is None for c in copies):
                lack = [r for r, c in enumerate(copies) if c is None]
                if not copy:
                    skipped[step] = (f"lacking on {', '.join(_names(hosts[r] for r in lack))}, and copying is "
                                     f"disabled (test-only switch)")
                    break
                src = next((r for r, c in enumerate(copies) if c is not None and c != "shared"), None)
                if src is None:
                    skipped[step] = "offered in the shared tier, but some ranks cannot see it there"
                    break
                res = None
                t0 = time.monotonic()
                if src == rank:
                    res = list(io.share(step, str(path)))[:2] if path is not None else \
                        [False, "this rank's copy does not resolve inside the run's directories"]
                answer = control.all_gather("reload-copy", res, timeout_s=timeout_s)[src]
                lap(parts, "copy_round_s", t0)
                ok, why = (bool(answer[0]), str(answer[1])) if isinstance(answer, list) and len(answer) >= 2 \
                    else (False, f"no answer from {hosts[src]}")
                if not ok:
                    having = _names(hosts[r] for r, c in enumerate(copies) if c)
                    skipped[step] = (f"verified on {', '.join(having)} only, and the copy to the shared tier "
                                     f"failed: {why}")
                    log.warning("step %d not usable: %s", step, skipped[step])
                    break
                shared = io.path_of(step, "shared")[0]  # every rank names the copy itself: no path from a message
                copied = {"from": hosts[src], "to": shared, "hosts": _names(hosts[r] for r in lack), "why": why}
                if failed_check:
                    copied["after"] = failed_check
                if copies[rank] is None:
                    path = shared
                copies = [c or "shared" for c in copies]
            if check:
                checker = checker_ranks(copies)
                res = None
                t0 = time.monotonic()
                if checker[copies[rank]] == rank and copies[rank] not in passed:
                    res = [*io.check(path), copies[rank]] if path is not None else \
                        [False, "the copy does not resolve inside the run's directories", copies[rank]]
                    lap(parts, "check_s", t0)
                    parts["check"] = res[1]
                ok, why, bad = agree(control.all_gather("reload-check", res, timeout_s=timeout_s), hosts)
                lap(parts, "check_round_s", t0)
                failed = {c for _r, c, _why in bad}
                passed |= {str(c) for c in copies if c not in failed}
                if not ok:
                    _reject_once(rank, step, bad, io, "re-check at restart failed: ", copies[rank], path)
                    log.warning("step %d rejected at restart: %s", step, why)
                    good = [None if c in failed else c for c in copies]
                    if copied is None and copy and any(good):  # another node's own copy passed: copy that one
                        failed_check, copies = f"re-check at restart failed: {why}", good
                        continue
                    skipped[step] = f"re-check at restart failed: {why}"
                    break
            if path is None:  # unreachable with an honest control plane: checked above
                skipped[step] = "this rank's copy does not resolve inside the run's directories"
                break
            refused = loadfit.load_agreed(rank, step, path, copies[rank], io, control, hosts, timeout_s, parts)
            if refused is not None:  # rejected once an older one loads (the model is then not what changed)
                unloadable[step] = (*refused, copies[rank], path)
                skipped[step] = f"cannot be restored: {refused[0]}"
                log.warning("step %d cannot be restored: %s", step, refused[0])
                break
            for newer, (_why, failed, _model, mine, at) in unloadable.items():  # this model loads snapshots: reject
                _reject_once(rank, newer, failed, io, "cannot be restored: ", mine, at)
            where = "verified on every node (or in the shared tier)" if copied is None else \
                f"verified on {copied['from']}, copied to the shared tier for {', '.join(copied['hosts'])}"
            if failed_check:
                where += f" (after {failed_check})"
            why = (f"step {step} is the newest snapshot {where}, its checksums re-read (or its files still those "
                   f"its node's daemon verified)" if check
                   else f"step {step} ({where}) loaded without re-check (test-only switch)")
            out = _done(step, path, why, skipped)
            out.copied, out.parts = copied, parts
            return out
    offered_any = bool(order)
    why = summary if not skipped else f"every candidate was rejected ({summary})"
    out = ReloadOutcome(None, None, why, _skipped(None, skipped), offered_any, parts=parts)
    if unloadable:  # starting over from update 0 would discard the run's progress for a model that changed
        out.stop = loadfit.no_snapshot_line({s: u[0] for s, u in unloadable.items()},
                                            any(u[2] for u in unloadable.values()))
    return out


def _copy_id(where: str | None, host: str) -> str | None:
    """The name of one copy, the same on every rank: the shared tier's, or a node's own (by host)."""
    if where is None:
        return None
    return "shared" if where == "shared" else f"node:{host}"


def _reject_once(rank: int, step: int, bad: list[tuple[int, str, str]], io: ReloadIO, prefix: str,
                 mine: str | None, path: str | None) -> None:
    """The lowest failing rank of each copy records the rejection (no two ranks write one state file).

    ``mine`` names this rank's copy and ``path`` is where this rank found it: a rank rejects only its own."""
    first: dict[str, tuple[int, str]] = {}
    for r, copy_id, why in bad:
        first.setdefault(copy_id, (r, why))
    for copy_id, (r, why) in first.items():
        if r == rank and copy_id == mine and path is not None:
            try:
                io.reject(step, path, prefix + why)
            except OSError as exc:  # a read-only shared tier: the rejection still holds for this start
                log.warning("could not record the rejection of %s: %s", path, exc)


def _skipped(loaded: int | None, skipped: Mapping[int, str]) -> list[dict[str, Any]]:
    return [{"step": s, "reason": skipped[s]} for s in sorted(skipped, reverse=True) if loaded is None or s > loaded]


def _done(step: int, path: str, why: str, skipped: Mapping[int, str]) -> ReloadOutcome:
    return ReloadOutcome(step, path, why, _skipped(step, skipped), True)


# --------------------------------------------------------------------------- the real I/O


class StateIO:
    """:class:`ReloadIO` on this rank's protected state and node directory.

    ``load_fn(path)`` loads a snapshot into the protected state (collective); ``host`` names this node.
    """

    def __init__(self, load_fn: Any, run_dir: str, ndir: str, host: str, milestone_every: int,
                 events: Any = None, sdir: str | None = None, model: Any = None, checked: bool = True) -> None:
        self.load_fn = load_fn
        self.model, self.checked = model, checked
        self._want: dict[str, Any] | None = None  # model None: no fit check before a load
        self.run_dir = run_dir
        self.ndir = ndir
        self.sdir = sdir or shared_dir(run_dir)
        self.events = events
        self.host = host
        self.milestone_every = milestone_every

    def path_of(self, step: int, where: str) -> tuple[str | None, str]:
        """This rank's copy of ``step`` in its node directory or the shared tier (see :meth:`ReloadIO.path_of`).

        The step directory must be a real directory right inside that base: not a link, and resolving
        (``realpath``) to the same place, so nothing outside the run's snapshot directories is opened."""
        base = {"node": self.ndir, "shared": self.sdir}.get(where)
        if base is None:
            return None, f"{where!r} is no place of a snapshot"
        path = os.path.join(base, step_dirname(step))
        if os.path.exists(path) and (not is_plain_dir(path) or os.path.realpath(path) !=
                                     os.path.join(os.path.realpath(base), step_dirname(step))):
            return None, f"{path} is a link or resolves outside {base}: not read"
        return path, "inside the run's snapshot directories"

    def check(self, path: str) -> tuple[bool, str]:
        """The copy's checksums; a file that is still the inode its daemon hashed (:mod:`ckpt_service.seal`) is not
        read again (a copy in another tier, or made at this start, is another inode: always hashed)."""
        try:
            return check_checksums(path, load_or_create_key(self.run_dir), trust_seal=True)
        except OSError as exc:  # unreadable: as bad as corrupted
            return False, f"cannot re-read: {exc}"

    def load(self, path: str) -> Mapping[str, float] | None:
        parts = self.load_fn(path)
        return parts if isinstance(parts, Mapping) else None

    def fits(self, path: str) -> tuple[bool, str]:
        if self.model is None:
            return True, "not checked"
        if self._want is None:  # once per start: every rank reaches the first fit round together
            self._want = loadfit.expected(self.model)
        return loadfit.model_fit(self._want, path, load_or_create_key(self.run_dir) if self.checked else None)

    def reject(self, step: int, path: str, reason: str) -> None:
        reject_copy(step, path, reason, self.run_dir, self.ndir, self.host, self.milestone_every, self.events)

    def share(self, step: int, path: str) -> tuple[bool, str, str | None]:
        """Copy this node's verified ``path`` into the shared tier (temporary name, fsync, rename).

        The run directory, and with it the shared tier, is on the cluster's shared file system;
        node-local disks are not visible across nodes, so this is the one path every rank can read.
        A rejected copy of the same step in the shared tier is moved aside first (a fresh copy of a
        verified snapshot replaces it, as a new snapshot of the same step does in a node directory).
        The copy is re-read against the signed manifest by the check round that follows.
        """
        t0 = time.monotonic()
        final = os.path.join(self.sdir, os.path.basename(path.rstrip("/")))
        try:
            if os.path.exists(final):
                aside = os.path.join(self.sdir, f"{DEL_PREFIX}{os.path.basename(final)}-{os.getpid()}")
                os.rename(final, aside)
                shutil.rmtree(aside, ignore_errors=True)
            dst, why = copy_to_shared(path, self.sdir, self.host)
        except OSError as exc:
            return False, f"cannot copy {path} to {self.sdir}: {exc}", None
        if dst is None:
            return False, why, None
        seconds, size = time.monotonic() - t0, dir_size(dst)
        record_state(dst, "verified", f"copied at restart from {self.host}'s verified copy {path} "
                                      f"({size} bytes in {seconds:.2f} s); checksums re-read before loading")
        if self.events is not None:
            self.events.emit("checkpoint_copy", step=step, source=path, path=dst, size_bytes=size, copy_s=seconds,
                             hostname=self.host, reason="a rank of this start lacks the step")
        log.info("copied step %d from %s to %s: %d bytes in %.2f s", step, path, dst, size, seconds)
        return True, f"{size} bytes in {seconds:.2f} s", dst


def reject_copy(step: int, path: str, reason: str, run_dir: str, ndir: str, host: str, milestone_every: int,
                events: Any = None, source: str = "restore") -> None:
    """Record ``rejected`` for one copy: its state file, a ``checkpoint`` event, the node's index."""
    record_state(path, "rejected", reason)
    size = None
    try:
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    except OSError:
        pass
    if events is not None:
        events.emit("checkpoint", step=step, state="rejected", size_bytes=size, path=path, reason=reason,
                    hostname=host, source=source)
    if os.path.dirname(os.path.abspath(path)) == os.path.abspath(ndir):
        try:
            publish_index(run_dir, host, scan(ndir, milestone_every))
        except OSError:
            log.warning("could not publish the checkpoint index of %s", host, exc_info=True)


def settle_pending(ndir: str, timeout_s: float, poll_s: float = 0.2) -> list[int]:
    """Wait (bounded) until the node's daemon has verified or rejected every snapshot newer than the newest verified.

    A snapshot committed just before a requeue is verified by the node's daemon when it starts again; without this
    wait the ranks of a faster node would see it verified and the others not, and an older step would be chosen.
    Returns the steps still unsettled at the deadline (then they are simply not candidates).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        records = scan(ndir)
        newest = max((r.step for r in records if r.state == "verified"), default=-1)
        pending = sorted(r.step for r in records if r.state == "committed" and r.step > newest)
        if not pending or time.monotonic() >= deadline:
            if pending:
                log.warning("snapshots %s of %s still unverified after %g s", pending, ndir, timeout_s)
            return pending
        threading.Event().wait(poll_s)


def _against_committed(run_dir: str, out: ReloadOutcome, events: Any) -> int | None:
    """Rank 0: the newest step the job committed (signed, :mod:`ckpt_service.committed`); one ``warning`` when this
    start loads an older one."""
    try:
        key = load_key(run_dir)
    except CheckpointError:  # no key yet: a first start, nothing was ever committed
        return None
    step, node, ignored = committed.newest(run_dir, key)
    for why in ignored:
        log.warning("committed-step record ignored: %s", why)
    skipped = [int(s["step"]) for s in out.skipped if isinstance(s.get("step"), int)]
    warning = committed.rollback(out.step, step, node, skipped)
    if warning:
        log.warning("%s", warning)
        events.emit("warning", step=out.step, reason=warning)
    return step


def restore(rt: RankContext, cfg: Any, run_dir: str, load_fn: Any, events: Any = None, *,
            check: bool = True, copy: bool = True, model: Any = None) -> ReloadOutcome:
    """Collective: load the newest usable snapshot into the protected state (see the module docstring).

    ``load_fn(path)`` loads one snapshot (collective); ``model``: whose tensors a candidate must hold exactly;
    ``check=False`` and ``copy=False`` are test-only switches.  Raises FailStop (76) when no candidate loads.
    """
    t0 = time.monotonic()
    ndir = node_dir(run_dir, rt.ctx.hostname, cfg.checkpoint.local_dir)
    sdir = shared_dir(run_dir, cfg.checkpoint.shared_dir)
    if not check:
        log.warning("reload re-check and replay disabled (test-only fault injection)")
    timeout = max(cfg.timeouts.control_s, cfg.timeouts.startup_s)
    settle_pending(ndir, timeout)
    t_settled = time.monotonic()
    steps = getattr(cfg, "steps", None)  # the job's number of updates: its last snapshot is of that step
    offer = make_offer(rt.ctx.hostname, ndir, sdir, steps if isinstance(steps, int) and steps >= 0 else None)
    io = StateIO(load_fn, run_dir, ndir, rt.ctx.hostname, cfg.checkpoint.milestone_every, events, sdir, model, check)
    t_offer = time.monotonic()
    out = reload(rt.rank, offer, rt.control, io, check=check, copy=copy, timeout_s=timeout)
    out.parts = {"settle_s": round(t_settled - t0, 4), "offer_s": round(t_offer - t_settled, 4), **out.parts}
    if rt.rank == 0 and events is not None:
        newest_committed = _against_committed(run_dir, out, events)
        if out.offered:
            events.emit("restart_load", step=out.step, reason=out.reason, skipped=out.skipped, path=out.path,
                        checked=check, copied=out.copied, load_s=time.monotonic() - t0, committed=newest_committed,
                        parts=out.parts)
    if out.stop is not None:  # every rank: the same rounds gave every rank the same line
        raise FailStop(out.stop, EXIT_NO_REQUEUE, cause="checkpoint", phase="restore", frontier=None,
                       decided_at=time.monotonic())
    if out.step is None and out.offered:
        log.warning("not resuming: %s", out.reason)
    elif out.step is not None:
        log.info("resumed from %s: %s", out.path, out.reason)
    return out
