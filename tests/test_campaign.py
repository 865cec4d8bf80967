"""The fault campaign (``scripts/campaign.py``): a fixed-seed sample of eight faults, and the tool's own control.

Each run is the tiny decoder job on the embedded default (2 emulated nodes x 2 ranks, real FSDP, real SIGKILL and
SIGSTOP, real snapshots) with one fault; the tool checks the run's final digest against the uninterrupted run's, the
temporary directories and the verified snapshots.  ``-m "not campaign"`` leaves the job's runs out (several minutes
on two cores); the checks' own tests, on planted directories, stay.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import load_script


#: The sample: eight faults (KIND:PHASE), every kind but the straggler (tests/e2e/test_detection.py has it) and
#: the L1 link faults (tests/e2e/test_l1_repair.py and test_examples.py end them bitwise at the boundary and in
#: backward; ``make bench`` runs all of them in its 50-run campaign): the snapshot phase of the rank, node and
#: daemon kills and stops (a peer dead or stopped during the first snapshot's capture proof; a daemon killed during
#: its first write, restarted by the launcher), the daemon's own kill between commit and index, the squatted store
#: ports and the full disk.  The restore phase runs in the control below.
SAMPLE = ["kill_rank:snapshot", "kill_node:snapshot", "stop_rank:snapshot", "stop_rank0:snapshot",
          "kill_daemon:snapshot", "daemon_commit_kill:snapshot", "squat_ports:start", "disk_full:snapshot"]
SEED = 44


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """One output directory for the module's campaigns: the uninterrupted run is made once (its digest cached)."""
    return tmp_path_factory.mktemp("campaign")


def _campaign(out, tmp_path, *args):
    campaign = load_script("campaign")
    code = campaign.main(["--out", str(out), "--json", str(tmp_path / "c.json"), "--markdown", "",
                          "--deadline-s", "150", *args])
    return code, json.loads((tmp_path / "c.json").read_text())


@pytest.mark.multiproc
@pytest.mark.campaign
def test_eight_faults_of_a_fixed_seed_each_end_bitwise_with_nothing_left_or_lost(out, tmp_path):
    """Every run ends with the uninterrupted run's digest (or a stop its kind documents), leaves no temporary
    directory or staging and loses no verified snapshot; each run records its time back to training and restarts.

    Negative control: ``test_the_tool_reports_a_broken_restore_as_a_failure`` (a restore that drops the extra
    state is reported FAIL with the digest named); the leftover and lost-snapshot checks have theirs below, on
    planted directories, as have the killed daemon's last snapshot and the squatted ports' store port."""
    sample = SAMPLE if os.geteuid() == 0 else [k for k in SAMPLE if not k.startswith("disk_full")]  # a mount
    code, res = _campaign(out, tmp_path, "--runs", str(len(sample)), "--seed", str(SEED), "--kinds", ",".join(sample))
    fails = [f"run {r['run']} {r['kind']} ({r['phase']}, update {r['update']}): {r['result']}"
             for r in res["runs"] if not r["passed"]]
    assert code == 0 and not fails and len(res["runs"]) == len(sample), "\n".join(fails)
    assert [f"{r['kind']}:{r['phase']}" for r in res["runs"]] == sample
    for r in res["runs"]:
        assert r["result"] == "bitwise" or r["result"].startswith("stop: "), r
        assert r["restarts"] >= 0 and r["wall_s"] > 0
        assert not os.path.exists(r["run_dir"])  # a passed run's directory is removed (nothing kept)
    l2 = [r for r in res["runs"] if r["kind"] == "kill_rank"]
    assert l2 and all(r["restarts"] >= 1 and r["time_back_s"] is not None for r in l2), l2
    # the L1 link faults (0 restarts) are make bench's campaign and tests/e2e/test_l1_repair.py's, not this sample's
    assert not [r for r in res["runs"] if r["kind"].startswith("link_")]
    squat = [r for r in res["runs"] if r["kind"] == "squat_ports"]
    assert squat and all(r["store_ports"] for r in squat), squat  # the derived port each start took
    table = load_script("campaign").markdown(res)
    assert "| kill_rank |" in table and "median time back to training" in table


@pytest.mark.multiproc
@pytest.mark.campaign
def test_the_tool_reports_a_broken_restore_as_a_failure(out, tmp_path):
    """Negative control of the campaign itself: with ``ACCELPACT_TEST_SKIP_EXTRA_RESTORE=1`` an L2 restart reloads
    the weights but not the RNG, data loader and scheduler state; the job still completes (exit 0), and the tool
    must report the run as FAIL, naming the digest that differs."""
    code, res = _campaign(out, tmp_path, "--runs", "1", "--seed", str(SEED), "--kinds", "kill_rank:restore",
                          "--env", "ACCELPACT_TEST_SKIP_EXTRA_RESTORE=1")
    (r,) = res["runs"]
    assert code == 1 and not r["passed"] and r["restarts"] >= 1, r
    assert r["result"].startswith("FAIL: ") and "final_state_digest" in r["result"], r
    assert os.path.isdir(r["run_dir"])  # a failed run's directory is kept for its diagnosis


# ------------------------------------------------------------------ the checks themselves, on planted directories


def _index(run_dir, node, steps):
    d = run_dir / "ckpt-index"
    d.mkdir(parents=True, exist_ok=True)
    snaps = [{"step": s, "state": state, "path": str(run_dir / "node-local" / node / f"step-{s:010d}")}
             for s, state in steps]
    (d / f"{node}.json").write_text(json.dumps({"node": node, "snapshots": snaps}))
    for s in snaps:
        os.makedirs(s["path"], exist_ok=True)
        with open(os.path.join(s["path"], "manifest.json"), "w") as fh:
            fh.write("{}")


def test_a_verified_snapshot_gone_without_newer_ones_is_lost_and_retention_is_not(tmp_path):
    """Negative control of the "no verified snapshot lost" check: a verified snapshot whose files are removed, or
    that leaves the index while fewer than ``keep_last`` newer verified ones stand, is named; one pruned by
    retention (``keep_last`` newer verified ones) is not."""
    import shutil

    campaign = load_script("campaign")
    _index(tmp_path, "node1", [(3, "verified"), (6, "verified")])
    seen = campaign.Verified(str(tmp_path))
    seen.poll()
    _index(tmp_path, "node1", [(6, "verified"), (9, "verified"), (12, "verified")])  # 3 pruned by retention
    assert seen.lost(keep_last=2) == []
    shutil.rmtree(tmp_path / "node-local" / "node1" / "step-0000000006")
    assert seen.lost(keep_last=2) == ["node1 step 6 (in the index, files gone)"]
    _index(tmp_path, "node1", [(12, "verified")])  # 3, 6, 9 left it: one newer verified only
    assert seen.lost(keep_last=2) == [f"node1 step {s} (gone)" for s in (3, 6, 9)]


def test_temporary_directories_and_staging_left_are_named(tmp_path):
    """Negative control of the "no temporary directory left" check: a ``.tmp-step-*`` in a node directory, a
    ``.del-*`` in the shared tier and the node's ``/dev/shm`` staging are each named; committed snapshots are not."""
    from ckpt_service.layout import staging_root

    campaign = load_script("campaign")
    node = tmp_path / "node-local" / "node1"
    (node / "step-0000000003").mkdir(parents=True)
    assert campaign.leftovers(str(tmp_path), str(tmp_path / "node-local")) == []
    (node / ".tmp-step-0000000006-123").mkdir()
    (tmp_path / "shared-ckpt" / ".del-step-0000000003-9").mkdir(parents=True)
    stage = staging_root(str(node))
    os.makedirs(stage)
    try:
        left = campaign.leftovers(str(tmp_path), str(tmp_path / "node-local"))
    finally:
        os.rmdir(stage)
    assert sorted(left) == sorted([str(node / ".tmp-step-0000000006-123"),
                                   str(tmp_path / "shared-ckpt" / ".del-step-0000000003-9"), stage])


def test_time_back_to_training_is_taken_at_the_recovery():
    """The time back is measured to the first update of a later start (L2), or after a repair (L1), not to an
    update that was already in flight when the fault hit."""
    campaign = load_script("campaign")
    ev = [{"event": "step", "ts": 10.0, "restart": 0, "step": 4},
          {"event": "step", "ts": 11.0, "restart": 0, "step": 5},  # in flight at the fault (10.5)
          {"event": "fail_stop", "ts": 14.0, "restart": 0},
          {"event": "step", "ts": 20.0, "restart": 1, "step": 4}]
    assert campaign.time_back(ev, 10.5) == 9.5
    l1 = [{"event": "step", "ts": 10.0, "restart": 0}, {"event": "step", "ts": 11.0, "restart": 0},
          {"event": "repair", "ts": 12.0, "restart": 0}, {"event": "step", "ts": 12.5, "restart": 0}]
    assert campaign.time_back(l1, 10.5) == 2.0
    assert campaign.time_back(l1[:2], 10.5) == 0.5 and campaign.time_back(l1, None) is None


def test_a_killed_daemons_node_without_its_last_snapshot_is_named(tmp_path):
    """Negative control of the kill_daemon check "the node's last snapshot is verified": a node whose index stops
    before the job's last update (its daemon killed and not started again), or lists it unverified, is named."""
    campaign = load_script("campaign")
    _index(tmp_path, "node2", [(3, "verified"), (6, "verified"), (9, "verified"), (12, "verified")])
    assert campaign.last_snapshot(str(tmp_path), "node2", 12) is None
    _index(tmp_path, "node2", [(3, "verified")])
    assert campaign.last_snapshot(str(tmp_path), "node2", 12) == \
        "node2's last snapshot (update 12) is not in its index (verified: [3])"
    _index(tmp_path, "node2", [(3, "verified"), (12, "committed")])
    assert "is committed" in campaign.last_snapshot(str(tmp_path), "node2", 12)
    assert "no readable index" in campaign.last_snapshot(str(tmp_path), "node1", 12)


def test_a_start_on_a_squatted_or_launcher_port_is_named(tmp_path):
    """Negative control of the squat_ports check: a start whose store took a squatted port, or a port that is none
    of its derived ones (the launcher's own, as before ``ACCELPACT_TEST_NO_LAUNCHER_PORT``), is named; one past the
    squatted half is recorded with its place among the candidates."""
    import random

    kinds = load_script("campaign_kinds")
    campaign = load_script("campaign")
    fault = kinds.draw("squat_ports", random.Random(1), campaign.SHAPE)
    fault.prepare(str(tmp_path), "job-1", None)
    try:
        derived = fault.derived[0]
        start = [{"event": "job_start", "restart": 0, "store_port": derived[kinds.CANDIDATES // 2]}]
        assert fault.store_ports(start) == ({0: derived[kinds.CANDIDATES // 2]}, [])
        assert fault.env() == {"ACCELPACT_TEST_NO_LAUNCHER_PORT": "1"}
        _, wrong = fault.store_ports([dict(start[0], store_port=derived[0])])
        assert wrong == [f"start 0 took store port {derived[0]}, one of the squatted ones"]
        _, wrong = fault.store_ports([dict(start[0], store_port=45678)])
        assert wrong and "none of its derived ports" in wrong[0]
        assert fault.store_ports([])[1] == ["no start recorded its store port (job_start's store_port)"]
    finally:
        fault.cleanup()
