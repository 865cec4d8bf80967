"""The benchmark figures in the README and in docs/benchmarks.md are the ones the committed summaries give.

Both files are written by ``benchmarks/harness/run.py`` from ``benchmarks/summaries/`` alone; these tests
generate them again in memory (no benchmark runs: pure rendering of the committed JSON) and compare.  A figure
copied by hand, or a summary changed without regenerating the text, fails here with the line and both figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.harness import figures
from benchmarks.harness import run as bench_run
from benchmarks.harness import summary

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs" / "benchmarks.md"


@pytest.fixture(scope="module")
def generated():
    """(README block, docs text) as the renderer writes them from the committed summaries."""
    return bench_run.readme_block(), bench_run.render()


def test_the_readme_figures_are_the_generated_block(generated):
    block, _docs = generated
    found = figures.block_of(README.read_text(), figures.README_MARK)
    assert found is not None, f"README.md has no block between two {figures.README_MARK} lines"
    assert figures.figure_diff(block, found) == [], (
        "README.md's benchmark figures differ from the committed summaries; regenerate them with "
        "`python -m benchmarks.harness.run --render`")


def test_docs_benchmarks_is_the_generated_text(generated):
    _block, docs = generated
    assert docs == DOCS.read_text(), (
        "docs/benchmarks.md differs from what the committed summaries give; regenerate it with "
        "`python -m benchmarks.harness.run --render`: " + "; ".join(figures.figure_diff(docs, DOCS.read_text())))


def test_a_changed_figure_is_found(generated):
    """Negative control: one figure changed in a copy of each file is named, with the figure it should be."""
    block, docs = generated
    found = figures.block_of(README.read_text(), figures.README_MARK)
    for expected, actual in ((block, found), (docs, DOCS.read_text())):
        lines = actual.splitlines()
        i = next(k for k, ln in enumerate(lines) if figures.FIGURE.search(ln) and "x (" in ln)
        old = figures.FIGURE.findall(lines[i])[-1]
        lines[i] = lines[i][::-1].replace(old[::-1], "7.77"[::-1] if old != "7.77" else "8.88"[::-1], 1)[::-1]
        diff = figures.figure_diff(expected, "\n".join(lines) + ("\n" if actual.endswith("\n") else ""))
        assert len(diff) == 1 and f"(results: {old})" in diff[0], diff


def test_committed_benchmark_data_is_small_summaries():
    """Only summaries are committed (no raw results): under 2 MB in all, none over 64 kB, each with its rows."""
    files = sorted((REPO / "benchmarks" / "summaries").rglob("*.json"))
    assert files, "no committed summary"
    assert sum(f.stat().st_size for f in files) < 2 * 2**20
    assert max(f.stat().st_size for f in files) < 64 * 2**10
    assert not (REPO / "benchmarks" / "results").exists()
    for f in files:
        doc = json.loads(f.read_text())
        assert ("runs" in doc) if f.stem == "run" else isinstance(doc.get("rows"), list), f


def test_a_section_reads_back_as_it_was_written():
    """A part's block (paragraphs, a table with its alignment rule, a trailing blank line) survives the summary."""
    mark = "<!-- x-bench -->"
    block = "\n".join([mark, "## X", "", "Written on 2026-01-02.", "", "| a | b |", "|---|---:|", "| 1 | 2.5 (2–3) |",
                        "", "- a list", "- of two", "", mark])
    sec = summary.section_of(block, mark)
    assert sec[2] == {"table": [["a", "b"], ["---", "---:"], ["1", "2.5 (2–3)"]]}
    assert summary.section_text(sec, mark) == block


def test_the_campaign_summary_counts_each_kind():
    """The campaign part's summary from a record of four runs: per kind runs, bitwise, named stops, failed and the
    passed runs' median time back to training; the failed run is named in the section."""
    from benchmarks.parts import campaign

    res = {"part": "campaign", "date": "2026-01-02", "seed": 7, "json": "runs/bench/2026-01-02/campaign.json",
           "runs": [{"run": 0, "kind": "kill_rank", "phase": "update", "update": 5, "result": "bitwise",
                     "passed": True, "time_back_s": 3.0},
                    {"run": 1, "kind": "kill_rank", "phase": "restore", "update": 7, "result": "bitwise",
                     "passed": True, "time_back_s": 5.0},
                    {"run": 2, "kind": "disk_full", "phase": "snapshot", "update": 7, "result": "stop: disk_full",
                     "passed": True, "time_back_s": None},
                    {"run": 3, "kind": "sigstop_rank0", "phase": "update", "update": 7,
                     "result": "FAIL: deadline 180 s passed", "passed": False, "time_back_s": None}]}
    summ = bench_run.summarize_part(bench_run.PARTS["campaign"], res, summary.RAW)
    text = summary.section_text(summ["section"], campaign.MARK)
    assert "| kill_rank | restore, update | 2 | 2 | 0 | 0 | 4.00 (3.00–5.00) s (n 2) |" in text
    assert "| disk_full | snapshot | 1 | 0 | 1 | 0 | - |" in text
    assert "| sigstop_rank0 | update | 1 | 0 | 0 | 1 | - |" in text and "deadline 180 s passed" in text
    assert [r["ratio"] for r in summ["rows"]] == [1.0, 1.0, 0.0]


def test_make_bench_parts_campaign_runs_only_the_campaign():
    """``BENCH_ARGS="--parts campaign"`` selects the campaign alone, 50 runs through scripts/campaign.py's CLI;
    an unknown part is refused with the list of parts."""
    assert bench_run.selected("campaign") == ["campaign"]
    assert bench_run.selected(None)[-1] == "campaign" and len(bench_run.selected(None)) == len(bench_run.PARTS)
    args = bench_run.PARTS["campaign"].args
    assert args[args.index("--runs") + 1] == "50"
    with pytest.raises(ValueError, match="unknown part.*campain.*the parts are"):
        bench_run.selected("campain")


def test_a_part_reads_what_the_job_emits_from_its_event_log(tmp_path):
    """The checkpoint part times our snapshots by rank 0's ``snapshot`` events (no private field of the client):
    whole lines only, rank 0's, each snapshot's pieces and its blocking time once."""
    from benchmarks.parts.ckpt_entry import SnapshotEvents

    log = tmp_path / "events.jsonl"
    ev = {"event": "snapshot", "rank": 0, "step": 4, "blocking_s": 0.5, "parts_s": {"copy": 0.3, "proof": 0.1}}
    log.write_text(json.dumps(dict(ev, rank=1)) + "\n" + json.dumps(ev) + "\n" + '{"event": "snapsh')
    snaps = SnapshotEvents(str(tmp_path))
    assert snaps.parts(4) == {"copy": 0.3, "proof": 0.1, "total": 0.5}
    assert snaps.parts(4) == {}  # read once
    with open(log, "a") as fh:  # the half-written line ends: read now, not before
        fh.write('ot", "rank": 0, "step": 8, "blocking_s": 0.2, "parts_s": {}}\n')
    assert snaps.parts(8) == {"total": 0.2}


def test_the_detector_toggle_pairs_each_alternation_on_its_slowest_rank():
    """The detector's own cost (``recovery_cost.toggle_analysis``): each alternation's ratio is the slowest rank's
    mean of its ``on`` updates over the slowest rank's mean of its adjacent ``off`` ones, and the headline is
    their median.  Rank 1 is the slow one in every update here, 10% slower with the detector on; rank 0 is fast
    and unaffected: the headline must read rank 1's 1.10, not rank 0's 1.00 nor a mean of the two."""
    from benchmarks.parts.recovery_cost import toggle_analysis

    k, n = 2, 10
    base = [0.100 + 0.001 * (i % 3) for i in range(n * k)]  # the same moments of the machine in both halves
    ranks = [{"on": [0.050] * (n * k), "off": [0.050] * (n * k), "wall_s": 4.0, "liveness_cpu_s": 0.004},
             {"on": [b * 1.10 for b in base], "off": base, "wall_s": 4.0, "liveness_cpu_s": 0.008}]
    got = toggle_analysis({"k": k, "alternations": n, "ranks": ranks})
    assert got["ratio"]["n"] == n and abs(got["ratio"]["median"] - 1.10) < 1e-9
    assert got["ratio"]["lo"] <= got["ratio"]["median"] <= got["ratio"]["hi"]
    assert [round(x["ratio"], 6) for x in got["per_rank"]] == [1.0, 1.1]
    assert abs(got["added_ms"] - 10.1) < 0.2 and got["liveness_cpu_share"]["max"] == 0.002
