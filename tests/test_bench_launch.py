"""The launch benchmark's reduction, on records made up here (pure: nothing runs).

An update's segments come from the timing hook's three marks per optimizer step; the per-update goal is met only
where every pair of runs agrees, since this machine's load moves one run's wall time by more than the goal's 1%;
the plain baseline runs the same mesh as the protected job (one torchrun agent per node), both through the hook.
Each case (tiny-2x2, wide-2x1) has its own pairs, verdict, rows and goal line; a result from before the cases reads
as the tiny-2x2 case.
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


def _runs(ratios: list[float], case: str | None, ranks: int = 4) -> list[dict]:
    runs = []
    for t, r in enumerate(ratios):
        for arm, ms in (("plain", 100.0), ("protected", 100.0 * r)):
            pooled = {k: 1.0 for k in launch.SEGMENTS}
            pooled["update"] = ms
            run = {"trial": t, "arm": arm, "name": f"t{t}-{arm}", "pooled": pooled,
                   "per_rank": {str(k): {"update": ms} for k in range(ranks)}}
            runs.append(run if case is None else {**run, "case": case})
    return runs


def _result(ratios: list[float]) -> dict:
    """A raw result from before the cases (2026-12-07's form): no ``cases``, its runs without a case."""
    return {"runs": _runs(ratios, None), "arms": ["plain", "protected"], "example": "hydra",
            "diffs": launch.example_diffs()}


def _two_cases(tiny: list[float], wide: list[float]) -> dict:
    cases = {c.name: launch.case_info(c, ["plain", "protected"], "hydra") for c in launch.CASES.values()}
    return {"runs": _runs(tiny, "tiny-2x2") + _runs(wide, "wide-2x1", ranks=2), "cases": cases, "example": "hydra",
            "diffs": launch.example_diffs(), "steps": 40, "warmup": 5, "trials": len(tiny)}


@pytest.mark.parametrize("ratios, verdict", [([1.00, 1.005, 0.99], "met"), ([1.05, 1.2, 1.02], "not met"),
                                             ([0.9, 1.1, 1.2], "not met"), ([0.8, 1.3, 0.95], "not decided")])
def test_the_per_update_goal_is_met_only_where_every_pair_agrees(ratios, verdict):
    """Negative control: the median alone (0.95 in the last case) would call the goal met."""
    res = _result(ratios)
    cv = launch.case_result(res, "tiny-2x2")
    assert launch.verdict(cv)[0] == verdict
    assert launch.figures_of(cv)["ratio"]["n"] == len(ratios)
    assert verdict in launch.readme_bullet(res) and launch.goal_rows(res)[1][1] == verdict


def test_a_result_from_before_the_cases_reads_as_the_tiny_case():
    """The committed 2026-12-07 result has no cases: all of it is tiny-2x2, 2 x 2, its four ranks in the table."""
    res = _result([1.1, 1.2])
    assert launch.case_names(res) == ["tiny-2x2"]
    cv = launch.case_result(res, "tiny-2x2")
    assert (cv["nodes"], cv["per_node"], cv["arms"], len(cv["runs"])) == (2, 2, ["plain", "protected"], 4)
    text = launch.markdown(res)
    assert "**Case `tiny-2x2`**: 2 nodes x 2 ranks per node" in text and "| 100.0, 100.0, 100.0, 100.0 |" in text
    assert "wide-2x1" not in text.split("Per-update cost")[1].split("**Case")[0]
    assert [g for g, _v, _m in launch.goal_rows(res)][1].startswith("tiny-2x2: ")


def test_each_case_has_its_own_pairs_rows_and_verdict():
    """A second case: its own pairs (its runs only), rows, goal line and clause, each with its own verdict."""
    res = _two_cases([1.00, 1.005, 0.99], [1.05, 1.2, 1.02])
    tiny, wide = (launch.case_result(res, c) for c in ("tiny-2x2", "wide-2x1"))
    assert [launch.verdict(tiny)[0], launch.verdict(wide)[0]] == ["met", "not met"]
    assert launch.figures_of(wide)["ratio"]["median"] == pytest.approx(1.05)
    goals = launch.goal_rows(res)
    assert [(g.split(":")[0], v) for g, v, _m in goals[1:]] == [("tiny-2x2", "met"), ("wide-2x1", "not met")]
    assert "same 2 x 1 mesh" in goals[2][0] and "same 2 x 2 mesh" in goals[1][0]
    rows = launch.summary_rows(res)
    per_update = [r for r in rows if "per-update time" in r["what"]]
    assert [r["what"].split(":")[0] for r in per_update] == ["tiny-2x2", "wide-2x1"]
    assert per_update[1]["ratio"] == pytest.approx(1.05) and per_update[1]["n"] == 3
    assert "model.width=" in per_update[1]["note"] and "the example's defaults" in per_update[0]["note"]
    bullet = launch.readme_bullet(res)
    assert bullet.count("goal ≤ 1.01x met") == 1 and bullet.count("goal ≤ 1.01x not met") == 1
    assert bullet.index("`tiny-2x2` (2 x 2") < bullet.index("`wide-2x1` (2 x 1")
    text = launch.markdown(res)
    assert "**`wide-2x1`, protected / plain, per update: 1.05 (1.02–1.20)x** over 3 pairs (goal ≤ 1.01x: not met)" \
        in text
    wide_block = text.split("**Case `wide-2x1`**")[1]
    assert "| torchrun --nnodes 2 --nproc-per-node 1 (2 agents), the plain script | 100.0 (100.0–100.0) | " \
        "100.0, 100.0 |" in wide_block  # its two ranks, not four
    assert "`OMP_NUM_THREADS=1` for every run" in wide_block


def test_the_plain_baseline_runs_the_protected_jobs_mesh_through_the_same_hook(tmp_path):
    for case, per_node in (("tiny-2x2", "2"), ("wide-2x1", "1")):
        c = launch.CASES[case]
        plain = launch.commands("plain", "hydra", 20, tmp_path, 29500, c)
        protected = launch.commands("protected", "hydra", 20, tmp_path, 29500, c)
        assert len(plain) == 2 and len(protected) == 1  # two torchrun agents; one accelpact-run
        for n, cmd in enumerate(plain):
            assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == per_node
            assert cmd[cmd.index("--node-rank") + 1] == str(n)
            assert cmd[cmd.index("benchmarks.parts.launch_timer") + 1].endswith("train_hydra_plain.py")
        (cmd,) = protected
        assert "accelpact_slurm.cli.run" in cmd
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == per_node
        script = cmd.index("benchmarks.parts.launch_timer") + 1
        assert cmd[script].endswith("train_hydra.py") and cmd[script + 1:] == ["steps=20", *c.args["hydra"]]
        for x in (*plain, cmd):
            assert x[x.index("-m", x.index("--nproc-per-node")) + 1] == "benchmarks.parts.launch_timer"
            assert x[-len(c.args["hydra"]) - 1:] == ["steps=20", *c.args["hydra"]]
    assert (launch.CASES["tiny-2x2"].ranks, launch.CASES["wide-2x1"].ranks) == (4, 2)
    assert launch.CASES["wide-2x1"].args["hydra"] and not launch.CASES["tiny-2x2"].args["hydra"]
    assert launch.case_arms(launch.CASES["wide-2x1"], True) == ["plain", "protected"]  # the reference: tiny only
    assert launch.case_arms(launch.CASES["tiny-2x2"], True) == ["plain", "protected", "plain1x4"]


@pytest.mark.parametrize("argv, says", [
    (["--cases", "huge-9x9"], "no case named huge-9x9"),
    (["--cases", "tiny-2x2,tiny-2x2"], "each case once"),
    (["--cases", "wide-2x1", "--example", "argparse"], "give --example hydra"),
    (["--cases", "wide-2x1", "--with-1x4"], "add tiny-2x2 to --cases"),
])
def test_a_bad_case_choice_is_refused_before_anything_runs(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err
    assert launch.parse_cases("wide-2x1, tiny-2x2") == ["wide-2x1", "tiny-2x2"]
