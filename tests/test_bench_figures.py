"""The benchmark figures in the README and in docs/benchmarks.md are the ones the committed results give.

Both files are written by ``scripts/bench_all.py`` from ``benchmarks/results/`` alone; these tests generate
them again in memory (no benchmark runs: pure rendering of the committed JSON) and compare.  A figure copied
by hand, or a result changed without regenerating the text, fails here with the line and both figures.
Results measured before a field existed (the repair's per-rank floors) render as awaiting the next
``make bench`` run, which is an accepted state.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
DOCS = REPO / "docs" / "benchmarks.md"


@pytest.fixture(scope="module")
def bench_all():
    """``scripts/bench_all.py`` as a module (it puts ``scripts/`` on the path for its ``bench`` package)."""
    spec = importlib.util.spec_from_file_location("_bench_all_under_test", REPO / "scripts" / "bench_all.py")
    mod = importlib.util.module_from_spec(spec)
    old_path = list(sys.path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = old_path + [p for p in sys.path if p not in old_path]
    return mod


def _newest_merged() -> Path:
    merged = sorted(RESULTS.glob("20??-??-??.json"))
    assert merged, f"no merged result under {RESULTS}"
    return merged[-1]


@pytest.fixture(scope="module")
def generated(bench_all):
    """(README block, docs text) as the generator writes them from the committed results."""
    from bench import figures

    merged = json.loads(_newest_merged().read_text())
    docs = bench_all.render(merged, DOCS.read_text(), RESULTS)
    return bench_all.readme_block(RESULTS), docs, figures


def test_the_readme_figures_are_the_generated_block(generated):
    block, _docs, figures = generated
    text = README.read_text()
    found = figures.block_of(text, figures.README_MARK)
    assert found is not None, f"README.md has no block between two {figures.README_MARK} lines"
    assert figures.figure_diff(block, found) == [], (
        "README.md's benchmark figures differ from the committed results; regenerate them with "
        "`scripts/bench_all.py --render benchmarks/results/<date>.json`")


def test_docs_benchmarks_is_the_generated_text(generated):
    _block, docs, figures = generated
    assert figures.figure_diff(docs, DOCS.read_text()) == [], (
        "docs/benchmarks.md differs from what the committed results give; regenerate it with "
        "`scripts/bench_all.py --render benchmarks/results/<date>.json`")


def test_a_changed_figure_is_found(generated):
    """Negative control: one figure changed in a copy of each file is named, with the figure it should be."""
    block, docs, figures = generated
    readme = README.read_text()
    found = figures.block_of(readme, figures.README_MARK)
    for expected, actual in ((block, found), (docs, DOCS.read_text())):
        lines = actual.splitlines()
        i = next(k for k, ln in enumerate(lines) if figures.FIGURE.search(ln) and "x (" in ln)
        old = figures.FIGURE.findall(lines[i])[-1]
        lines[i] = lines[i][::-1].replace(old[::-1], "7.77"[::-1] if old != "7.77" else "8.88"[::-1], 1)[::-1]
        diff = figures.figure_diff(expected, "\n".join(lines) + ("\n" if actual.endswith("\n") else ""))
        assert len(diff) == 1 and f"(results: {old})" in diff[0], diff


def test_a_repair_result_without_per_rank_floors_awaits_the_next_run(generated):
    """The committed repair result may predate the per-rank floors: then the figure says it awaits a run."""
    _block, docs, figures = generated
    res, _rel = figures.stored_results(RESULTS)["repair"]
    if res["main"].get("method") is None:
        assert "awaits the next `make bench` run" in figures.block_of(docs, "<!-- repair-bench -->")
        assert "awaits the next `make bench` run" in figures.block_of(README.read_text(), figures.README_MARK)
    else:  # a result with them: the flagged repairs are named in the JSON and left out of the ratio
        assert res["main"]["total_vs_floor"]["n"] == len(res["main"]["pairs"]) - len(res["main"]["below_floor"])


def test_the_newest_part_file_wins_over_the_merged_copy(tmp_path):
    """A part run alone after ``make bench`` rewrites its own file; that file, not the merged copy, is its result."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import figures

    (tmp_path / "benchmarks" / "results" / "2026-01-02").mkdir(parents=True)
    res_dir = tmp_path / "benchmarks" / "results"
    (res_dir / "2026-01-02.json").write_text(json.dumps({"parts": {"x": {"part": "x", "date": "2026-01-02",
                                                                           "rows": [{"ratio": 1.0}]}}}))
    (res_dir / "2026-01-02" / "x.json").write_text(json.dumps({"part": "x", "date": "2026-01-02",
                                                                "rows": [{"ratio": 2.0}]}))
    (res_dir / "2026-01-01.json").write_text(json.dumps({"parts": {"x": {"part": "x", "rows": [{"ratio": 3.0}]}}}))
    got, rel = figures.stored_results(res_dir)["x"]
    assert got["rows"][0]["ratio"] == 2.0 and rel == os.path.join("benchmarks", "results", "2026-01-02", "x.json")


def test_the_detector_toggle_pairs_each_alternation_on_its_slowest_rank(bench_all):
    """The detector's own cost (``recovery_cost.toggle_analysis``): each alternation's ratio is the slowest rank's
    mean of its ``on`` updates over the slowest rank's mean of its adjacent ``off`` ones, and the headline is
    their median.  Rank 1 is the slow one in every update here, 10% slower with the detector on; rank 0 is fast
    and unaffected: the headline must read rank 1's 1.10, not rank 0's 1.00 nor a mean of the two."""
    from bench.recovery_cost import toggle_analysis

    k, n = 2, 10
    base = [0.100 + 0.001 * (i % 3) for i in range(n * k)]  # the same moments of the machine in both halves
    ranks = [{"on": [0.050] * (n * k), "off": [0.050] * (n * k), "wall_s": 4.0, "liveness_cpu_s": 0.004},
             {"on": [b * 1.10 for b in base], "off": base, "wall_s": 4.0, "liveness_cpu_s": 0.008}]
    got = toggle_analysis({"k": k, "alternations": n, "ranks": ranks})
    assert got["ratio"]["n"] == n and abs(got["ratio"]["median"] - 1.10) < 1e-9
    assert got["ratio"]["lo"] <= got["ratio"]["median"] <= got["ratio"]["hi"]
    assert [round(x["ratio"], 6) for x in got["per_rank"]] == [1.0, 1.1]
    assert abs(got["added_ms"] - 10.1) < 0.2 and got["liveness_cpu_share"]["max"] == 0.002
