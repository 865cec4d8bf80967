"""L1 Preserve end to end on the embedded default: 2 emulated nodes x 2 ranks, real Gloo faults.

A fault is real: the chosen rank withholds its part of the replication collective (it leaves it), or stays in
it while its part never arrives (a stalled link); its peers' fault detector gives the collective up, long
before Gloo's own timeout (8 s here, so that a test that waited for it would show).  The oracle is the
uninterrupted run's ``final_state_digest`` (weights, both AdamW moments, step counter, cursor, every rank's RNG)
and its per-step losses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from accelpact_slurm.core.errors import EXIT_REQUEUE
from accelpact_slurm.core.events import read_events
from tests.conftest import decoder_text, run_cli

pytestmark = pytest.mark.multiproc

STEPS = 25
LAYERS = 4
COLLECTIVE_S = 8.0


def make_config(tmp_path: Path, fsdp="fsdp1", mesh="device_mesh", steps=STEPS) -> str:
    text = decoder_text()
    text = text.replace("fsdp: fsdp1 ", f"fsdp: {fsdp} ").replace("mesh: device_mesh ", f"mesh: {mesh} ")
    text = text.replace("steps: 25", f"steps: {steps}").replace("collective_s: 5", f"collective_s: {COLLECTIVE_S:g}")
    # One start: these tests look at the fail-stop itself, not at the launcher's relaunch (L2 tests do).
    text = text.replace("max_restarts: 20", "max_restarts: 0")
    path = tmp_path / f"{fsdp}-{mesh}.yaml"
    path.write_text(text)
    return str(path)


def run(tmp_path: Path, name: str, config: str, *faults: str, env=None):
    run_dir = tmp_path / name
    args = ["accelpact_slurm.cli.run", config, "--run-dir", str(run_dir)]
    for f in faults:
        args += ["--inject-fault", f]
    proc = run_cli(args, env=env)
    events = list(read_events(run_dir / "events.jsonl"))
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, events, summary


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("baseline")
    proc, _, summary = run(tmp, "base", make_config(tmp))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return summary


@pytest.mark.parametrize("fsdp, mesh", [("fsdp1", "device_mesh"), ("fsdp1", "group_pair"), ("fsdp2", "device_mesh")])
def test_boundary_and_backward_faults_are_repaired_in_process_bitwise(baseline, tmp_path, fsdp, mesh):
    """One run per wrapping, four faults.  At the boundary after update 5 rank 2 stays in the guard's replication
    all-reduce while its part never arrives (a stalled link: every member waits inside it), and at the boundary
    after update 10 rank 1 withholds its part: each time the replication group is replaced and rebound, and the
    next update steps on the gradients it has (zero replay).  In update 16 rank 1 withholds every replication
    all-reduce of the backward, and in update 21 rank 3's first one stalls: every rank votes before stepping,
    discards the update, replaces every group, and runs it again from its batch and RNG states.  Every fault is
    given up by the detector, far sooner than the collective timeout; the run ends in the uninterrupted state."""
    proc, events, summary = run(tmp_path, "run", make_config(tmp_path, fsdp, mesh), "boundary-stuck:5:2",
                                "boundary:10:1", "backward:16:1", "backward-stuck:21:3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stuck, boundary, backward, stuck_backward = [e for e in events if e["event"] == "repair"]
    assert (stuck["scope"], stuck["frontier"], stuck["ranks"]) == ("replicate", 5, [0, 2])
    assert (boundary["scope"], boundary["frontier"], boundary["ranks"], boundary["generation"]) == \
        ("replicate", 10, [1, 3], 2)
    assert boundary["replayed_updates"] == 0
    if not boundary.get("reconfigured"):  # a group reconfigured in place keeps its references: nothing to walk
        # Each affected rank saw the fault, walked the framework's objects for the invariant while its vote was in
        # flight, and read that walk's finds back after the rebinding instead of walking again.
        for rep in (stuck, boundary):
            parts = [e.get("parts_s") or {} for e in events if e["event"] == "repair_rank"
                     and e["generation"] == rep["generation"] and e["rank"] in rep["ranks"]]
            assert len(parts) == 2 and all("rebind.walk_ahead" in p for p in parts), parts
    assert set(boundary["phases"]) == {"observe", "guard_sync", "control_barrier", "replace", "rebind", "validate"}
    if (fsdp, mesh) == ("fsdp1", "group_pair"):
        # two slots per FSDP unit, plus the job's mesh (whose groups the explicit pair came from)
        assert boundary["rebound_by_kind"]["fsdp1"] == 2 * (LAYERS + 1) and boundary["rebound"] == 2 * (LAYERS + 1) + 1
    assert (backward["scope"], backward["frontier"], backward["discarded_update"], backward["replayed_updates"]) == \
        ("update", 15, 16, 1)
    assert set(backward["phases"]) == {"observe", "discard", "guard_sync", "control_barrier", "replace_all",
                                       "validate_all"}
    assert backward["ranks"] == [0, 1, 2, 3] and backward["rebound"] > boundary["rebound"]
    assert (stuck_backward["scope"], stuck_backward["discarded_update"]) == ("update", 21)
    faults = [e for e in events if e["event"] == "fault"]
    assert {e["step"] for e in faults} == {6, 11, 16, 21} and "backward" in {e["phase"] for e in faults if e["step"] == 16}
    # The detector decided, not the collective timeout: the peers gave the collectives up.
    peers = [e["error"] for e in faults if "injected" not in e["error"] and "withheld" not in e["error"]]
    assert peers and all("given up" in err for err in peers), peers
    assert any("broken link" in err for err in peers) and any("left collective" in err for err in peers)
    # The stalled backward all-reduce of update 21: the rank that gave it up first posted the job's notice, and
    # ranks outside that collective gave theirs up on it, not one group at a time (negative control: without
    # Detector._post_notice no error names the notice).
    assert any("every rank meets it in the vote" in e["error"] for e in faults if e["step"] == 21), \
        [e["error"] for e in faults if e["step"] == 21]
    assert all(isinstance(e.get("detected_ts"), float) and e["detected_ts"] <= e["ts"] for e in faults
               if "given up" in e["error"])
    assert all(e["fault_to_resume_s"] < COLLECTIVE_S / 2 for e in (stuck, boundary, backward, stuck_backward))
    # Every update committed exactly once, and the run ends in the uninterrupted state.
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, STEPS + 1))
    assert summary["losses"] == baseline["losses"]
    assert summary["final_state_digest"] == baseline["final_state_digest"]
    assert not [e for e in events if e["event"] in ("fail_stop", "restart_load")]
    if (fsdp, mesh) == ("fsdp1", "device_mesh"):
        operator_tools_read(tmp_path / "run")
    # Snapshots every 10 updates (two here, the capture proof, the final digest): on a group pair's ShardedTensors
    # each state-dict call of the project's made torch warn about its own deprecations, on every rank.  Negative
    # control: without quiet_state_dict_calls around those calls the group-pair run's output holds all of them.
    assert [e for e in events if e["event"] == "checkpoint" and e["state"] == "verified"]
    assert_no_torch_state_dict_warnings(proc, tmp_path / "run")
    assert "no snapshots are taken" not in proc.stdout  # snapshots on: no start-up warning about them


def assert_no_torch_state_dict_warnings(proc, run_dir: Path) -> None:
    """None of the torch warnings the project silences around its own state-dict calls in a job's output."""
    from accelpact_slurm.core.torch_warnings import TORCH_STATE_DICT_WARNINGS

    texts = {"stdout": proc.stdout, "stderr": proc.stderr}
    texts.update({p.name: p.read_text() for p in sorted((run_dir / "logs").glob("rank-*.log"))})
    assert len(texts) == 6
    import re

    found = {(where, message) for where, text in texts.items() for message, _ in TORCH_STATE_DICT_WARNINGS
             if re.search(message, text)}
    assert found == set(), sorted(found)


def test_negative_control_blind_the_same_fault_waits_out_the_collective_timeout(baseline, tmp_path):
    """The detector off (``ACCELPACT_TEST_NO_DETECTOR=1``, every wait blind, as before it): rank 1's peers wait in
    the boundary's all-reduce until Gloo's timeout (3 s here) says it failed; the repair is the same."""
    config = make_config(tmp_path, steps=14)
    Path(config).write_text(Path(config).read_text().replace(f"collective_s: {COLLECTIVE_S:g}", "collective_s: 3"))
    proc, events, summary = run(tmp_path, "run", config, "boundary:10:1", env={"ACCELPACT_TEST_NO_DETECTOR": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    (repair,) = [e for e in events if e["event"] == "repair"]
    assert repair["fault_to_resume_s"] >= 3 * 0.9, repair
    assert not any("given up" in e["error"] for e in events if e["event"] == "fault")


def snapshots_off_warned_once_and_log_lines_carry_the_rank(proc, events, run_dir: Path) -> None:
    """A job without snapshots says so once as it starts (rank 0's line, one ``warning`` event), naming the field
    to set; and every line of the log records a rank prints (here: its repairs' warnings) starts ``[rank R] ``.
    Negative controls: before, the job took no snapshot and said nothing, and the records carried no rank."""
    import re

    told = [re.sub(r"^ *\d+: ", "", line, count=1)  # rank 0's lines, labelled "0: " on the terminal
            for line in proc.stdout.splitlines() if "no snapshots are taken" in line]
    assert len(told) == 1 and told[0].startswith("[accelpact] warning: ") and "checkpoint.every_steps" in told[0], \
        proc.stdout[-3000:]
    (warning,) = [e for e in events if e["event"] == "warning" and "no snapshots are taken" in e["reason"]]
    assert warning["rank"] == 0 and "checkpoint.every_steps" in warning["reason"]
    assert events.index(warning) < next(i for i, e in enumerate(events) if e["event"] == "step")
    record = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
    for rank in range(4):
        lines = (run_dir / "logs" / f"rank-{rank}.log").read_text().splitlines()
        records = [line for line in lines if record.search(line)]
        assert records, f"rank {rank} logged nothing: the check proves nothing"
        assert [line for line in records if not line.startswith(f"[rank {rank}] ")] == []


def operator_tools_read(run_dir: Path) -> None:
    """accelpact-status and accelpact-cadence on the run directory this test produced."""
    proc = run_cli(["accelpact_slurm.cli.status", "--json", str(run_dir)])
    assert proc.returncode == 0, proc.stderr
    (job,) = json.loads(proc.stdout)["jobs"]
    assert job["state"] == "COMPLETED" and job["frontier"]["step"] == STEPS
    assert job["l1"]["count"] == 4 and set(job["l1"]["last"]["phases"]) >= {"discard", "replace_all", "validate_all"}
    assert job["restarts"] == 0 and job["l2"]["count"] == 0
    # The checkpoint age a repair saves is given (50 updates): taken from this run's own short interval it is about
    # one update, an L1 repair then saves nothing, and the decision would rest on the restart rate the four repairs
    # imply without L1 (four in seconds: enough evidence), or on the rate with L1 (none seen), by a hair.
    proc = run_cli(["accelpact_slurm.cli.cadence", "--events", str(run_dir), "--json", "--restart-cost-s", "30",
                    "--age-steps", "50"])
    # With L1 on, seconds of one run without a restart are too little observed time to recommend from (the rate
    # bound leaves more than 1% of goodput at stake): the tool refuses, exit 2, saying how much it needs, and still
    # reports what it measured.
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["recommendation"]["every_steps"] is None and doc["write"] is None
    assert "not enough observed time" in doc["recommendation"]["evidence"]["reason"]
    assert doc["delta_t"]["saved_per_event_s"] > 0
    costs = doc["costs"]
    # Not given on the command line: measured from this run's events (snapshot blocking time, step time).
    for name in ("checkpoint_cost_s", "step_time_s"):
        assert costs[name]["value"] > 0 and "flag" not in costs[name]["source"], costs[name]


def test_negative_control_without_rebinding_the_next_update_runs_into_the_retired_group(tmp_path):
    """Without rebinding, FSDP keeps the retired replication group after the boundary repair at F=15, where the
    peer that gave the boundary's all-reduce up still has its part of it pending: update 16's backward all-reduce
    on that group meets it, Gloo aborts the process, and the job cannot go on in process (it fail-stops on the
    dead rank).  With rebinding, the same fault is repaired and the run completes (the test above)."""
    proc, events, summary = run(tmp_path, "run", make_config(tmp_path), "boundary:15:1",
                                env={"ACCELPACT_TEST_SKIP_REBIND": "1"})
    first, *rest = [e for e in events if e["event"] == "repair"]
    assert first["scope"] == "replicate" and first["rebound"] == 0
    assert proc.returncode == EXIT_REQUEUE and summary is None, proc.stdout[-3000:]
    assert not [e for e in events if e["event"] == "step" and e["step"] >= 17]
    stops = [e for e in events if e["event"] == "fail_stop"]
    assert stops and all(e["cause"] in ("dead-rank", "link") for e in stops), stops


def test_frontier_disagreement_fails_stop_naming_both_frontiers(tmp_path):
    proc, events, summary = run(tmp_path, "run", make_config(tmp_path, steps=8), env={
        "ACCELPACT_TEST_FRONTIER_SKEW": "2:5"})
    assert proc.returncode == EXIT_REQUEUE
    stops = [e for e in events if e["event"] == "fail_stop"]
    assert sorted(e["rank"] for e in stops) == [0, 1, 2, 3]
    for e in stops:  # the vote of update 5, before any step: F=4, and rank 2 claims 5
        assert "F=4" in e["reason"] and "F=5" in e["reason"]
    assert summary is None


def test_forward_fault_fails_stop_fast_and_writes_nothing_after(tmp_path):
    proc, events, summary = run(tmp_path, "run", make_config(tmp_path, steps=12), "forward:10:2")
    assert proc.returncode == EXIT_REQUEUE
    assert summary is None and not os.path.exists(tmp_path / "run" / "summary.json")
    stops = [e for e in events if e["event"] == "fail_stop"]
    assert sorted(e["rank"] for e in stops) == [0, 1, 2, 3]
    assert all(e["exit_code"] == EXIT_REQUEUE and e["phase"] == "forward" for e in stops)
    assert all(e["decision_s"] < 0.1 for e in stops)
    # Nothing of update 10 or later committed, and no snapshot or job end after the fault.  (Rank 0 may still be
    # writing update 9's step event when the faulting rank, already in update 10, reports its fault.)
    first_fault = min(e["ts"] for e in events if e["event"] == "fault")
    assert not [e for e in events if e["event"] == "step" and e["step"] >= 10]
    after = [e for e in events if e["ts"] > first_fault and e["event"] in ("checkpoint", "job_end")]
    assert after == []


# --------------------------------------------------------------------------- faults in backward (L1 with a redo)


@pytest.mark.parametrize("switch", ["ACCELPACT_TEST_SKIP_REDO_RNG", "ACCELPACT_TEST_SKIP_DISCARD"])
def test_negative_controls_of_the_backward_redo(baseline, tmp_path, switch):
    """Without the RNG states the update began with, the redo draws other dropout masks: another state.  Without
    discarding the update, FSDP is left mid-flight: the repair's guard check refuses it and the job fails stop."""
    proc, events, summary = run(tmp_path, "run", make_config(tmp_path), "backward:16:1", env={switch: "1"})
    if switch == "ACCELPACT_TEST_SKIP_REDO_RNG":
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert summary["final_state_digest"] != baseline["final_state_digest"]
    else:
        assert proc.returncode == EXIT_REQUEUE and summary is None
        stops = [e for e in events if e["event"] == "fail_stop"]
        assert stops and all("L1 repair failed in phase guard_sync" in e["reason"] for e in stops)


def test_twenty_successive_faults_all_repaired_without_memory_growth(baseline, tmp_path):
    """Ten boundary faults and ten backward faults in one run, on varying ranks: every one repaired in process,
    the run ends in the uninterrupted state, and no rank's memory grows (RSS within 5% over the last 18 repairs)."""
    faults = []
    for i in range(10):
        faults += [f"boundary:{2 * i + 2}:{(i * 3 + 1) % 4}", f"backward:{2 * i + 4}:{(i * 3 + 2) % 4}"]
    config = make_config(tmp_path)  # without snapshots: their shared-memory slots would count as growth
    Path(config).write_text(Path(config).read_text().replace("every_steps: 10", "every_steps: 0"))
    proc, events, summary = run(tmp_path, "run", config, *faults)
    assert proc.returncode == 0, proc.stdout[-3000:]
    repairs = [e for e in events if e["event"] == "repair"]
    assert [e["generation"] for e in repairs] == list(range(1, 21))
    assert [e["discarded_update"] for e in repairs if e["scope"] == "update"] == [2 * i + 4 for i in range(10)]
    assert len([e for e in repairs if e["scope"] == "replicate"]) == 10
    assert summary["final_state_digest"] == baseline["final_state_digest"]
    snapshots_off_warned_once_and_log_lines_carry_the_rank(proc, events, tmp_path / "run")
    # Measured from the third repair on: the first of each kind (a boundary one, then a backward one) makes the
    # one-time allocations (the first group builds, the first discard) while training itself still warms up.
    for rank in range(4):
        rss = [e["rss_bytes"] for e in events if e["event"] == "repair_rank" and e["rank"] == rank]
        assert len(rss) == 20
        assert rss[-1] < rss[2] * 1.05, (rank, rss)
