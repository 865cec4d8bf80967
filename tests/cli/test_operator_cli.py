"""accelpact-status and accelpact-cadence as operators run them: in process, in a fresh interpreter, without torch."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from accelpact_slurm.cli import cadence as cad_cli
from accelpact_slurm.cli import status as status_cli
from accelpact_slurm.core.errors import ConfigError

from tests.conftest import REPO, run_cli

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
RUN = os.path.join(DATA, "run-1001")
SACCT = os.path.join(DATA, "sacct-sample.txt")
JOBCOMP = os.path.join(DATA, "jobcomp-sample.log")
ALL_LOGS = ["--sacct", SACCT, "--jobcomp", JOBCOMP, "--events", RUN]

STATUS_JOB_KEYS = {
    "job_id", "run_dir", "state", "state_source", "run_dir_state", "restarts", "frontier", "step_rate",
    "checkpoint_every_steps", "l1", "l2", "snapshots", "envelope", "final", "last_event_ts", "last_change_ts",
    "stale", "stale_reason", "warnings", "bad_lines", "events"}
CADENCE_KEYS = {
    "schema", "inputs", "bad_lines", "observed_s", "runs", "classes", "restart_rate", "costs", "intervals",
    "goodput", "delta_t", "recommendation", "interruptions", "notes", "missing", "write"}


@pytest.fixture
def runs_root(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    shutil.copytree(RUN, root / "1001")
    monkeypatch.setenv("ACCELPACT_RUNS_ROOT", str(root))
    return root


# --------------------------------------------------------------------------- accelpact-status


def test_status_table_for_a_run_dir(capsys):
    assert status_cli.main([RUN, "--no-slurm"]) == 0
    out = capsys.readouterr().out
    assert "job 1001  COMPLETED (run_dir)" in out
    assert "newest verified: step 80 on node2" in out
    assert "events.jsonl:41: skipped" in out
    assert "run 1: fail-stop 'no envelope entry for key'" in out


def test_status_json_schema_is_stable(capsys):
    assert status_cli.main([RUN, "--json", "--no-slurm"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "accelpact-status/1" and set(doc) == {"schema", "generated_ts", "runs_root", "jobs"}
    (job,) = doc["jobs"]
    assert set(job) == STATUS_JOB_KEYS
    assert set(job["l1"]) == {"count", "last", "recent", "phases", "faults"}
    assert set(job["l2"]) == {"count", "fail_stops", "requeues", "restart_loads"}
    assert set(job["snapshots"]) == {"nodes", "newest_verified", "newest_verified_reason", "counts"}
    assert set(job["frontier"]) == {"step", "ts", "age_s", "source"}


def test_status_without_arguments_lists_recent_jobs(runs_root, capsys):
    assert status_cli.main(["--no-slurm"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["JOB", "STATE", "RESTARTS"]
    assert out[1].split()[:4] == ["1001", "COMPLETED", "2", "80"]


def test_status_job_id_resolves_under_the_runs_root(runs_root, capsys):
    assert status_cli.main(["1001", "--json", "--no-slurm"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    assert job["run_dir"] == str(runs_root / "1001") and job["restarts"] == 2


def test_status_unknown_job_exits_1(runs_root, capsys):
    assert status_cli.main(["999999", "--no-slurm"]) == 1
    assert "no run directory" in capsys.readouterr().out


def test_status_empty_runs_root(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCELPACT_RUNS_ROOT", str(tmp_path))
    assert status_cli.main(["--no-slurm"]) == 0
    assert "no run directories" in capsys.readouterr().out


def test_status_watch_refreshes(capsys):
    assert status_cli.main([RUN, "--json", "--no-slurm", "--watch", "0.01", "--iterations", "3"]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(docs) == 3 and all(d["jobs"][0]["job_id"] == "1001" for d in docs)
    assert status_cli.main([RUN, "--watch", "0"]) == 2


def test_status_takes_the_state_from_squeue(runs_root, tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "squeue"
    fake.write_text('#!/bin/sh\necho "1001|RUNNING"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert status_cli.main(["1001"]) == 0
    out = capsys.readouterr().out
    assert "RUNNING (squeue)" in out


# --------------------------------------------------------------------------- accelpact-cadence


def test_cadence_on_sample_logs(capsys):
    assert cad_cli.main(ALL_LOGS) == 0
    out = capsys.readouterr().out
    assert "Recommendation: checkpoint.every_steps =" in out
    assert "sacct-sample.txt:16: skipped" in out and "jobcomp-sample.log:6: skipped" in out
    assert "Net daily saving dT" in out and "goodput" in out and "* without L1" in out


def test_cadence_json_schema_and_numbers(capsys):
    assert cad_cli.main(ALL_LOGS + ["--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert set(doc) == CADENCE_KEYS and doc["schema"] == "accelpact-cadence/1"
    assert {c: v["count"] for c, v in doc["classes"].items()} == {
        "comm_committed": 3, "uncommitted": 1, "node_fail": 2, "preempted": 1, "timeout": 1, "other": 3}
    assert doc["classes"]["timeout"]["restart"] is False
    assert [(b["path"].rsplit("/", 1)[-1], b["lineno"]) for b in doc["bad_lines"]] == [
        ("sacct-sample.txt", 16), ("sacct-sample.txt", 17), ("jobcomp-sample.log", 3), ("jobcomp-sample.log", 6),
        ("events.jsonl", 41), ("events.jsonl", 91), ("events.jsonl", 155)]
    assert "sacct-sample.txt:16: skipped" in captured.err
    assert doc["costs"]["checkpoint_cost_s"]["value"] == 0.5 and doc["costs"]["step_time_s"]["value"] == 2.0
    assert doc["costs"]["guard_overhead"]["source"].startswith("default")
    iv = doc["intervals"]["without_l1"]
    assert iv["daly_steps"] == round(iv["daly_s"] / 2.0) and iv["range_steps"][0] < iv["daly_steps"]
    rec = doc["recommendation"]
    assert rec["use_l1"] is False and rec["every_steps"] == iv["daly_steps"] and rec["reasons"]
    assert len(doc["goodput"]["curve"]) == 61
    assert doc["delta_t"]["monitoring_cost_s"] == pytest.approx(172.8)


def test_cadence_flags_override_measured_costs(capsys):
    args = ["--events", RUN, "--step-time-s", "220", "--checkpoint-cost-s", "25.6", "--restart-cost-s", "600",
            "--repair-s", "0.77", "--guard-overhead", "0.002", "--age-steps", "5", "--json"]
    assert cad_cli.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["costs"]["step_time_s"] == {"value": 220.0, "source": "flag", "samples": 0}
    assert doc["delta_t"]["saved_per_event_s"] == pytest.approx(1099.23)
    assert doc["recommendation"]["use_l1"] is True  # 3 eligible faults in a few minutes of history


def test_cadence_reports_a_missing_cost(tmp_path, capsys):
    p = tmp_path / "events.jsonl"
    p.write_text(json.dumps({"ts": 1.0, "event": "step", "job_id": "5", "step": 1}) + "\n"
                 + json.dumps({"ts": 100.0, "event": "step", "job_id": "5", "step": 2}) + "\n")
    assert cad_cli.main(["--events", str(p)]) == 2
    assert "missing: checkpoint cost: pass --checkpoint-cost-s" in capsys.readouterr().out
    assert cad_cli.main([]) == 2


@pytest.mark.parametrize("flag, value", [("--checkpoint-cost-s", "-1"), ("--step-time-s", "0"),
                                         ("--guard-overhead", "nan"), ("--confidence", "1.5")])
def test_cadence_refuses_bad_numbers(flag, value, capsys):
    assert cad_cli.main(["--events", RUN, flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_cadence_without_any_failure_uses_the_upper_rate_bound(tmp_path, capsys):
    p = tmp_path / "events.jsonl"
    recs = [{"ts": 10.0 * i, "event": "step", "job_id": "5", "restart": 0, "step": i, "step_s": 10.0}
            for i in range(1, 1001)]
    recs.append({"ts": 5000.5, "event": "checkpoint", "job_id": "5", "step": 500, "state": "committed",
                 "blocking_s": 2.0})
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert cad_cli.main(["--events", str(p), "--json", "--observed-s", str(7 * 86400)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["observed_s"] == 7 * 86400 and all(c["count"] == 0 for c in doc["classes"].values())
    assert any("upper rate bound" in r for r in doc["recommendation"]["reasons"])
    curve = [p["without_l1"] for p in doc["goodput"]["curve"]]
    assert max(curve) > curve[0] and max(curve) > curve[-1]  # a real optimum, not "never checkpoint"


def test_cadence_write_changes_only_every_steps(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    shutil.copy(os.path.join(DATA, "job-sample.yaml"), job)
    before = job.read_text().splitlines()
    assert cad_cli.main(ALL_LOGS + ["--write", str(job)]) == 0
    out = capsys.readouterr().out
    after = job.read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 1
    old, new = changed[0]
    assert old == "  every_steps: 10    # keep this comment"
    steps = int(new.split(":")[1].split("#")[0])
    assert new == f"  every_steps: {steps}    # keep this comment"
    assert f"checkpoint.every_steps 10 -> {steps} (changed)" in out
    import yaml

    assert yaml.safe_load(job.read_text())["checkpoint"] == {"every_steps": steps, "keep_last": 2, "milestone_every": 0}


def test_cadence_plot_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "goodput.png"
    assert cad_cli.main(ALL_LOGS + ["--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cadence_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cad_cli.main(ALL_LOGS + ["--plot", str(tmp_path / "g.png")]) == 2
    assert "needs matplotlib, which is not installed: pip install matplotlib" in capsys.readouterr().err


# --------------------------------------------------------------------------- the job file edit


@pytest.mark.parametrize("text, expected, old", [
    ("checkpoint:\n  every_steps: 5\n  keep_last: 2\n", "checkpoint:\n  every_steps: 40\n  keep_last: 2\n", 5),
    ("checkpoint:\n    keep_last: 2\n", "checkpoint:\n    every_steps: 40\n    keep_last: 2\n", None),
    ("name: x\n", "name: x\ncheckpoint:\n  every_steps: 40\n", None),
    ("name: x", "name: x\ncheckpoint:\n  every_steps: 40\n", None),
    ("eval:\n  every_steps: 3\ncheckpoint:  # c\n  every_steps: 7 # n\n",
     "eval:\n  every_steps: 3\ncheckpoint:  # c\n  every_steps: 40 # n\n", 7),
    ("checkpoint:\r\n  every_steps: 5\r\n", "checkpoint:\r\n  every_steps: 40\r\n", 5),
    ("checkpoint:\n  keep_last: 2\n  sub:\n    every_steps: 9\n",
     "checkpoint:\n  every_steps: 40\n  keep_last: 2\n  sub:\n    every_steps: 9\n", None),
])
def test_set_every_steps(text, expected, old):
    assert cad_cli.set_every_steps(text, 40) == (expected, old)


def test_set_every_steps_refuses_flow_style():
    with pytest.raises(ConfigError):
        cad_cli.set_every_steps("checkpoint: {every_steps: 5}\n", 40)


def test_write_warns_when_milestones_stop_lining_up(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("checkpoint:\n  every_steps: 10\n  milestone_every: 100\n")
    res = cad_cli.write_every_steps(str(job), 30)
    assert res["changed"] and res["old"] == 10 and "not a multiple" in res["warning"]


# --------------------------------------------------------------------------- no torch on login nodes


def test_mains_import_no_torch_in_process(capsys):
    before = set(sys.modules)
    assert status_cli.main([RUN, "--no-slurm"]) == 0
    assert cad_cli.main(ALL_LOGS) == 0
    new = set(sys.modules) - before
    assert not [m for m in new if m == "torch" or m.startswith("torch.")]


def test_mains_run_in_a_fresh_interpreter_where_torch_cannot_be_imported():
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is not installed on this login node")
        sys.meta_path.insert(0, NoTorch())
        from accelpact_slurm.cli import cadence, status
        rc = status.main([{RUN!r}, "--json", "--no-slurm"])
        rc |= cadence.main({ALL_LOGS!r} + ["--json"])
        assert "torch" not in sys.modules, "torch was imported"
        sys.exit(rc)
    """)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("module, args", [
    ("accelpact_slurm.cli.status", [RUN, "--no-slurm"]),
    ("accelpact_slurm.cli.cadence", ALL_LOGS),
])
def test_commands_as_modules(module, args):
    proc = run_cli([module, *args], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
