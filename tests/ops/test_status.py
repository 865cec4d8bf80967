"""Job status from a run directory: one pass over events, the checkpoint index, Slurm when it answers."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from accelpact_slurm.ops import status as st
from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_REQUEUE

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
RUN = os.path.join(DATA, "run-1001")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
END_TS = 1700000488.2  # job_end of the sample run


def _bench():
    from benchmarks.parts import status

    return status


def _write_events(path, recs):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "events.jsonl"), "w") as fh:
        for r in recs:
            fh.write(json.dumps(dict({"job_id": "77", "restart": 0, "rank": 0, "node": 0}, **r)) + "\n")
    return str(path)


# --------------------------------------------------------------------------- the sample run directory


def test_sample_run_dir():
    info = st.collect(RUN, now=END_TS + 60)
    assert info["job_id"] == "1001"
    assert (info["state"], info["state_source"]) == ("COMPLETED", "run_dir")
    assert info["restarts"] == 2
    assert info["frontier"]["step"] == 80 and info["frontier"]["age_s"] == pytest.approx(62, abs=1)
    assert info["step_rate"]["steps_per_s"] == pytest.approx(0.5) and info["step_rate"]["step_s"] == 2.0
    assert info["checkpoint_every_steps"] == 10
    assert info["events"] == 152


def test_sample_l1_repairs_are_counted_once_with_phase_durations():
    l1 = st.collect(RUN, now=END_TS)["l1"]
    assert l1["count"] == 2 and l1["faults"] == 4  # one forward, three at committed boundaries
    assert l1["last"]["generation"] == 2 and l1["last"]["frontier"] == 45
    assert set(l1["phases"]) == {"observe", "guard_sync", "agree", "replace", "rebind", "validate"}
    assert l1["phases"]["rebind"]["max"] == pytest.approx(0.003)
    assert l1["phases"]["rebind"]["count"] == 2


def test_sample_l2_restarts_and_reasons():
    l2 = st.collect(RUN, now=END_TS)["l2"]
    assert l2["count"] == 2
    assert [(f["restart"], f["phase"], f["exit_code"]) for f in l2["fail_stops"]] == [
        (0, "forward", EXIT_REQUEUE), (1, "committed", EXIT_REQUEUE)]
    assert [r["step"] for r in l2["restart_loads"]] == [20, 50]
    assert [r["reason"] for r in l2["requeues"]] == ["fail_stop", "fail_stop"]


def test_sample_snapshots_and_newest_verified():
    snaps = st.collect(RUN, now=END_TS + 10)["snapshots"]
    assert [n["node"] for n in snaps["nodes"]] == ["node1", "node2"]
    assert snaps["counts"] == {"verified": 4, "committed": 1, "rejected": 1}
    best = snaps["newest_verified"]
    assert (best["node"], best["step"]) == ("node2", 80) and best["age_s"] == pytest.approx(11, abs=0.1)
    rejected = [s for n in snaps["nodes"] for s in n["snapshots"] if s["state"] == "rejected"]
    assert rejected[0]["reason"].startswith("checksum mismatch")


def test_sample_envelope_decision_in_force_is_the_latest():
    env = st.collect(RUN, now=END_TS)["envelope"]
    assert env["decision"] == "restart" and env["event"] == "fail_stop"
    assert env["key"] == "cpu-gloo-2.13/2x2-degraded/committed/bitwise"


def test_sample_bad_lines_have_numbers_and_a_warning():
    info = st.collect(RUN, now=END_TS)
    assert [b.split(":")[-3] for b in info["bad_lines"]] == ["41", "91", "155"]
    assert any("3 unreadable" in w for w in info["warnings"])
    assert info["final"]["final_step"] == 80 and not info["stale"]


# --------------------------------------------------------------------------- states and staleness


def test_running_then_stale(tmp_path):
    d = _write_events(tmp_path / "77", [{"ts": 1000.0 + i, "event": "step", "step": i, "step_s": 1.0}
                                        for i in range(1, 11)])
    os.utime(os.path.join(d, "events.jsonl"), (1010.0, 1010.0))
    fresh = st.collect(d, now=1020.0)
    assert fresh["state"] == "RUNNING" and not fresh["stale"]
    old = st.collect(d, now=1010.0 + st.STALE_MIN_S + 1)
    assert old["state"] == "STALE" and old["stale"] and "unchanged" in old["warnings"][0]
    custom = st.collect(d, now=1040.0, stale_after_s=20)
    assert custom["stale"]


@pytest.mark.parametrize("code, state", [(EXIT_REQUEUE, "REQUEUE_WAIT"), (EXIT_NO_REQUEUE, "STOPPED"),
                                         (1, "FAILED(1)")])
def test_fail_stop_states(tmp_path, code, state):
    d = _write_events(tmp_path / "77", [{"ts": 1.0, "event": "step", "step": 1},
                                        {"ts": 2.0, "event": "fail_stop", "reason": "x", "exit_code": code},
                                        {"ts": 2.5, "event": "requeue", "reason": "fail_stop", "by": "launcher"}])
    assert st.collect(d, now=3.0)["state"] == state
    os.utime(os.path.join(d, "events.jsonl"), (2.5, 2.5))
    assert st.collect(d, now=1e6)["stale"] is (code == EXIT_REQUEUE)  # only a requeue that never came is stale
    with open(os.path.join(d, "events.jsonl"), "a") as fh:  # the next run starts: alive again
        fh.write(json.dumps({"ts": 9.0, "event": "restart_load", "job_id": "77", "restart": 1, "step": 0}) + "\n")
    assert st.collect(d, now=10.0)["state"] == "RUNNING"


def test_empty_and_missing_run_dirs(tmp_path):
    os.makedirs(tmp_path / "empty")
    assert st.collect(str(tmp_path / "empty"), now=1.0)["state"] == "EMPTY"
    missing = st.collect(str(tmp_path / "gone"), now=1.0)
    assert missing["state"] == "EMPTY" and any("no run directory" in w for w in missing["warnings"])


def test_slurm_view_wins_and_flags_contradictions(tmp_path):
    d = _write_events(tmp_path / "77", [{"ts": 1.0, "event": "step", "step": 1}])
    os.utime(os.path.join(d, "events.jsonl"), (1.0, 1.0))
    hung = st.collect(d, now=10_000.0, slurm={"state": "RUNNING", "source": "squeue"})
    assert (hung["state"], hung["state_source"]) == ("RUNNING", "squeue") and "hung" in hung["warnings"][0]
    killed = st.collect(d, now=2.0, slurm={"state": "NODE_FAIL", "source": "sacct"})
    assert "killed from outside" in killed["warnings"][0]
    back = st.apply_slurm(killed, None)
    assert back["state"] == "RUNNING" and not any(w.startswith("Slurm says") for w in back["warnings"])


def test_frontier_follows_the_newest_event_across_a_restart(tmp_path):
    d = _write_events(tmp_path / "77", [
        {"ts": 1.0, "event": "step", "step": 30},
        {"ts": 1.5, "event": "fault", "rank": 1, "step": 30, "phase": "committed"},
        {"ts": 1.5, "event": "fault", "rank": 3, "step": 30, "phase": "committed"},
        {"ts": 2.0, "event": "repair", "generation": 1, "frontier": 30, "phases": [["agree", 0.1], ["rebind", 0.2]]},
        {"ts": 9.0, "event": "step", "restart": 1, "step": 21},
    ])
    info = st.collect(d, now=10.0)
    assert info["frontier"]["step"] == 21 and info["frontier"]["source"] == "step"
    assert info["l1"]["phases"]["rebind"]["last"] == 0.2
    assert info["envelope"]["decision"] == "preserve"
    assert info["l1"]["faults"] == 1  # two ranks logged the same fault


# --------------------------------------------------------------------------- the checkpoint index


def test_bad_index_files_are_reported_not_fatal(tmp_path):
    d = _write_events(tmp_path / "77", [{"ts": 1.0, "event": "step", "step": 1}])
    idx = os.path.join(d, "ckpt-index")
    os.makedirs(idx)
    open(os.path.join(idx, "node1.json"), "w").write('{"node": "node1", "snapsh')
    json.dump({"node": "node2", "updated": 5.0, "snapshots": [{"state": "verified"}, {"step": 4, "state": "verified",
                                                                                    "created": 4.0}]},
              open(os.path.join(idx, "node2.json"), "w"))
    info = st.collect(d, now=6.0)
    assert len(info["bad_lines"]) == 2
    assert info["snapshots"]["newest_verified"]["step"] == 4


def test_newest_verified_is_pure_and_never_picks_rejected():
    snaps = [{"node": "a", "step": 10, "state": "verified", "created": 1},
             {"node": "b", "step": 20, "state": "rejected", "created": 2},
             {"node": "c", "step": 10, "state": "verified", "created": 3},
             {"node": "d", "step": 30, "state": "committed", "created": 4}]
    best, reason = st.newest_verified(snaps)
    assert best["node"] == "c" and "highest verified" in reason
    assert st.newest_verified([])[0] is None
    none, why = st.newest_verified(snaps[1:2])
    assert none is None and "none of 1" in why


@pytest.mark.parametrize("now, last, step_s, finished, stale", [
    (1000, 900, None, False, False), (1000, 600, None, False, True), (1000, 600, 30.0, False, False),
    (10_000, 0, None, True, False), (1000, None, None, False, False)])
def test_staleness(now, last, step_s, finished, stale):
    assert st.staleness(now, last, step_s, finished)[0] is stale


# --------------------------------------------------------------------------- Slurm queries


def _fake(bin_dir, name, body):
    p = bin_dir / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_query_slurm_asks_squeue_then_sacct(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "squeue", 'echo "101|RUNNING"')
    _fake(bin_dir, "sacct", 'echo "102|REQUEUED"; echo "102|FAILED"; echo "999|COMPLETED"')
    got = st.query_slurm(["101", "102", "103", "not-a-job"], env={"PATH": str(bin_dir)})
    assert got == {"101": {"state": "RUNNING", "source": "squeue"}, "102": {"state": "FAILED", "source": "sacct"}}


def test_query_slurm_survives_missing_failing_and_hanging_commands(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    assert st.query_slurm(["1"], env={"PATH": str(bin_dir)}) == {}
    _fake(bin_dir, "squeue", "exec sleep 30")
    _fake(bin_dir, "sacct", 'echo "sacct: error: accounting storage is disabled" >&2; exit 1')
    start = time.monotonic()
    assert st.query_slurm(["1"], timeout_s=0.3, env={"PATH": str(bin_dir)}) == {}
    assert time.monotonic() - start < 10


# --------------------------------------------------------------------------- run roots and the large run dir


def test_resolve_and_list(tmp_path):
    root = tmp_path / "runs"
    for name, ts in (("11", 100.0), ("12", 300.0), ("13", 200.0)):
        d = _write_events(root / name, [{"ts": ts, "event": "step", "step": 1}])
        os.utime(os.path.join(d, "events.jsonl"), (ts, ts))
    os.makedirs(root / "not-a-run")
    assert st.resolve_target("12", str(root)) == (str(root / "12"), "12")
    assert st.resolve_target(str(root / "12"), "elsewhere") == (str(root / "12"), None)
    assert [os.path.basename(p) for p in st.list_run_dirs(str(root), limit=2)] == ["12", "13"]
    assert st.list_run_dirs(str(tmp_path / "absent")) == []
    assert st.runs_root({"ACCELPACT_RUNS_ROOT": "/x"}) == "/x"


def test_large_run_dir_with_10000_events_and_100_snapshots(tmp_path):
    run_dir = _bench().build_run_dir(str(tmp_path / "4242"), events=10_000, snapshots=100)
    info = st.collect(run_dir, now=time.time())
    assert info["events"] == 10_000
    assert sum(len(n["snapshots"]) for n in info["snapshots"]["nodes"]) == 100
    assert info["l1"]["count"] > 10 and len(info["l1"]["recent"]) == st.RECENT
    assert info["restarts"] >= 2 and info["bad_lines"] == []
    assert info["snapshots"]["newest_verified"]["state"] == "verified"
    json.dumps(info)  # JSON-ready


# --------------------------------------------------------------------------- hostile event logs


def test_deeply_nested_event_line_is_a_bad_line_not_a_crash(tmp_path):
    d = _write_events(tmp_path / "77", [{"ts": 1.0, "event": "step", "step": 1}])
    with open(os.path.join(d, "events.jsonl"), "a") as fh:
        fh.write("[" * 200_000 + "]" * 200_000 + "\n")
        fh.write('{"a":' * 200_000 + "1" + "}" * 200_000 + "\n")
        fh.write(json.dumps({"ts": 2.0, "event": "step", "step": 2, "job_id": "77"}) + "\n")
    info = st.collect(d, now=3.0)
    assert info["frontier"]["step"] == 2
    assert [b.split(":")[-3] for b in info["bad_lines"]] == ["2", "3"]
    assert all("nested deeper than" in b for b in info["bad_lines"])


def test_deeply_nested_summary_or_index_is_a_bad_file(tmp_path):
    d = _write_events(tmp_path / "77", [{"ts": 1.0, "event": "step", "step": 1}])
    open(os.path.join(d, "summary.json"), "w").write("[" * 200_000 + "]" * 200_000)
    os.makedirs(os.path.join(d, "ckpt-index"))
    open(os.path.join(d, "ckpt-index", "node1.json"), "w").write('{"a":' * 200_000 + "1" + "}" * 200_000)
    info = st.collect(d, now=3.0)
    assert len(info["bad_lines"]) == 2 and info["final"] is None


def test_numbers_no_float_holds_and_wrong_types_do_not_crash(tmp_path):
    # A 400-digit step overflows float() in the step rate; a string total_s broke `:.3g` in the table.
    from accelpact_slurm.cli import status as status_cli

    d = _write_events(tmp_path / "77", [
        {"ts": 1.0, "event": "step", "step": 1, "step_s": "x"},
        {"ts": 2.0, "event": "step", "step": 10 ** 400, "step_s": 10 ** 400},
        {"ts": 3.0, "event": "repair", "generation": 1, "frontier": 1, "total_s": "fast",
         "phases": [["agree", 10 ** 400], ["rebind", 0.2]]},
    ])
    os.makedirs(os.path.join(d, "ckpt-index"))
    json.dump({"node": "n1", "updated": 10 ** 400, "snapshots": [{"step": 1, "state": "verified",
                                                                   "created": 10 ** 400}]},
              open(os.path.join(d, "ckpt-index", "n1.json"), "w"))
    info = st.collect(d, now=4.0)
    assert info["frontier"]["step"] == 1 and info["step_rate"]["step_s"] is None  # the 400-digit step is no step
    assert info["l1"]["last"]["total_s"] is None and set(info["l1"]["phases"]) == {"rebind"}
    assert info["snapshots"]["nodes"][0]["updated"] is not None  # the file's mtime instead
    json.dumps(info, allow_nan=False)
    status_cli.render({"jobs": [info], "runs_root": str(tmp_path)}, detailed=True)


# --------------------------------------------------------------------------- the step a restart loads


def _index(run_dir, node, steps):
    os.makedirs(os.path.join(run_dir, "ckpt-index"), exist_ok=True)
    snaps = [{"step": s, "state": state, "size_bytes": 10, "created": 1.0, "path": f"/nvme/{node}/{s}",
              "milestone": False, "reason": None} for s, state in steps]
    with open(os.path.join(run_dir, "ckpt-index", f"{node}.json"), "w") as fh:
        json.dump({"node": node, "updated": 2.0, "snapshots": snaps}, fh)


def _shared_copy(shared, step, state="verified"):
    from ckpt_service.index import record_state
    from ckpt_service.layout import step_dirname

    d = os.path.join(shared, step_dirname(step))
    os.makedirs(d)
    with open(os.path.join(d, "manifest.json"), "w") as fh:
        json.dump({"created": 1.5, "files": {}}, fh)
    record_state(d, state)


def test_restart_step_and_source_follow_the_restore_rule(tmp_path):
    """node1 verified up to 8, node2's disk filled after 4, the shared tier (configured) holds 6 and a
    rejected 10: a restart loads node1's 8 (node2 through the shared tier), the newest common step is 4,
    and the daemon-failed marker of a third node is no node.  Negative control: choosing from the node
    indexes alone, or counting the marker as a node without snapshots, gives another answer."""
    shared = str(tmp_path / "elsewhere" / "shared")
    d = _write_events(tmp_path / "77", [{"ts": 1.0, "event": "job_start", "config": {"checkpoint": {
        "every_steps": 2, "shared_dir": shared, "milestone_every": 0}}}])
    _index(d, "node1", [(4, "verified"), (6, "verified"), (8, "verified")])
    _index(d, "node2", [(2, "verified"), (4, "verified")])
    with open(os.path.join(d, "ckpt-index", "node3.daemon-failed.json"), "w") as fh:
        json.dump({"node": "node3", "restart": 0, "reason": "read-only local_dir"}, fh)
    _shared_copy(shared, 6)
    _shared_copy(shared, 10, "rejected")
    snaps = st.collect(d, now=3.0)["snapshots"]
    assert [n["node"] for n in snaps["nodes"]] == ["node1", "node2"]
    assert (snaps["restart"]["step"], snaps["restart"]["source"]) == (8, "node1")
    assert "node2 loads it through a copy node1 makes in the shared tier" in snaps["restart"]["reason"]
    assert snaps["newest_common"]["step"] == 4
    assert snaps["shared"]["dir"] == shared and snaps["shared"]["counts"] == {"verified": 1, "rejected": 1}
    assert [(s["node"], s["step"]) for s in snaps["shared"]["snapshots"]] == [("shared tier", 6), ("shared tier", 10)]


def test_restart_from_the_shared_tier_when_every_node_lost_its_disk(tmp_path):
    d = _write_events(tmp_path / "77", [{"ts": 1.0, "event": "step", "step": 9}])
    _index(d, "node1", [])
    _index(d, "node2", [(3, "rejected")])
    _shared_copy(os.path.join(d, "shared-ckpt"), 6)  # the default place: RUN_DIR/shared-ckpt
    snaps = st.collect(d, now=3.0)["snapshots"]
    assert (snaps["restart"]["step"], snaps["restart"]["source"]) == (6, st.SHARED_SOURCE)
    common = snaps["newest_common"]
    assert common["step"] is None and "no verified step on node1, node2" in common["reason"]
    from accelpact_slurm.cli import status as status_cli

    text = status_cli.render({"jobs": [st.collect(d, now=3.0)], "runs_root": str(tmp_path)}, detailed=True)
    assert "restart loads step 6 from shared tier: step 6 is the newest step verified anywhere" in text
    assert "common step   none: no verified step on node1, node2" in text
    assert "(in the shared tier); node1, node2 load it through the shared tier's copy" in text
    assert "shared tier: verified 1 in " in text and "shared tier  6     verified" in text
    listing = status_cli.render({"jobs": [st.collect(d, now=3.0)], "runs_root": str(tmp_path)}, detailed=False)
    assert "6@shared" in listing
