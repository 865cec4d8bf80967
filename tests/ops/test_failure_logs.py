"""Parsers of sacct, jobcomp/filetxt and event logs: classification, merging, and bad lines that never crash."""

from __future__ import annotations

import json
import os

import pytest

from accelpact_slurm.ops import failure_logs as fl
from accelpact_slurm.core.events import BadLine

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
SACCT = os.path.join(DATA, "sacct-sample.txt")
JOBCOMP = os.path.join(DATA, "jobcomp-sample.log")
RUN = os.path.join(DATA, "run-1001")


def _bad_numbers(bad: list[BadLine], path: str) -> list[int]:
    return [b.lineno for b in bad if b.path == path]


# --------------------------------------------------------------------------- sacct


def test_sacct_sample_reads_allocations_skips_steps_and_reports_bad_lines():
    bad: list[BadLine] = []
    runs = fl.parse_sacct(SACCT, bad)
    assert [r.job_id for r in runs].count("1001") == 3
    assert not any("." in r.job_id for r in runs)
    assert _bad_numbers(bad, SACCT) == [16, 17]  # a truncated line and a bad time
    assert "header has 8" in bad[0].reason and "yesterday" in bad[1].reason
    node_fail = next(r for r in runs if r.state == "NODE_FAIL")
    assert node_fail.elapsed_s == 30 * 3600 and node_fail.nodes == "node[3-6]"
    running = next(r for r in runs if r.job_id == "1007")
    assert running.end is None and running.duration_s == 2 * 86400


def test_sacct_without_header_assumes_the_documented_field_order(tmp_path):
    p = tmp_path / "sacct.txt"
    p.write_text("77|NODE_FAIL|0:0|2024-01-01T00:00:00|2024-01-01T01:00:00|node1|01:00:00\n")
    bad: list[BadLine] = []
    (run,) = fl.parse_sacct(p, bad)
    assert bad == [] and run.state == "NODE_FAIL" and run.duration_s == 3600


def test_sacct_end_minus_start_when_no_elapsed_column(tmp_path):
    p = tmp_path / "sacct.txt"
    p.write_text("JobID|State|Start|End\n5|FAILED|2024-01-01T00:00:00|2024-01-01T00:30:00\n")
    (run,) = fl.parse_sacct(p, [])
    assert run.duration_s == 1800


def test_sacct_header_without_state_is_one_bad_line(tmp_path):
    p = tmp_path / "sacct.txt"
    p.write_text("JobID|Start\n1|2024-01-01T00:00:00\n")
    bad: list[BadLine] = []
    assert fl.parse_sacct(p, bad) == []
    assert [b.lineno for b in bad] == [1] and "State" in bad[0].reason


@pytest.mark.parametrize("elapsed, seconds", [("00:00:53", 53), ("1-06:00:00", 108000), ("05:30", 330),
                                              ("01:02.5", 62.5), ("", None)])
def test_sacct_elapsed_formats(elapsed, seconds):
    assert fl._elapsed(elapsed) == seconds


@pytest.mark.parametrize("state, exit_code, cls", [
    ("COMPLETED", "0:0", fl.COMPLETED),
    ("NODE_FAIL", "1:0", fl.NODE_FAIL),
    ("BOOT_FAIL", "0:0", fl.NODE_FAIL),
    ("PREEMPTED", "0:15", fl.PREEMPTED),
    ("TIMEOUT", "0:0", fl.TIMEOUT),
    ("DEADLINE", "0:0", fl.TIMEOUT),
    ("CANCELLED by 1000", "0:0", fl.CANCELLED),
    ("RUNNING", "0:0", fl.RUNNING),
    ("FAILED", "1:0", fl.OTHER),
    ("OUT_OF_MEMORY", "0:125", fl.OTHER),
    ("REQUEUED", "0:0", fl.OTHER),
    ("FAILED", "75:0", fl.OTHER),
    ("", "", fl.OTHER),
])
def test_classify_slurm(state, exit_code, cls):
    got, reason = fl.classify_slurm(state, exit_code)
    assert got == cls and reason


def test_classify_slurm_names_our_exit_codes():
    assert "fail-stop" in fl.classify_slurm("FAILED", "75:0")[1]
    assert "no requeue" in fl.classify_slurm("FAILED", "76:0")[1]


# --------------------------------------------------------------------------- jobcomp


def test_jobcomp_sample_reads_requeues_and_values_with_spaces():
    bad: list[BadLine] = []
    runs = fl.parse_jobcomp(JOBCOMP, bad)
    assert [(r.job_id, r.state) for r in runs] == [
        ("1002", "NODE_FAIL"), ("2001", "REQUEUED"), ("2001", "COMPLETED"), ("2002", "NODE_FAIL")]
    assert _bad_numbers(bad, JOBCOMP) == [3, 6]
    assert runs[0].exit_code == "1:0" and runs[0].duration_s == 30 * 3600


def test_jobcomp_line_with_a_bad_time_is_skipped(tmp_path):
    p = tmp_path / "jobcomp.log"
    p.write_text("JobId=9 JobState=FAILED StartTime=soon EndTime=2024-01-01T00:00:00 ExitCode=1:0\n")
    bad: list[BadLine] = []
    assert fl.parse_jobcomp(p, bad) == [] and bad[0].lineno == 1


# --------------------------------------------------------------------------- event logs


def test_scan_sample_events_counts_repairs_once_and_measures_costs():
    bad: list[BadLine] = []
    scan = fl.scan_events([RUN], bad)
    assert sorted(scan.runs) == [("1001", 0), ("1001", 1), ("1001", 2)]
    assert len(scan.repairs) == 2  # four ranks log each repair
    assert _bad_numbers(bad, os.path.join(RUN, "events.jsonl")) == [41, 91, 155]
    assert set(scan.step_s) == {2.0} and len(scan.step_s) == 25 + 35 + 30
    assert scan.checkpoint_s and set(scan.checkpoint_s) == {0.5}
    assert sorted(scan.decision_s) == [0.02, 0.03]
    assert sorted(scan.ages) == [5, 5, 5, 5]  # frontier - newest verified at 2 repairs and 2 fail-stops


def test_events_alone_classify_each_run():
    hist = fl.build_history([], fl.scan_events([RUN], []))
    assert hist.count(fl.COMM_COMMITTED) == 3  # two repairs and one fail-stop at a committed boundary
    assert hist.count(fl.UNCOMMITTED) == 1
    assert sum(hist.count(c) for c in fl.CLASSES) == 4
    outcomes = sorted(i.outcome for i in hist.interruptions)
    assert outcomes == ["repaired", "repaired", "restarted", "restarted"]
    assert hist.exposure_s == pytest.approx(52.2 + 74.9 + 64.0, abs=0.5)
    assert hist.costs["step_time_s"].value == 2.0
    assert hist.costs["restart_cost_s"].value == pytest.approx(151.5, abs=1.0)
    assert hist.costs["repair_s"].value == pytest.approx(0.03775)
    assert hist.costs["age_steps"].value == 5


def test_all_sources_merge_without_double_counting():
    bad: list[BadLine] = []
    runs = fl.parse_sacct(SACCT, bad) + fl.parse_jobcomp(JOBCOMP, bad)
    hist = fl.build_history(runs, fl.scan_events([RUN], bad))
    counts = {c: hist.count(c) for c in fl.CLASSES}
    assert counts == {fl.COMM_COMMITTED: 3, fl.UNCOMMITTED: 1, fl.NODE_FAIL: 2, fl.PREEMPTED: 1,
                      fl.TIMEOUT: 1, fl.OTHER: 3}
    assert hist.runs == 15  # 12 sacct runs + 3 jobcomp-only; 1002's NODE_FAIL in both is counted once
    refined = [i for i in hist.interruptions if i.job_id == "1001" and i.outcome == "restarted"]
    assert [i.cls for i in refined] == [fl.UNCOMMITTED, fl.COMM_COMMITTED]
    assert all("Slurm: REQUEUED" in i.detail for i in refined)


def test_event_log_aligns_with_a_sacct_that_only_kept_the_last_run(tmp_path):
    p = tmp_path / "sacct.txt"
    p.write_text("JobID|State|ExitCode|Elapsed\n1001|COMPLETED|0:0|00:01:05\n")
    hist = fl.build_history(fl.parse_sacct(p, []), fl.scan_events([RUN], []))
    assert hist.count(fl.UNCOMMITTED) == 1 and hist.count(fl.COMM_COMMITTED) == 3
    # The two earlier runs come from the event log; the last from sacct (65 s).
    assert hist.exposure_s == pytest.approx(52.2 + 74.9 + 65.0, abs=0.5)


def test_requeue_reason_classifies_an_event_only_run(tmp_path):
    p = tmp_path / "events.jsonl"
    recs = [
        {"ts": 1.0, "event": "step", "job_id": "9", "restart": 0, "step": 1},
        {"ts": 2.0, "event": "requeue", "job_id": "9", "restart": 0, "reason": "preempted (USR2 grace)"},
        {"ts": 9.0, "event": "step", "job_id": "9", "restart": 1, "step": 1},
        {"ts": 10.0, "event": "step", "job_id": "9", "restart": 2, "step": 1},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    hist = fl.build_history([], fl.scan_events([p], []))
    assert [i.cls for i in hist.interruptions] == [fl.PREEMPTED, fl.OTHER]
    assert "killed from outside" in hist.interruptions[1].detail


def test_missing_files_are_bad_lines_not_errors(tmp_path):
    bad: list[BadLine] = []
    assert fl.parse_sacct(tmp_path / "nope.txt", bad) == []
    assert fl.parse_jobcomp(tmp_path / "nope.log", bad) == []
    scan = fl.scan_events([tmp_path / "nope.jsonl"], bad)
    assert scan.runs == {} and [b.lineno for b in bad] == [0, 0, 0]


def test_non_utf8_and_non_object_lines_are_skipped_with_numbers(tmp_path):
    p = tmp_path / "sacct.txt"
    p.write_bytes(b"JobID|State|Elapsed\n\xff\xfe|FAILED|00:01:00\n7|FAILED|00:01:00\n")
    bad: list[BadLine] = []
    assert [r.job_id for r in fl.parse_sacct(p, bad)] == ["7"] and bad[0].lineno == 2
    e = tmp_path / "events.jsonl"
    e.write_text('[1, 2]\n{"event": "step"}\n{"ts": "x", "event": "step"}\n')
    bad = []
    scan = fl.scan_events([e], bad)
    assert scan.runs == {} and [b.lineno for b in bad] == [1]


@pytest.mark.parametrize("name", ["sacct-sample.txt", "jobcomp-sample.log", "run-1001/events.jsonl"])
def test_every_truncation_of_a_sample_parses_without_raising(tmp_path, name):
    data = open(os.path.join(DATA, name), "rb").read()
    step = max(1, len(data) // 300)
    for cut in range(0, len(data), step):
        p = tmp_path / "cut"
        p.write_bytes(data[:cut])
        bad: list[BadLine] = []
        runs = fl.parse_sacct(p, bad) + fl.parse_jobcomp(p, bad)
        fl.build_history(runs, fl.scan_events([p], bad))


# --------------------------------------------------------------------------- records Slurm never writes


@pytest.mark.parametrize("elapsed", [
    "99-99:99:99.5",  # once read as 103 days
    "1-24:00:00",  # hours >= 24 beside a day count
    "00:60:00", "00:00:60", "60:00",  # minutes or seconds >= 60
    "01:00:00.5", "1-00:00:00.5",  # Slurm writes a fraction only as MM:SS.mmm
    "1-05:00",  # a day count is always followed by HH:MM:SS
    pytest.param("1" * 400 + "-00:00:00", id="400-digit-days"),  # once an OverflowError
    pytest.param("1" * 400 + ":00:00", id="400-digit-hours"),
    "٣:٠٠",  # Arabic-Indic digits: int() reads them, Slurm never writes them
])
def test_sacct_elapsed_slurm_never_writes_is_refused(elapsed):
    with pytest.raises(ValueError, match="elapsed"):
        fl._elapsed(elapsed)


def test_sacct_bad_elapsed_is_a_bad_record_not_a_crash(tmp_path):
    p = tmp_path / "sacct.txt"
    p.write_text("JobID|State|ExitCode|Elapsed\n"
                 f"1|FAILED|1:0|{'9' * 400}-00:00:00\n"
                 "2|FAILED|1:0|99-99:99:99.5\n"
                 "3|FAILED|1:0|00:01:00\n")
    bad: list[BadLine] = []
    runs = fl.parse_sacct(p, bad)
    assert [r.job_id for r in runs] == ["3"] and [b.lineno for b in bad] == [2, 3]
    assert len(bad[0].reason) < 200


@pytest.mark.parametrize("exit_code", ["²:0", pytest.param("9" * 5000 + ":0", id="5000-digits")])
def test_exit_code_slurm_never_writes_is_no_exit_code(tmp_path, exit_code):
    # str.isdigit() accepts "²" and 5000 digits, which int() then refuses: a crash in build_history.
    assert fl.classify_slurm("FAILED", exit_code)[0] == fl.OTHER
    p = tmp_path / "sacct.txt"
    p.write_text(f"JobID|State|ExitCode|Elapsed\n1|FAILED|{exit_code}|00:01:00\n")
    bad: list[BadLine] = []
    hist = fl.build_history(fl.parse_sacct(p, bad), fl.EventScan())
    assert hist.count(fl.OTHER) == 1


def test_infinite_ts_is_a_bad_line_and_huge_numbers_are_no_numbers(tmp_path):
    e = tmp_path / "events.jsonl"
    e.write_text('{"ts": 1e400, "event": "step", "job_id": "5", "step": 1}\n'
                 '{"ts": 1.0, "event": "step", "job_id": "5", "step": 1, "step_s": 1e400}\n'
                 + json.dumps({"ts": 2.0, "event": "step", "job_id": "5", "step": 10 ** 400}) + "\n"
                 + json.dumps({"ts": 3.0, "event": "step", "job_id": "5", "step": 3, "step_s": 2.0}) + "\n"
                 + json.dumps({"ts": 4.0, "event": "checkpoint", "job_id": "5", "step": 3, "state": "verified",
                               "blocking_s": 10 ** 400}) + "\n"
                 + json.dumps({"ts": 5.0, "event": "fail_stop", "job_id": "5", "frontier": 10 ** 400,
                               "phase": "forward", "decision_s": 0.1}) + "\n")
    bad: list[BadLine] = []
    scan = fl.scan_events([e], bad)
    assert [b.lineno for b in bad] == [1] and "'ts'" in bad[0].reason
    hist = fl.build_history([], scan)
    assert hist.costs["step_time_s"].value == 2.0 and hist.costs["checkpoint_cost_s"].value is None
    assert hist.costs["age_steps"].value is None and hist.exposure_s == 4.0
