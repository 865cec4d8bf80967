"""accelpact-status and accelpact-cadence as operators run them: in process, in a fresh interpreter, without torch."""

from __future__ import annotations

import json
import re
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
    "stale", "stale_reason", "warnings", "bad_lines", "events", "last_stop", "spares"}
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
    assert ("restart loads step 80 from node2: step 80 is the newest step verified anywhere (on node2); "
            "node1 loads it") in out
    assert "common step   step 60: step 60 is the newest step verified on every one of 2 node(s)" in out
    assert "events.jsonl:41: skipped" in out
    assert "run 1: fail-stop 'no envelope entry for key'" in out


def test_status_json_schema_is_stable(capsys):
    assert status_cli.main([RUN, "--json", "--no-slurm"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "accelpact-status/1" and set(doc) == {"schema", "generated_ts", "runs_root", "jobs"}
    (job,) = doc["jobs"]
    assert set(job) == STATUS_JOB_KEYS
    assert set(job["l1"]) == {"count", "last", "recent", "phases", "faults"}
    assert set(job["l2"]) == {"count", "fail_stops", "requeues", "restart_loads", "excluded"}
    assert set(job["snapshots"]) == {"nodes", "newest_verified", "newest_verified_reason", "counts", "shared",
                                     "restart", "newest_common"}
    snaps = job["snapshots"]
    assert (snaps["restart"]["step"], snaps["restart"]["source"]) == (80, "node2") and snaps["restart"]["reason"]
    assert snaps["newest_common"]["step"] == 60 and set(snaps["shared"]) == {"dir", "snapshots", "counts"}
    assert set(job["frontier"]) == {"step", "ts", "age_s", "source"}
    assert job["spares"] is None  # a job without spare nodes has no pool


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
            "--repair-s", "0.77", "--guard-overhead", "0.002", "--age-steps", "5", "--observed-s", str(7 * 86400),
            "--json"]
    assert cad_cli.main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["costs"]["step_time_s"] == {"value": 220.0, "source": "flag", "samples": 0}
    assert doc["delta_t"]["saved_per_event_s"] == pytest.approx(1099.23)
    # 3 eligible faults in a week (the log's own few minutes are too little to recommend anything from)
    assert doc["recommendation"]["use_l1"] is True


def test_cadence_reports_a_missing_cost(tmp_path, capsys):
    p = tmp_path / "events.jsonl"
    p.write_text(json.dumps({"ts": 1.0, "event": "step", "job_id": "5", "step": 1}) + "\n"
                 + json.dumps({"ts": 100.0, "event": "step", "job_id": "5", "step": 2}) + "\n")
    assert cad_cli.main(["--events", str(p)]) == 2
    assert "missing: checkpoint cost: pass --checkpoint-cost-s" in capsys.readouterr().out
    assert cad_cli.main([]) == 2


@pytest.mark.parametrize("flag, value", [("--checkpoint-cost-s", "-1"), ("--step-time-s", "0"),
                                         ("--guard-overhead", "nan"), ("--confidence", "1.5"), ("--max-regret", "0"),
                                         ("--max-regret", "1")])
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


@pytest.mark.slow
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


# --------------------------------------------------------------------------- hostile run directories and logs


def _write_events(path, recs, raw_lines=()):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "events.jsonl"), "w") as fh:
        for r in recs:
            fh.write(json.dumps(dict({"job_id": "77", "restart": 0, "rank": 0, "node": 0}, **r)) + "\n")
        for line in raw_lines:
            fh.write(line + "\n")
    return str(path)


def test_status_deeply_nested_line_is_a_skipped_line_not_a_crash(tmp_path):
    d = _write_events(tmp_path / "77", [{"ts": 1.0, "event": "step", "step": 1}],
                      ["[" * 200_000 + "]" * 200_000, '{"a":' * 200_000 + "1" + "}" * 200_000])
    for extra in ([], ["--json"]):
        proc = run_cli(["accelpact_slurm.cli.status", d, "--no-slurm", *extra], timeout=120)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "events.jsonl:2: skipped: nested deeper than" in run_cli(
        ["accelpact_slurm.cli.status", d, "--no-slurm"], timeout=120).stdout


def _no_constants(name):
    raise AssertionError(f"invalid JSON constant {name}")


def test_status_json_stays_valid_json_with_non_finite_numbers(tmp_path, capsys):
    # Python's json writes and reads NaN and Infinity; a diverged loss is NaN.
    d = _write_events(tmp_path / "77", [
        {"ts": 1.0, "event": "step", "step": 1, "loss": float("nan"), "step_s": float("nan")},
        {"ts": 2.0, "event": "step", "step": 2, "loss": float("inf"), "step_s": 1.0},
        {"ts": 3.0, "event": "repair", "generation": 1, "frontier": 2, "total_s": float("inf"),
         "phases": {"agree": float("nan"), "rebind": 0.1}},
        {"ts": 4.0, "event": "fail_stop", "reason": "loss diverged", "exit_code": 75, "frontier": float("-inf"),
         "decision_s": float("nan")},
        {"ts": 5.0, "event": "job_end", "final_step": 2, "final_loss": float("nan"), "exit_code": 0},
    ])
    with open(os.path.join(d, "summary.json"), "w") as fh:
        json.dump({"final_step": 2, "final_loss": float("nan"), "wall_s": float("inf"), "exit_code": 0}, fh)
    assert status_cli.main([d, "--json", "--no-slurm"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out, parse_constant=_no_constants)
    json.dumps(doc, allow_nan=False)
    (job,) = doc["jobs"]
    assert job["final"]["final_loss"] is None and job["final"]["wall_s"] is None
    # -inf is no frontier: the stop gets the newest update the log committed before it
    assert (job["l2"]["fail_stops"][0]["frontier"], job["l2"]["fail_stops"][0]["frontier_source"]) == (2, "log")
    assert status_cli.main([d, "--no-slurm"]) == 0  # the table still shows what it can
    assert "loss nan" in capsys.readouterr().out


def test_status_prints_control_characters_escaped(tmp_path, capsys):
    d = _write_events(tmp_path / "77", [
        {"ts": 1.0, "event": "step", "step": 1, "job_id": "77\x1b]0;pwned\x07"},
        {"ts": 2.0, "event": "fail_stop", "reason": "\x1b[2J\x1b[Hall good\nWARNING forged line", "exit_code": 75,
         "phase": "fwd\x9b31m"},
        {"ts": 3.0, "event": "requeue", "reason": "bell\x07", "by": "rtl\u202eevil"},
    ])
    idx = os.path.join(d, "ckpt-index")
    os.makedirs(idx)
    json.dump({"node": "n\x1b[1m1", "snapshots": [{"step": 1, "state": "verified\x1b[0m", "reason": "r\r"}]},
              open(os.path.join(idx, "n1.json"), "w"))
    for argv in ([d, "--no-slurm"], ["--no-slurm", "--runs-root", str(tmp_path)]):  # detail and list
        assert status_cli.main(argv) == 0
        out = capsys.readouterr().out
        assert not [c for c in out if not c.isprintable() and c != "\n"], repr(out)
    assert status_cli.main([d, "--no-slurm"]) == 0
    out = capsys.readouterr().out
    assert "\\x1b[2J\\x1b[Hall good\\nWARNING forged line" in out and "\\u202e" in out
    assert not any(line.lstrip().startswith("WARNING forged") for line in out.splitlines())


def test_cadence_skips_a_huge_elapsed_and_an_infinite_ts_as_bad_lines(tmp_path, capsys):
    sacct = tmp_path / "sacct.txt"
    sacct.write_text("JobID|State|ExitCode|Start|End|NodeList|Elapsed\n"
                     f"5|FAILED|1:0|2024-01-01T00:00:00|2024-01-01T01:00:00|n1|{'9' * 400}-00:00:00\n"
                     "6|FAILED|1:0|2024-01-01T00:00:00|2024-01-01T01:00:00|n1|99-99:99:99.5\n"
                     "7|NODE_FAIL|1:0|2024-01-01T00:00:00|2024-01-01T01:00:00|n1|01:00:00\n")
    events = tmp_path / "events.jsonl"
    events.write_text('{"ts": 1e400, "event": "step", "job_id": "7", "step": 1}\n'
                      '{"ts": 10.0, "event": "step", "job_id": "7", "step": 1, "step_s": 2.0}\n')
    rc = cad_cli.main(["--sacct", str(sacct), "--events", str(events), "--checkpoint-cost-s", "5", "--json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    # one node failure in an hour is too little to recommend from: the only thing missing
    assert rc == 2 and [m.split(":")[0] for m in doc["missing"]] == ["observed time"], captured.out
    assert [(os.path.basename(b["path"]), b["lineno"]) for b in doc["bad_lines"]] == [
        ("sacct.txt", 2), ("sacct.txt", 3), ("events.jsonl", 1)]
    assert doc["observed_s"] == 3600.0 and doc["classes"]["node_fail"]["count"] == 1
    assert captured.err.count("skipped") == 3
    assert cad_cli.main(["--sacct", str(sacct), "--events", str(events), "--checkpoint-cost-s", "5"]) == 2
    assert "3 bad line(s) skipped" in capsys.readouterr().out


# --------------------------------------------------------------------------- a rank on a node without the train extra


_BLOCK_AND_RUN = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = sys.argv.pop(1)
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == BLOCKED or name.startswith(BLOCKED + "."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.modules.pop(BLOCKED, None)
    sys.meta_path.insert(0, Block())
    if sys.argv[1] == "--check":
        from accelpact_slurm.runtime.job.entry import check_dependencies
        check_dependencies()
        print("ok")
    else:
        from accelpact_slurm.cli.worker import main
        sys.exit(main(sys.argv[1:]))
""")


def _task_env():
    """The environment of one srun task of a 2x2 job (rank 1), running this checkout."""
    with open(os.path.join(DATA, "slurm_env", "srun_2x2.json")) as fh:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(json.load(fh))
    env.update(PATH=os.environ["PATH"], HOME=os.environ.get("HOME", "/tmp"), PYTHONPATH=REPO)
    return env


@pytest.mark.parametrize("blocked", ["numpy", "torch", "torch.distributed.checkpoint"])
@pytest.mark.slow
def test_run_without_a_runtime_dependency_exits_2_before_joining(tmp_path, blocked):
    # Before: numpy was first needed at the first snapshot, after the training it cost; torch was a traceback.
    job = tmp_path / "job.yaml"
    job.write_text("entry: no_such_module_for_this_test:main\nsteps: 3\n")
    proc = subprocess.run([sys.executable, "-c", _BLOCK_AND_RUN, blocked, str(job), "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120, env=_task_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("accelpact_slurm.cli.worker: error: dependencies:")
    assert repr(blocked) in lines[0] and "pip install 'accelpact-slurm[train]'" in lines[0]


@pytest.mark.parametrize("blocked, ok", [("numpy", False), ("no_such_module_anyone_needs", True)])
@pytest.mark.slow
def test_check_dependencies_alone(blocked, ok):
    proc = subprocess.run([sys.executable, "-c", _BLOCK_AND_RUN, blocked, "--check"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    else:
        assert proc.returncode == 1 and "ConfigError: dependencies: invalid value 'numpy'" in proc.stderr


# --------------------------------------------------------------------------- accelpact-status tells the truth

#: A real run directory (events and node indexes): the vision example under FSDP1 with BatchNorm, a forward fault
#: at update 10; each relaunch crashed in its restore (``Missing key in checkpoint state_dict``) before deciding
#: anything, and the launcher of the time wrote its stops with no frontier and no cause.
RESTORE_CRASH = os.path.join(DATA, "run-restore-crash")


def _status_text(run_dir, capsys) -> str:
    assert status_cli.main([str(run_dir), "--no-slurm"]) == 0
    return capsys.readouterr().out


def test_status_of_a_real_restore_crash_agrees_with_itself(capsys):
    """Each node's index line once, and every stop with a frontier (no ``None``).

    Negative control: reading ``<node>.committed.json`` as an index (the filter in ``ops/status.py`` without
    ``COMMITTED_SUFFIX``) prints ``node1: no snapshots`` directly above ``node1: verified 1``; without the log's
    frontier the relaunches' stops read ``frontier None``.
    """
    out = _status_text(RESTORE_CRASH, capsys)
    index_lines = [line.split()[0] for line in out.splitlines() if "index updated" in line]
    assert index_lines == ["node1:", "node2:"], out
    assert "no snapshots;" not in out
    assert "None" not in out, out
    assert out.count("frontier 9: the log's newest committed update before it") == 2, out
    assert "(exit 75, phase forward, frontier 9)" in out


def _stop(restart, rank, cause, reason, frontier=None, ts=100.0, **extra):
    return {"ts": ts, "event": "fail_stop", "restart": restart, "rank": rank, "cause": cause, "reason": reason,
            "exit_code": 75, "phase": "start", "frontier": frontier, **extra}


def test_status_names_each_stops_own_cause_and_reason(tmp_path, capsys):
    """A restore that fails writes its ``fail_stop`` with its cause ("no snapshot can be restored: ..."): status
    shows that text, and every other distinct cause and reason of the same start, never the launcher's guess; a
    stop before any committed update says so.

    Negative control: the old fold (the first ``fail_stop`` of a start, whoever wrote it, and nothing else) shows
    the launcher's "every rank ended without a decision" for start 1 and drops rank 3's own reason; the old
    restart line said "run 1 loaded step None" and named no skipped snapshot.
    """
    recs = [{"ts": 1.0 + i, "event": "step", "restart": 0, "rank": 0, "step": i} for i in range(1, 14)]
    recs += [_stop(0, r, "link", "fault in uncommitted compute (forward)", frontier=13, ts=20.0) for r in range(4)]
    recs += [_stop(1, None, "launcher", "every rank ended without a decision (exit codes [1, 1, 1, 1]): killed, "
                   "or crashed", ts=30.0, by="launcher")]
    recs += [_stop(1, r, "checkpoint", "no snapshot can be restored: step 10: missing key model.bn.running_mean",
                   ts=31.0) for r in range(3)]
    recs += [_stop(1, 3, "dead-rank", "rank 2 (node 1) died during the restore", ts=31.5)]
    recs += [{"ts": 30.5, "event": "restart_load", "restart": 1, "rank": 0, "step": None,
              "reason": "every candidate was rejected", "skipped": [
                  {"step": 10, "reason": "cannot be restored: missing key model.bn.running_mean"},
                  {"step": 5, "reason": "cannot be restored: missing key model.bn.running_mean"}]}]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("".join(json.dumps({"job_id": "9", **r}) + "\n" for r in recs))
    out = _status_text(run_dir, capsys)
    run1 = next(line for line in out.splitlines() if "run 1: " in line)
    assert "fail-stop (checkpoint) 'no snapshot can be restored: step 10: missing key model.bn.running_mean'" in run1
    assert "also (dead-rank) 'rank 2 (node 1) died during the restore'" in run1
    assert "also (launcher) 'every rank ended without a decision" in run1  # kept, after the ranks' own words
    assert "frontier 13: the log's newest committed update before it" in run1
    assert "last stop     start 1: checkpoint (exit 75): no snapshot can be restored" in out
    run0 = next(line for line in out.splitlines() if "run 0: " in line)
    assert run0.endswith("run 1 loaded no snapshot: every candidate was rejected, skipped step 10: cannot be "
                         "restored: missing key model.bn.running_mean, skipped step 5: cannot be restored: missing "
                         "key model.bn.running_mean"), run0

    (run_dir / "events.jsonl").write_text(json.dumps({"job_id": "9", **_stop(0, 0, "config", "bad key")}) + "\n")
    out = _status_text(run_dir, capsys)
    assert "phase start, before any committed update)" in out and "None" not in out


def test_status_rounds_every_time_it_shows(tmp_path, capsys):
    """``wall 20.608336156000405 s`` was the summary's float as written.

    Negative control: the old ``f"wall {f.get('wall_s')} s"`` prints every digit.
    """
    run_dir = tmp_path / "run"
    shutil.copytree(RUN, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(wall_s=20.608336156000405, final_loss=4.09429144859314)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    out = _status_text(run_dir, capsys)
    final = next(line for line in out.splitlines() if line.strip().startswith("final"))
    assert "wall 20.6 s" in final and "loss 4.09429," in final, final
    digits = [n for n in re.findall(r"\d+\.\d+", out.replace("4.09429", "")) if len(n.replace(".", "").lstrip("0")) > 4]
    assert digits == [], out  # no time anywhere with more than 4 significant digits


#: The event log of a real uninterrupted run of the decoder example (25 updates, about 15 s, no fault).
UNINTERRUPTED = os.path.join(DATA, "run-uninterrupted")


def test_cadence_refuses_to_recommend_from_one_short_uninterrupted_run(tmp_path, capsys):
    """One 15 s run without an interruption: nothing recommended, ``--write`` leaves the job file byte for byte,
    and the output says how much observed time the bound needs.

    Negative control: without the evidence gate (``cadence_analysis.analyse``) it recommended
    ``checkpoint.every_steps = 4`` and "L1 off" from this log and ``--write`` wrote it.
    """
    job = tmp_path / "job.yaml"
    shutil.copy(os.path.join(REPO, "examples", "decoder", "job.yaml"), job)
    before = job.read_bytes()
    assert cad_cli.main(["--events", UNINTERRUPTED, "--write", str(job), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert job.read_bytes() == before
    rec = doc["recommendation"]
    assert (rec["every_steps"], rec["interval_s"], rec["use_l1"]) == (None, None, None)
    assert doc["write"] == {"path": str(job), "error": "not enough observed time: nothing written"}
    proof = rec["evidence"]
    assert proof["enough"] is False and proof["needed_count"] == 0
    assert proof["needed_s"] > 60 * doc["observed_s"]  # minutes, against the run's seconds
    assert cad_cli.main(["--events", UNINTERRUPTED]) == 2
    out = capsys.readouterr().out
    assert "Recommendation: none" in out and "checkpoint.every_steps =" not in out and "L1 off" not in out
    assert "missing: observed time: not enough observed time" in out and "observed without one" in out
    # The same log with a week of observed time (--observed-s) is enough.
    assert cad_cli.main(["--events", UNINTERRUPTED, "--observed-s", str(7 * 86400), "--write", str(job)]) == 0
    assert job.read_bytes() != before


def test_status_never_prints_none_for_a_field_the_log_lacks(tmp_path, capsys):
    """Events that hold only their kind (a log from an older release, a line cut short): every field shows ``-``.

    Negative control: the fields printed as they came (``generation None, frontier None``, ``exit None``,
    ``requeue 'None'``, ``loss None``) fail it.
    """
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recs = [{"ts": 1.0, "event": "repair", "restart": 0}, {"ts": 2.0, "event": "fail_stop", "restart": 0},
            {"ts": 3.0, "event": "requeue", "restart": 0}, {"ts": 4.0, "event": "job_end", "restart": 1}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = _status_text(run_dir, capsys)
    assert "None" not in out, out
    assert "generation -, frontier -" in out and "exit -" in out and "requeue '-'" in out and "loss -" in out, out
