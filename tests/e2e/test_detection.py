"""The fault detector end to end on the embedded default (2 emulated nodes x 2 ranks, real Gloo, real signals).

Every fault here is real: a rank killed with SIGKILL, a rank stopped with SIGSTOP, a rank made slow, a rank of
a script with a bug in it (link faults: ``test_l1_repair.py``).  Each test has its negative control: the same
fault with the detector off (``ACCELPACT_TEST_NO_DETECTOR=1``: every wait blind, as before) ends the way the
timers decide, and a bug is restarted like a fault (``ACCELPACT_TEST_BUG_RESTARTS=1``).

The oracle of a run that recovers is an uninterrupted run's ``final_state_digest``.  The runs are shared between
assertions through a module fixture.  The timeouts are the shipped defaults but for ``collective_s`` and
``control_s``, raised to show that nothing waits for them, and ``heartbeat_s``, lowered to keep the hung-rank
runs short.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import pytest

from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_USAGE
from accelpact_slurm.core.events import read_events
from tests.conftest import REPO, decoder_text, run_cli

pytestmark = pytest.mark.multiproc

STEPS = 14
COLLECTIVE_S = 8.0
BLIND_COLLECTIVE_S = 3.0
HEARTBEAT_S = 3.0
BUGGY = os.path.join(REPO, "tests", "data", "buggy_train.py")


def job(tmp: Path, name: str, *, max_restarts: int = 2, entry: str | None = None, blind: bool = False) -> str:
    """The decoder job; ``blind``: short timers, for the negative controls that wait them out."""
    collective, control, shutdown = (BLIND_COLLECTIVE_S, 6, 2) if blind else (COLLECTIVE_S, 40, 10)
    text = decoder_text().replace("steps: 25", f"steps: {STEPS}").replace("every_steps: 10", "every_steps: 5")
    text = text.replace("collective_s: 5", f"collective_s: {collective:g}").replace("control_s: 30",
                                                                                 f"control_s: {control}")
    text = text.replace("shutdown_s: 10", f"shutdown_s: {shutdown}\n  heartbeat_s: {HEARTBEAT_S:g}\n"
                                          f"  heartbeat_interval_s: 0.25")
    text = text.replace("max_restarts: 20", f"max_restarts: {max_restarts}")
    if entry:
        text = "\n".join(f"entry: {entry}" if line.startswith("entry:") else line for line in text.splitlines())
    path = tmp / f"{name}.yaml"
    path.write_text(text + "\n")
    return str(path)


def run(tmp: Path, name: str, config: str, *faults: str, env: dict | None = None):
    run_dir = tmp / name
    args = ["accelpact_slurm.cli.run", config, "--run-dir", str(run_dir)]
    for f in faults:
        args += ["--inject-fault", f]
    proc = run_cli(args, env=env, timeout=420)
    events = list(read_events(run_dir / "events.jsonl")) if (run_dir / "events.jsonl").exists() else []
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else None
    return {"proc": proc, "events": events, "summary": summary, "dir": run_dir}


def of(r, kind, **match):
    return [e for e in r["events"] if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]


def starts(r):
    return sorted({e["restart"] for e in of(r, "job_start")})


def log(r, rank: int) -> str:
    return (r["dir"] / "logs" / f"rank-{rank}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run, in two lanes side by side (each run is 4 ranks and 2 daemons; the machine may have two cores):
    the runs that train and time (the reference, the dead, hung and slow ranks) in one, and in the other the runs
    that mostly wait (the blind negative controls wait out their timers) or end at once (the bugs)."""
    tmp = tmp_path_factory.mktemp("detection")
    plain = job(tmp, "plain")
    blind = {"ACCELPACT_TEST_NO_DETECTOR": "1"}
    buggy = job(tmp, "buggy", entry=f"{BUGGY}:main")
    lanes = (
        {"reference": (plain, {}),
         "dead": (plain, {"ACCELPACT_TEST_CRASH_AT": "8:3"}),
         "hung": (plain, {"ACCELPACT_TEST_HANG_AT": "8:3"}),
         "straggler": (plain, {"ACCELPACT_TEST_SLOW_AT": "8:1:3x"})},
        {"hung_blind": (job(tmp, "once_hung", max_restarts=0, blind=True), {**blind, "ACCELPACT_TEST_HANG_AT": "8:3"}),
         "dead_blind": (job(tmp, "once", max_restarts=0, blind=True), {**blind, "ACCELPACT_TEST_CRASH_AT": "8:3"}),
         "bug": (buggy, {"BUGGY_AT": "3:1"}),
         "bug_restarts": (job(tmp, "buggy_once", max_restarts=1, entry=f"{BUGGY}:main"),
                          {"BUGGY_AT": "3:1", "ACCELPACT_TEST_BUG_RESTARTS": "1"}),
         "bug_import": (buggy, {"BUGGY_IMPORT": "raise"}),
         "bug_dependency": (buggy, {"BUGGY_IMPORT": "dependency"})},
    )

    def lane(runs: dict) -> dict:
        return {name: run(tmp, name, config, env=env) for name, (config, env) in runs.items()}

    with concurrent.futures.ThreadPoolExecutor(len(lanes)) as pool:
        done = [pool.submit(lane, runs) for runs in lanes]
        return {name: r for f in done for name, r in f.result(timeout=900).items()}


def ok(r):
    assert r["proc"].returncode == 0, r["proc"].stdout[-3000:] + r["proc"].stderr[-3000:]
    return r["summary"]


# ------------------------------------------------------------------ a dead rank


def test_a_dead_rank_is_named_by_every_survivor_and_the_restart_resumes_bitwise(runs):
    r, ref = runs["dead"], ok(runs["reference"])
    s = ok(r)
    stops = of(r, "fail_stop", restart=0)
    assert sorted(e["rank"] for e in stops) == [0, 1, 2]
    assert all(e["cause"] == "dead-rank" and e["culprit"] == 3 and e["exit_code"] == 75 for e in stops), stops
    assert all("rank 3 (node 1) died" in e["reason"] for e in stops)
    assert starts(r) == [0, 1] and s["final_state_digest"] == ref["final_state_digest"]
    # the restart's first snapshot skips the capture proof: this job proved the same plans at its first start
    first = [e for e in of(r, "snapshot") if "capture_proof" in e]
    assert [e["restart"] for e in first] == [0, 1]
    assert "proven earlier" not in first[0]["capture_proof"] and "proven earlier" in first[1]["capture_proof"]


def test_negative_control_blind_nobody_names_the_dead_rank(runs):
    r = runs["dead_blind"]
    assert r["proc"].returncode == 75
    stops = of(r, "fail_stop", restart=0)
    assert not [e for e in stops if e.get("cause") == "dead-rank"], stops
    assert stops, "every start ends with an event that says why"  # the launcher's, or a control-plane timeout


# ------------------------------------------------------------------ a hung rank


def test_a_hung_rank_is_named_its_stacks_dumped_into_its_log_and_the_job_resumes(runs):
    r, ref = runs["hung"], ok(runs["reference"])
    s = ok(r)
    stops = [e for e in of(r, "fail_stop", restart=0) if e["rank"] != 3]
    assert sorted(e["rank"] for e in stops) == [0, 1, 2]
    assert all(e["cause"] == "hung-rank" and e["culprit"] == 3 for e in stops), stops
    assert all("no heartbeat for" in e["reason"] for e in stops)
    assert any(e.get("hung_rank_ended") for e in stops)  # its node peer dumped its stacks and killed it
    text = log(r, 3)
    assert "Thread 0x" in text and "most recent call first" in text and "api.py" in text, text[-2000:]
    assert starts(r) == [0, 1] and s["final_state_digest"] == ref["final_state_digest"]


def test_negative_control_blind_the_hung_rank_is_never_named(runs):
    r = runs["hung_blind"]
    assert r["proc"].returncode != 0
    assert not [e for e in of(r, "fail_stop") if e.get("cause") == "hung-rank"]
    assert "most recent call first" in log(r, 3)  # the launcher's own dump before it kills what is left


# ------------------------------------------------------------------ a straggler


def test_a_straggler_three_times_the_learned_bound_causes_no_repair_and_no_restart(runs):
    r, ref = runs["straggler"], ok(runs["reference"])
    s = ok(r)
    assert not of(r, "repair") and not of(r, "fail_stop") and starts(r) == [0]
    det = {e["rank"]: e for e in of(r, "detector")}
    assert sorted(det) == [0, 1, 2, 3] and not any(d["verdicts"] for d in det.values())
    # its peers waited on it far past the bound they learned, and did nothing
    waited = max(d["longest_wait_s"] / max(d["bounds_s"].values()) for r_, d in det.items() if r_ != 1)
    assert waited >= 2.0, det
    assert s["final_state_digest"] == ref["final_state_digest"]


# ------------------------------------------------------------------ a bug is a bug


def test_a_bug_stops_the_job_at_once_with_its_traceback_and_is_not_requeued(runs):
    r = runs["bug"]
    assert r["proc"].returncode == EXIT_NO_REQUEUE, r["proc"].stdout[-3000:]
    assert starts(r) == [0]
    stops = of(r, "fail_stop")
    assert sorted(e["rank"] for e in stops) == [0, 1, 2, 3]
    assert all(e["cause"] == "training-code" and e["exit_code"] == EXIT_NO_REQUEUE for e in stops)
    (mine,) = [e for e in stops if e["rank"] == 1]
    exc = mine["exception"]
    assert exc["type"] == "ValueError" and exc["file"].endswith("buggy_train.py") and exc["line"] > 0
    assert "Traceback (most recent call last)" in exc["traceback"] and "ValueError" in exc["traceback"]
    assert "buggy_train.py" in log(r, 1) and "Traceback (most recent call last)" in log(r, 1)
    assert "ValueError" in r["proc"].stdout and "not requeued" in r["proc"].stdout


def test_negative_control_a_bug_treated_as_a_fault_is_restarted(runs):
    r = runs["bug_restarts"]
    assert starts(r) == [0, 1], r["proc"].stdout[-2000:]


def test_an_entry_module_that_raises_while_imported_stops_once_with_its_traceback(runs):
    r = runs["bug_import"]
    assert r["proc"].returncode == EXIT_NO_REQUEUE and "relaunching" not in r["proc"].stdout
    stops = of(r, "fail_stop")
    assert sorted(e["rank"] for e in stops) == [0, 1, 2, 3]
    assert all(e["cause"] == "training-code" and e["phase"] == "import" for e in stops)
    assert "RuntimeError" in log(r, 2) and "Traceback (most recent call last)" in log(r, 2)


def test_an_entry_whose_dependency_is_missing_names_the_dependency(runs):
    r = runs["bug_dependency"]
    assert r["proc"].returncode == EXIT_USAGE and "relaunching" not in r["proc"].stdout
    (stop, *_), = [of(r, "fail_stop", rank=0)]
    assert stop["cause"] == "config" and "accelpact_no_such_dependency" in stop["reason"]
    assert "next to the job file" not in stop["reason"]
    assert "ModuleNotFoundError" in log(r, 0)


def test_status_shows_why_each_start_ended_in_one_line(runs):
    for name, cause in (("bug", "training-code"), ("hung", "completed"), ("dead_blind", None)):
        proc = run_cli(["accelpact_slurm.cli.status", "--json", str(runs[name]["dir"])])
        assert proc.returncode == 0, proc.stderr
        (info,) = json.loads(proc.stdout)["jobs"]
        assert info["last_stop"]["line"].count("\n") == 0
        if cause is not None:
            assert info["last_stop"]["cause"] == cause, info["last_stop"]
    proc = run_cli(["accelpact_slurm.cli.status", str(runs["bug"]["dir"])])
    line = next(l for l in proc.stdout.splitlines() if "last stop" in l)
    assert "training-code (exit 76)" in line and "ValueError" in line
