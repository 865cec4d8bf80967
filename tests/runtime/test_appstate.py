"""The per-rank part of a snapshot on any allocation: who takes which saved state, and the RNG rule for new ranks."""

from __future__ import annotations

import random

import torch

from accelpact_slurm.runtime.state import appstate


def _saved(world):
    """What a snapshot of ``world`` ranks holds per rank: each rank's RNG and a Stateful naming its rank."""
    out = {}
    for r in range(world):
        appstate.seed_all(100 + r)
        out[str(r)] = {"rng": appstate.rng_state(), "state": {"loader": appstate.encode({"rank": r}, "loader")}}
    return out


def test_a_rank_that_existed_takes_its_own_state_and_rng():
    ranks = _saved(4)
    state, rng = appstate.rank_state(ranks, 2, seed=7, frontier=10)
    assert state is ranks["2"] and rng is ranks["2"]["rng"]


def test_a_new_rank_takes_a_donors_statefuls_and_a_fresh_documented_rng():
    ranks = _saved(2)
    state, rng = appstate.rank_state(ranks, 3, seed=7, frontier=10)
    assert appstate.decode(state["state"]["loader"]) == {"rank": 1}  # rank 3 % 2 saved ranks
    appstate.set_rng_state(rng)
    got = (torch.rand(3), random.random())
    appstate.seed_all(appstate.new_rank_seed(7, 3, 10))
    assert torch.equal(got[0], torch.rand(3)) and got[1] == random.random()  # the rule, reproducible
    for r in ("0", "1"):  # and not any existing rank's stream
        appstate.set_rng_state(ranks[r]["rng"])
        assert not torch.equal(got[0], torch.rand(3))
    _, other = appstate.rank_state(ranks, 2, seed=7, frontier=10)
    appstate.set_rng_state(other)
    assert not torch.equal(got[0], torch.rand(3))  # two new ranks draw distinct streams


def test_only_rank_0_sends_the_loss_history_in_a_snapshots_extra_state():
    """The extra-state round of a snapshot: a non-zero rank's part holds no loss history (O(1) in the steps), rank
    0's holds it, and the snapshot's ``run`` (rank 0's, as the snapshot client keeps it) is what a load reads."""
    import json
    from types import SimpleNamespace

    from accelpact_slurm.runtime.job.api import Run

    losses = [2.5 - 0.001 * i for i in range(5000)] + [None]

    def part(rank, history):
        run = SimpleNamespace(job=SimpleNamespace(rank=rank), step=len(history), epoch=1, losses=history,
                              _statefuls={}, _forward=SimpleNamespace(per_rank=dict))
        return Run._extra(run)

    extras = [part(r, losses) for r in range(4)]
    for r in (1, 2, 3):
        assert "losses" not in extras[r]["run"] and extras[r]["run"] == {"step": len(losses), "epoch": 1}
        assert len(json.dumps(extras[r])) < len(json.dumps(extras[0])) - 50_000
    doc = {"run": extras[0]["run"]}  # ckpt_service.client.SnapshotClient._meta: extras[0]'s run
    assert doc["run"]["losses"] == losses and doc["run"]["step"] == len(losses)


def test_lists_of_ints_encode_as_element_by_element_and_round_trip():
    """An RNG state's long lists of ints take a short way; the form is the one element by element gives."""
    value = {"keys": list(range(5)), "t": (1, 2), "mixed": [1, True, 2.5], "state": random.getstate()}
    enc = appstate.encode(value, "v")
    assert enc["__dict__"]["s:keys"] == {"__list__": [0, 1, 2, 3, 4], "tuple": False}
    assert enc["__dict__"]["s:t"] == {"__list__": [1, 2], "tuple": True}
    assert enc["__dict__"]["s:mixed"]["__list__"] == [1, True, 2.5]
    assert appstate.decode(enc) == value


def test_rng_equal_tells_whether_a_random_number_was_drawn():
    before = appstate.rng_snapshot()
    assert appstate.rng_equal(before, appstate.rng_snapshot())
    for draw in (lambda: torch.rand(1), random.random, lambda: __import__("numpy").random.rand()):
        draw()
        after = appstate.rng_snapshot()
        assert not appstate.rng_equal(before, after)
        before = after
