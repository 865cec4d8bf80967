"""The buddy ring of a job with spare nodes: every rank's per-rank packet of every update it commits, in two phases.

A spare that takes a dead rank's place gets the rank's shard from a live replica, but RNG states, per-rank
buffers, the data position and the script's ``Stateful`` objects are held by that rank only (:mod:`.rank_packet`).
So every rank hands them to the job's store, for each update, in two phases:

1. **At the vote** (:meth:`BuddyRing.at_vote`: the vote decided that update ``K`` commits, before
   ``optimizer.step``): the packet of the state the update will commit, frontier ``K`` (RNG states and buffers are
   final once backward ran, the data position is ``K``), under ``heal/packet/<rank>/<K % 2>`` (two slots: the
   packet of ``K - 1`` stays while ``K``'s is handed).  One pack per update, a few KB.
2. **At the commit** (:meth:`BuddyRing.after_commit`): a small record under ``heal/commit/<rank>`` naming the
   vote's packet and what changed since the vote: the ``Stateful`` states stepped after ``optimizer.step`` (an
   LR scheduler's ``sched.step()``), each with its value at the commit.  Where the RNG states, the buffers or the
   position changed after the vote too (a script that draws random numbers after the step), the record holds a
   whole packet packed at the commit instead.

The packet of rank ``r`` at update ``F`` (:meth:`BuddyRing.resolve`, on the survivors' lead at a heal):

- ``r`` committed ``F``: its vote's packet with its commit record's changes: exactly its state at ``F``.
- ``r`` voted for ``F`` and was lost before its commit (in the optimizer step): its vote's packet, where the lead
  (which committed ``F`` itself) stands witness for what changes after the vote.  A ``Stateful`` the lead's
  step changed whose value at the vote was the same on ``r`` and on the lead is replica-identical (a scheduler
  every rank steps alike): the lead's value at ``F`` is ``r``'s too.  One whose vote values differ, or RNG states,
  buffers or a position that changed after the lead's vote: ``r``'s value at ``F`` is not known, and the heal is
  refused naming it (L2).  What did not change on the lead after its vote is taken as ``r``'s vote value (every
  rank runs the same code after the vote).
- neither: no packet (a loss before the first vote of a start): refused.

The lead posts the packets it resolved under ``heal/resolved/g<generation>/<rank>`` before its decision; each
survivor that is a dead rank's source reads them back into its :class:`~.rank_packet.BuddyCopies`
(:func:`collect`), whose digest the certificate then relies on.

The job's store lives beside rank 0 (node 0): a packet there survives the loss of any other node, which is what a
heal covers today.  Only a job with ``topology.spare_nodes > 0`` hands packets at all (:func:`ring_for`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from accelpact_slurm.core.errors import HealError
from accelpact_slurm.runtime.state import appstate
from accelpact_slurm.runtime.state.rank_packet import (BuddyCopies, RankPacket, buffers_digest, encoded_data_state,
                                                       encoded_states, pack_rank_state, read_packet, with_states)

log = logging.getLogger(__name__)

_LEN = 4


def slot_key(rank: int, frontier: int) -> str:
    return f"heal/packet/{rank}/{frontier % 2}"


def commit_key(rank: int) -> str:
    return f"heal/commit/{rank}"


def resolved_key(generation: int, rank: int) -> str:
    return f"heal/resolved/g{generation}/{rank}"


def part_digest(encoded: Any) -> str:
    """The digest of one encoded ``state_dict()`` (whether it changed between two looks, or differs between ranks)."""
    return hashlib.sha256(json.dumps(encoded, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def restore_data_state(data: Mapping[str, Any], statefuls: Mapping[str, Any]) -> list[str]:
    """Load the ``Stateful`` states of a packet's ``data_state`` into ``statefuls``; the names it did not hold."""
    saved = data.get("state") or {}
    missing = []
    for name, obj in statefuls.items():
        if name in saved:
            obj.load_state_dict(saved[name])
        else:
            missing.append(name)
    return missing


def _frame(head: Mapping[str, Any], body: bytes) -> bytes:
    raw = json.dumps(head, sort_keys=True).encode()
    return len(raw).to_bytes(_LEN, "big") + raw + body


def _unframe(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """Raises ValueError on a value that is no frame."""
    n = int.from_bytes(raw[:_LEN], "big")
    if n <= 0 or n > len(raw) - _LEN:
        raise ValueError("not an encoded record")
    head = json.loads(raw[_LEN:_LEN + n])
    if not isinstance(head, dict):
        raise ValueError("not an encoded record")
    return head, raw[_LEN + n:]


def encode_packet(packet: RankPacket) -> bytes:
    return _frame({"rank": packet.rank, "frontier": packet.frontier, "digest": packet.digest}, packet.blob)


def decode_packet(raw: bytes) -> RankPacket:
    """Raises ValueError on a value that is no encoded packet, :class:`HealError` on one whose bytes are not its
    digest's."""
    head, blob = _unframe(raw)
    packet = RankPacket(int(head["rank"]), int(head["frontier"]), blob, str(head["digest"]))
    read_packet(blob, expect_digest=packet.digest)
    return packet


def _fetch(store: Any, key: str) -> bytes | None:
    return store.get(key) if store.check([key]) else None


@dataclass(frozen=True)
class _Vote:
    """What this rank handed at the vote of update ``frontier``: the packet's digest, and what may change after."""

    frontier: int
    epoch: int
    states: dict[str, str]  # name -> digest of its encoded state at the vote
    rng: tuple[Any, ...]
    buffers: str
    packet: str


@dataclass(frozen=True)
class _Commit:
    """What changed on this rank between its vote of update ``frontier`` and its commit."""

    frontier: int
    states: dict[str, Any]  # the Statefuls changed after the vote: name -> encoded state at the commit
    other: tuple[str, ...]  # "RNG states", "buffers", "position" where they changed after the vote


class BuddyRing:
    """One rank's side of the ring: ``Run`` calls :meth:`at_vote` when the vote decided an update commits and
    :meth:`after_commit` once it committed; the survivors' lead calls :meth:`resolve` at a heal."""

    def __init__(self, store: Any, model: torch.nn.Module, rank: int, statefuls: Mapping[str, Any]) -> None:
        self._store, self._model, self._rank, self._statefuls = store, model, rank, statefuls
        self._vote: _Vote | None = None
        self._commit: _Commit | None = None
        self.handed = 0

    def _encoded(self) -> dict[str, Any]:
        return {n: appstate.encode(o.state_dict(), f"state[{n!r}]") for n, o in self._statefuls.items()}

    def _pack(self, step: int, epoch: int, states: Mapping[str, Any]) -> RankPacket:
        data = encoded_data_state({"step": step, "epoch": epoch}, states)
        return pack_rank_state(self._model, rank=self._rank, frontier=step, encoded_data=data)

    def at_vote(self, step: int, epoch: int) -> None:
        """The vote decided update ``step`` commits: hand the packet of the state it will commit."""
        states = self._encoded()
        packet = self._pack(step, epoch, states)
        self._store.set(slot_key(self._rank, step), encode_packet(packet))
        self._vote = _Vote(step, epoch, {n: part_digest(e) for n, e in states.items()}, appstate.rng_snapshot(),
                           packet.buffers, packet.digest)
        self.handed += 1

    def after_commit(self, step: int, epoch: int) -> None:
        """Update ``step`` committed: hand what changed since the vote (a whole packet where more than the
        ``Stateful`` states did, or where no vote's packet of ``step`` was handed)."""
        vote, states = self._vote, self._encoded()
        full: RankPacket | None = None
        if vote is None or vote.frontier != step:
            full, moved, other = self._pack(step, epoch, states), {}, ()
        else:
            moved = {n: e for n, e in states.items() if part_digest(e) != vote.states.get(n)}
            other = tuple(what for what, changed in (
                ("RNG states", not appstate.rng_equal(vote.rng, appstate.rng_snapshot())),
                ("buffers", buffers_digest(self._model) != vote.buffers),
                ("position", epoch != vote.epoch)) if changed)
            if other:
                full = self._pack(step, epoch, states)
        head = {"rank": self._rank, "frontier": step, "base": vote.packet if vote is not None else None,
                "states": moved, "full": full.digest if full is not None else None}
        self._store.set(commit_key(self._rank), _frame(head, full.blob if full is not None else b""))
        self._commit = _Commit(step, moved, other)

    def resolve(self, rank: int, frontier: int) -> tuple[RankPacket | None, str]:
        """Rank ``rank``'s packet of its state at committed update ``frontier`` (see the module docstring), or
        ``(None, why it is not known)``; this rank stands witness for what changes after the vote."""
        try:
            return self._resolve(rank, frontier)
        except (ValueError, KeyError, TypeError, HealError) as exc:
            return None, f"rank {rank}'s per-rank packet is unusable: {type(exc).__name__}: {exc}"

    def _resolve(self, rank: int, frontier: int) -> tuple[RankPacket | None, str]:
        raw = _fetch(self._store, commit_key(rank))
        slot = _fetch(self._store, slot_key(rank, frontier))
        base = decode_packet(slot) if slot is not None else None
        if base is not None and (base.rank, base.frontier) != (rank, frontier):
            base = None
        if raw is not None:
            head, body = _unframe(raw)
            if int(head["frontier"]) == frontier and int(head["rank"]) == rank:
                if head.get("full"):
                    read_packet(body, expect_digest=head["full"])
                    return RankPacket(rank, frontier, body, str(head["full"])), "packed at its commit"
                if base is None or base.digest != head.get("base"):
                    return None, f"rank {rank}'s packet of the vote of update {frontier} is not in the store"
                return with_states(base, head.get("states") or {}), "its vote's, with its commit's changes"
        if base is None:
            return None, f"the store holds no per-rank packet of rank {rank} at update {frontier}"
        return self._witnessed(base, rank, frontier)

    def _witnessed(self, base: RankPacket, rank: int, frontier: int) -> tuple[RankPacket | None, str]:
        """``rank`` voted for ``frontier`` and was lost before its commit: its vote's packet, completed with what
        this rank (which committed ``frontier``) saw change after its own vote."""
        vote, commit, me = self._vote, self._commit, self._rank
        lost = f"rank {rank} was lost between the vote and the commit of update {frontier}"
        if vote is None or commit is None or vote.frontier != frontier or commit.frontier != frontier:
            return None, f"{lost}, and rank {me} holds no record of that update to stand witness"
        if commit.other:
            return None, (f"{lost}, and its {', '.join(commit.other)} change after the vote (rank {me}'s did): "
                          f"their values at the commit are not known")
        held = encoded_states(read_packet(base.blob, expect_digest=base.digest)[0].get("data"))
        differ = sorted(n for n in commit.states if n not in held or part_digest(held[n]) != vote.states.get(n))
        if differ:
            return None, (f"{lost}, and its state {', '.join(map(repr, differ))} changes after the vote and held "
                          f"another value than rank {me}'s at the vote (not replica-identical): its value at the "
                          f"commit is not known")
        taken = f"; {', '.join(map(repr, sorted(commit.states)))} as rank {me}'s" if commit.states else ""
        return with_states(base, commit.states), f"its vote's{taken}"


class VoteLessRing(BuddyRing):
    """Test-only (``ACCELPACT_TEST_HEAL_FAULT=skip_vote_packet``): a packet at each commit only, as before the
    two phases, so that a rank lost in the optimizer step leaves no packet of the update the survivors commit."""

    def at_vote(self, step: int, epoch: int) -> None:
        return None


class NoRing:
    """A job without spare nodes: nothing handed."""

    handed = 0

    def at_vote(self, step: int, epoch: int) -> None:
        return None

    def after_commit(self, step: int, epoch: int) -> None:
        return None

    def resolve(self, rank: int, frontier: int) -> tuple[RankPacket | None, str]:
        return None, "this job hands no per-rank packets (no spare nodes)"


def ring_for(spare_nodes: int, store: Any, model: torch.nn.Module, rank: int, statefuls: Mapping[str, Any],
             heal_fault: str | None = None) -> BuddyRing | NoRing:
    """The ring of a rank: a :class:`BuddyRing` on the job's ``store`` when the job has spare nodes, else a
    :class:`NoRing` (as when the rank has no store: a test's runtime); ``heal_fault`` (a test's) may pick
    :class:`VoteLessRing`."""
    if spare_nodes > 0 and store is not None:
        ring = VoteLessRing if heal_fault == "skip_vote_packet" else BuddyRing
        return ring(store, model, rank, statefuls)
    return NoRing()


def post_resolved(store: Any, generation: int, packets: Mapping[int, RankPacket]) -> None:
    """The lead, before its decision: the packets it resolved, for the sources of the heal of ``generation``."""
    for rank, packet in packets.items():
        store.set(resolved_key(generation, rank), encode_packet(packet))


def collect(store: Any, ranks: list[int], generation: int, into: BuddyCopies | None = None) -> BuddyCopies:
    """The packets the lead resolved for the heal of ``generation``, kept (digest checked) in ``into`` (a new one
    if None).  A rank with none, or one that fails its digest, is left out: the certificate then names ``packet``."""
    copies = into if into is not None else BuddyCopies()
    for rank in ranks:
        raw = _fetch(store, resolved_key(generation, rank))
        if raw is None:
            log.warning("the store holds no resolved per-rank packet of rank %d", rank)
            continue
        try:
            p = decode_packet(raw)
            copies.keep(p.rank, p.frontier, p.blob, p.digest)
        except (ValueError, KeyError, HealError) as exc:  # HealError: its digest does not match its bytes
            log.warning("the per-rank packet of rank %d is unusable: %s", rank, exc)
    return copies
