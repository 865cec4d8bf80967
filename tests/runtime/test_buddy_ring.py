"""The buddy ring's packets through a store: handed at a commit, read back digest-checked, off without spares."""

from __future__ import annotations

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
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def test_a_packet_handed_at_a_commit_comes_back_with_its_data_state():
    store, model, counter = _Store(), _model(), _Counter()
    counter.n = 7
    ring = buddy_ring.ring_for(1, store, model, 3, {"data": counter})
    ring.after_commit(5, 1)
    ring.after_commit(6, 1)  # the newest replaces the older one
    assert ring.handed == 2 and list(store.kv) == ["heal/packet/3"]
    copies = buddy_ring.collect(store, [3, 2])  # rank 2 handed nothing: left out
    got = copies.latest(3)
    assert got is not None and got.frontier == 6 and copies.latest(2) is None
    data = apply_rank_state(_model(), got.blob, rank=3, frontier=6, expect_digest=got.digest)
    assert data["run"] == {"step": 6, "epoch": 1}
    fresh = _Counter()
    assert buddy_ring.restore_data_state(data, {"data": fresh, "scheduler": _Counter()}) == ["scheduler"]
    assert fresh.n == 7


def test_negative_control_a_corrupted_packet_is_left_out():
    store, model = _Store(), _model()
    buddy_ring.hand_packet(store, model, rank=1, frontier=2, data={})
    store.kv["heal/packet/1"] = store.kv["heal/packet/1"][:-1] + b"\x00"
    assert buddy_ring.collect(store, [1]).latest(1) is None


def test_without_spare_nodes_nothing_is_handed():
    store = _Store()
    ring = buddy_ring.ring_for(0, store, _model(), 0, {})
    ring.after_commit(1, 0)
    assert store.kv == {} and ring.handed == 0
    assert isinstance(buddy_ring.ring_for(1, None, _model(), 0, {}), buddy_ring.NoRing)
