"""The buddy ring of a job with spare nodes: every rank's per-rank packet handed over at every committed update.

A spare that takes a dead rank's place gets the rank's shard from a live replica, but RNG states, per-rank
buffers and the data position are held by that rank only (:mod:`.rank_packet`).  So at every committed update
each rank packs them (a few KB) and hands the packet to the job's store under ``heal/packet/<rank>`` (one
``set``, no wait on anyone); at a heal the source of each dead rank (:meth:`HealPlan.source_of
<accelpact_slurm.repair.heal.HealPlan.source_of>`) reads it back into its :class:`~.rank_packet.BuddyCopies`
(:func:`collect`), whose digest check the certificate then relies on.

The job's store lives beside rank 0 (node 0): a packet there survives the loss of any other node, which is what
a heal covers today (node 0's loss, and with it the store's, is not healed; ``docs/heal.md``).  Only a job with
``topology.spare_nodes > 0`` hands packets at all (:func:`ring_for` gives the others a ring that does nothing).

What a packet's ``data_state`` holds (:func:`data_state`): the frontier, the pass over the data, and every
``Stateful`` the script gave ``job.protect`` (its loader's position, its scheduler), as ``state_dict()``\\ s.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

import torch

from accelpact_slurm.core.errors import HealError
from accelpact_slurm.runtime.state.rank_packet import BuddyCopies, RankPacket, pack_rank_state

log = logging.getLogger(__name__)

_LEN = 4


def packet_key(rank: int) -> str:
    return f"heal/packet/{rank}"


def data_state(step: int, epoch: int, statefuls: Mapping[str, Any]) -> dict[str, Any]:
    """The data position and the ``Stateful`` states of one rank at committed update ``step``."""
    return {"run": {"step": step, "epoch": epoch}, "state": {n: o.state_dict() for n, o in statefuls.items()}}


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


def encode_packet(packet: RankPacket) -> bytes:
    head = json.dumps({"rank": packet.rank, "frontier": packet.frontier, "digest": packet.digest}).encode()
    return len(head).to_bytes(_LEN, "big") + head + packet.blob


def decode_packet(raw: bytes) -> RankPacket:
    """Raises ValueError on a value that is no encoded packet."""
    n = int.from_bytes(raw[:_LEN], "big")
    if n <= 0 or n > len(raw) - _LEN:
        raise ValueError("not an encoded rank packet")
    head = json.loads(raw[_LEN:_LEN + n])
    return RankPacket(int(head["rank"]), int(head["frontier"]), raw[_LEN + n:], str(head["digest"]))


def hand_packet(store: Any, model: torch.nn.Module, *, rank: int, frontier: int, data: Mapping[str, Any]) -> int:
    """Pack this rank's per-rank state at committed update ``frontier`` and hand it to the store; its bytes."""
    packet = pack_rank_state(model, rank=rank, frontier=frontier, data_state=data)
    raw = encode_packet(packet)
    store.set(packet_key(rank), raw)
    return len(raw)


def collect(store: Any, ranks: list[int], into: BuddyCopies | None = None) -> BuddyCopies:
    """The newest packets of ``ranks`` the store holds, kept (digest checked) in ``into`` (a new one if None).  A
    rank with no packet, or one that fails its digest, is left out: the certificate then names ``packet``."""
    copies = into if into is not None else BuddyCopies()
    for rank in ranks:
        if not store.check([packet_key(rank)]):
            log.warning("the store holds no per-rank packet of rank %d", rank)
            continue
        try:
            p = decode_packet(store.get(packet_key(rank)))
            copies.keep(p.rank, p.frontier, p.blob, p.digest)
        except (ValueError, KeyError, HealError) as exc:  # HealError: its digest does not match its bytes
            log.warning("the per-rank packet of rank %d is unusable: %s", rank, exc)
    return copies


class BuddyRing:
    """One rank's side of the ring, called by ``Run`` at every committed update."""

    def __init__(self, store: Any, model: torch.nn.Module, rank: int, statefuls: Mapping[str, Any]) -> None:
        self._store, self._model, self._rank, self._statefuls = store, model, rank, statefuls
        self.handed = 0

    def after_commit(self, step: int, epoch: int) -> None:
        hand_packet(self._store, self._model, rank=self._rank, frontier=step,
                    data=data_state(step, epoch, self._statefuls))
        self.handed += 1


class NoRing:
    """A job without spare nodes: nothing handed."""

    handed = 0

    def after_commit(self, step: int, epoch: int) -> None:
        return None


def ring_for(spare_nodes: int, store: Any, model: torch.nn.Module, rank: int,
             statefuls: Mapping[str, Any]) -> BuddyRing | NoRing:
    """The ring of a rank: a :class:`BuddyRing` on the job's ``store`` when the job has spare nodes, else a
    :class:`NoRing` (as when the rank has no store: a test's runtime)."""
    if spare_nodes > 0 and store is not None:
        return BuddyRing(store, model, rank, statefuls)
    return NoRing()
