"""The footprint predicted at ``job.protect``: bytes per part from the model's local shards and the optimizer's
states, summed per host and memory cgroup, a shortfall where the sum exceeds what is left there.  The warning of a
real job in a real memory cgroup, before the kernel's OOM killer ends it, is tested with the OOM kill
(tests/e2e/test_oom.py)."""

from __future__ import annotations

import torch

from accelpact_slurm.runtime.job import footprint


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_the_prediction_counts_gradients_optimizer_staging_and_the_proof_from_the_local_bytes():
    m = model()
    w = sum(p.numel() for p in m.parameters()) * 4
    got = footprint.predict(m, torch.optim.AdamW(m.parameters()), snapshots=True)
    assert got["weights"] == w and got["optimizer_states"] == 2 and got["states_known"]
    assert got["parts"] == {"gradients": w, "optimizer": 2 * w, "staging": 3 * w, "proof": 3 * w}
    assert got["adds"] == 9 * w
    bf16 = model().to(torch.bfloat16)  # the element size as the model has it
    assert footprint.predict(bf16, torch.optim.SGD(bf16.parameters(), lr=0.1), snapshots=False) == {
        "weights": w // 2, "optimizer_states": 0, "states_known": True, "parts": {"gradients": w // 2, "optimizer": 0},
        "adds": w // 2}


def test_optimizer_states_from_the_table_from_its_options_and_from_its_state_once_it_stepped():
    m = model()
    assert footprint.optimizer_states(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) == (1, True)
    assert footprint.optimizer_states(torch.optim.Adam(m.parameters(), amsgrad=True)) == (3, True)

    class Mine(torch.optim.SGD):
        pass

    assert footprint.optimizer_states(Mine(m.parameters(), lr=0.1)) == (footprint.UNKNOWN_STATES, False)
    opt = torch.optim.AdamW(m.parameters(), amsgrad=True)
    m(torch.ones(2, 16)).sum().backward()
    opt.step()  # exp_avg, exp_avg_sq, max_exp_avg_sq; "step" is a scalar, not counted
    assert footprint.optimizer_states(opt) == (3, True)


def record(rank, host, adds, available, cgroup=None, left=None):
    return {"rank": rank, "host": host, "adds": adds, "weights": adds // 9, "available": available,
            "cgroup": cgroup, "cgroup_left": left}


def test_ranks_that_share_a_host_and_a_cgroup_are_summed_against_the_smaller_headroom():
    gib = 2**30
    recs = [record(0, "a", gib, 3 * gib), record(1, "a", gib, 3 * gib),  # 2 GiB of 3: fits
            record(2, "b", gib, 8 * gib, "/cg/b", gib), record(3, "b", gib, 8 * gib, "/cg/b", gib),  # 2 of 1: short
            record(4, "c", gib, None)]  # nothing read: never a shortfall
    groups = footprint.by_host(recs)
    assert [(g["host"], g["cgroup"], g["ranks"], g["adds"], g["left"]) for g in groups] == [
        ("a", None, [0, 1], 2 * gib, 3 * gib), ("b", "/cg/b", [2, 3], 2 * gib, gib), ("c", None, [4], gib, None)]
    short = footprint.shortfalls(groups)
    assert [g["ranks"] for g in short] == [[2, 3]]
    text = footprint.describe(short[0])
    assert "b (memory cgroup /cg/b): ranks [2, 3] will add about 2.00 GiB" in text and "only 1.00 GiB" in text
    assert "docs/checkpoints.md#memory" in text


def test_the_headroom_of_this_host_is_read():
    got = footprint.headroom()
    assert got["available"] and got["available"] > 0 and got["host"]
