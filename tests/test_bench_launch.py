"""The launch benchmark's reduction, on records made up here (pure: nothing runs).

An update's segments come from the timing hook's three marks per optimizer step; the per-update goal is met only
where every pair of runs agrees, since this machine's load moves one run's wall time by more than the goal's 1%;
the plain baseline runs the same 2 x 2 mesh as the protected job (two torchrun agents), both through the hook.
"""

from __future__ import annotations

import pytest

from benchmarks.parts import launch


def _marks(n: int, update: float, vote: float, cpu: float, others: float) -> dict:
    """``n`` steps, one every ``update`` s; each step's pre-hooks take ``vote`` s, the step 1 ms."""
    pre, mid, post = [], [], []
    for k in range(n):
        end = 1.0 + k * update
        wall = (end - 0.001 - vote, end - 0.001, end)
        thread = (k * cpu + cpu - 0.0005, k * cpu + cpu - 0.0004, k * cpu + cpu)
        proc = [t + k * others for t in thread]
        pre.append([wall[0], thread[0], proc[0]])
        mid.append([wall[1], thread[1], proc[1]])
        post.append([wall[2], thread[2], proc[2]])
    return {"rank": 0, "pre": pre, "mid": mid, "post": post}


def test_an_updates_segments_from_the_hooks_marks():
    seg = launch.segments(_marks(10, 0.1, 0.006, 0.02, 0.003), warmup=3)
    assert len(seg["update"]) == 7  # updates 4..10: the warm-up's left out
    assert seg["update"] == pytest.approx([0.1] * 7)
    assert seg["hooks"] == pytest.approx([0.006] * 7) and seg["step"] == pytest.approx([0.001] * 7)
    assert seg["outside"] == pytest.approx([0.1 - 0.007] * 7)
    assert seg["update_cpu"] == pytest.approx([0.02] * 7) and seg["others_cpu"] == pytest.approx([0.003] * 7)
    broken = _marks(10, 0.1, 0.006, 0.02, 0.003)
    broken["mid"].pop()  # an update whose vote discarded it: its step never ran
    assert launch.segments(broken, warmup=3) is None


def _result(ratios: list[float]) -> dict:
    runs = []
    for t, r in enumerate(ratios):
        for arm, ms in (("plain", 100.0), ("protected", 100.0 * r)):
            pooled = {k: 1.0 for k in launch.SEGMENTS}
            pooled["update"] = ms
            runs.append({"trial": t, "arm": arm, "name": f"t{t}-{arm}", "pooled": pooled,
                         "per_rank": {str(k): {"update": ms} for k in range(4)}})
    return {"runs": runs, "arms": ["plain", "protected"], "example": "hydra", "diffs": launch.example_diffs()}


@pytest.mark.parametrize("ratios, verdict", [([1.00, 1.005, 0.99], "met"), ([1.05, 1.2, 1.02], "not met"),
                                             ([0.9, 1.1, 1.2], "not met"), ([0.8, 1.3, 0.95], "not decided")])
def test_the_per_update_goal_is_met_only_where_every_pair_agrees(ratios, verdict):
    """Negative control: the median alone (0.95 in the last case) would call the goal met."""
    res = _result(ratios)
    assert launch.verdict(res)[0] == verdict
    assert launch.figures_of(res)["ratio"]["n"] == len(ratios)
    assert verdict in launch.readme_bullet(res) and launch.goal_rows(res)[1][1] == verdict


def test_the_plain_baseline_runs_the_protected_jobs_mesh_through_the_same_hook(tmp_path):
    plain = launch.commands("plain", "hydra", 20, tmp_path, 29500)
    protected = launch.commands("protected", "hydra", 20, tmp_path, 29500)
    assert len(plain) == 2 and len(protected) == 1  # two torchrun agents; one accelpact-run
    for n, cmd in enumerate(plain):
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
        assert cmd[cmd.index("--node-rank") + 1] == str(n) and cmd[-2].endswith("train_hydra_plain.py")
    (cmd,) = protected
    assert "accelpact_slurm.cli.run" in cmd and cmd[-2].endswith("train_hydra.py") and cmd[-1] == "steps=20"
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    for c in (*plain, cmd):
        assert c[c.index("-m", c.index("--nproc-per-node")) + 1] == "benchmarks.parts.launch_timer"
