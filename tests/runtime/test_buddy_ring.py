"""The buddy ring's two phases through a store: the packet of the vote, the commit's changes, and the packet of a
rank at an update (its own commit's, or completed by a witness when it was lost in the optimizer step), exact or
refused with the reason; digest-checked; off without spares."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from accelpact_slurm.runtime.state import buddy_ring
from accelpact_slurm.runtime.state.rank_packet import apply_rank_state


class _Store:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key, value):
        self.kv[key] = bytes(value)

    def get(self, key):
        return self.kv[key]

    def check(self, keys):
        return all(k in self.kv for k in keys)


class _Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


class _Rank:
    """One rank's model, Statefuls and ring on a shared store: ``data`` is per rank (its position), ``scheduler``
    the same on every rank and stepped after the optimizer, as an LR scheduler is."""

    def __init__(self, store, rank: int, *, fault: str | None = None, spares: int = 1) -> None:
        self.rank, self.model = rank, _model()
        self.data, self.sched = _Counter(100 * rank), _Counter()
        self.ring = buddy_ring.ring_for(spares, store, self.model, rank, {"data": self.data, "scheduler": self.sched},
                                        heal_fault=fault)

    def update(self, step: int, *, lost_in_step: bool = False, draw_after_vote: bool = False) -> None:
        self.data.n += 1  # the next batch, taken before the update
        with torch.no_grad():
            self.model[1].running_mean += 1.0  # the forward moves its statistics
        torch.rand(3)  # dropout
        self.ring.at_vote(step, 0)
        if lost_in_step:
            return
        if draw_after_vote:
            random.random()
        self.sched.n += 1  # sched.step() after opt.step()
        self.ring.after_commit(step, 0)


def _applied(packet, rank: int, frontier: int) -> dict:
    return apply_rank_state(_model(), packet.blob, rank=rank, frontier=frontier, expect_digest=packet.digest)


def test_a_committed_update_resolves_to_its_vote_packet_with_what_changed_after_the_vote():
    store = _Store()
    a = _Rank(store, 3)
    for step in (5, 6):
        a.update(step)
    assert a.ring.handed == 2
    assert sorted(store.kv) == ["heal/commit/3", "heal/packet/3/0", "heal/packet/3/1"]
    packet, how = _Rank(store, 1).ring.resolve(3, 6)
    assert packet is not None and packet.frontier == 6, how
    data = _applied(packet, 3, 6)
    assert data["run"] == {"step": 6, "epoch": 0} and data["state"] == {"data": {"n": 302}, "scheduler": {"n": 2}}
    fresh, other = _Counter(), _Counter()
    assert buddy_ring.restore_data_state(data, {"data": fresh, "scheduler": other, "extra": _Counter()}) == ["extra"]
    assert (fresh.n, other.n) == (302, 2)
    # the vote of the next update does not take this one's packet away (two slots)
    a.update(7, lost_in_step=True)
    assert _Rank(store, 1).ring.resolve(3, 6)[0].digest == packet.digest


def test_a_rank_lost_in_the_optimizer_step_resolves_through_a_witness_that_committed_the_update():
    """Rank 3 voted for update 6 and was lost in its step; rank 1 committed it.  The scheduler stepped after the
    vote on rank 1 and held the same value as rank 3's at the vote: rank 1's value at the commit is rank 3's."""
    store = _Store()
    dead, witness = _Rank(store, 3), _Rank(store, 1)
    for step in (5, 6):
        witness.update(step)
        dead.update(step, lost_in_step=step == 6)
    packet, how = witness.ring.resolve(3, 6)
    assert packet is not None, how
    assert "'scheduler' as rank 1's" in how
    data = _applied(packet, 3, 6)
    assert data["state"] == {"data": {"n": 302}, "scheduler": {"n": 2}}  # the dead rank's position, the step's LR
    # what the uninterrupted rank 3 would have handed at its commit
    alive = _Rank(_Store(), 3)
    for step in (5, 6):
        alive.update(step)
    assert _applied(alive.ring.resolve(3, 6)[0], 3, 6)["state"] == data["state"]


def test_refused_where_the_state_changed_after_the_vote_is_not_known():
    """A Stateful stepped after the vote whose value differs between the lost rank and the witness, or random
    numbers drawn after the vote: the value at the commit is not known, so there is no packet (no heal)."""
    store = _Store()
    dead, witness = _Rank(store, 3), _Rank(store, 1)
    dead.sched.n = 7  # not replica-identical
    for step in (5, 6):
        witness.update(step)
        dead.update(step, lost_in_step=step == 6)
    packet, why = witness.ring.resolve(3, 6)
    assert packet is None and "'scheduler'" in why and "not replica-identical" in why
    store = _Store()
    dead, witness = _Rank(store, 3), _Rank(store, 1)
    for step in (5, 6):
        witness.update(step, draw_after_vote=True)
        dead.update(step, lost_in_step=step == 6)
    packet, why = witness.ring.resolve(3, 6)
    assert packet is None and "RNG states change after the vote" in why
    assert witness.ring.resolve(3, 5)[0] is not None  # committed by rank 3: its own record says what changed
    packet, why = witness.ring.resolve(3, 4)
    assert packet is None and "no per-rank packet of rank 3 at update 4" in why


def test_negative_control_packets_at_the_commit_only_leave_no_packet_of_an_update_lost_in_its_step():
    store = _Store()
    dead, witness = _Rank(store, 3, fault="skip_vote_packet"), _Rank(store, 1, fault="skip_vote_packet")
    assert isinstance(dead.ring, buddy_ring.VoteLessRing)
    for step in (5, 6):
        witness.update(step)
        dead.update(step, lost_in_step=step == 6)
    packet, why = witness.ring.resolve(3, 6)
    assert packet is None and "no per-rank packet of rank 3 at update 6" in why
    assert _applied(witness.ring.resolve(3, 5)[0], 3, 5)["state"]["scheduler"] == {"n": 1}  # the boundary: as before


def test_resolved_packets_reach_the_sources_digest_checked():
    store = _Store()
    a = _Rank(store, 2)
    a.update(1)
    packet, _ = _Rank(store, 0).ring.resolve(2, 1)
    buddy_ring.post_resolved(store, 1, {2: packet})
    assert buddy_ring.collect(store, [2, 3], 1).latest(2).digest == packet.digest  # rank 3: none, left out
    key = buddy_ring.resolved_key(1, 2)
    store.kv[key] = store.kv[key][:-1] + bytes([store.kv[key][-1] ^ 1])
    assert buddy_ring.collect(store, [2], 1).latest(2) is None
    store.kv[buddy_ring.slot_key(2, 1)] = b"\x00\x00\x00\x02{}"
    got, why = _Rank(store, 0).ring.resolve(2, 1)
    assert got is None and "unusable" in why


def test_without_spare_nodes_nothing_is_handed():
    store = _Store()
    r = _Rank(store, 0, spares=0)
    r.update(1)
    assert store.kv == {} and r.ring.handed == 0
    assert isinstance(buddy_ring.ring_for(1, None, _model(), 0, {}), buddy_ring.NoRing)
    with pytest.raises(ValueError):
        buddy_ring.decode_packet(b"\x00\x00\x00\x09{}")
