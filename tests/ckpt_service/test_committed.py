"""The signed record of the newest committed step: raised only, authentic only, and a start that goes back says so."""

from __future__ import annotations

import json
import secrets

from accelpact_slurm.core.events import EventLog, read_events
from accelpact_slurm.runtime.state.restore import ReloadOutcome, _against_committed
from ckpt_service import auth, committed


def test_the_record_only_rises_and_is_signed(tmp_path):
    key = secrets.token_bytes(32)
    assert committed.record(str(tmp_path), "node1", 10, key)
    assert not committed.record(str(tmp_path), "node1", 5, key)  # never lowered
    assert committed.record(str(tmp_path), "node1", 20, key)
    assert committed.read(committed.path_of(str(tmp_path), "node1"), key) == (20, "signed")
    assert committed.read(committed.path_of(str(tmp_path), "node1"), secrets.token_bytes(32))[0] is None


def test_a_forged_or_moved_record_is_ignored_with_its_reason(tmp_path):
    key = secrets.token_bytes(32)
    committed.record(str(tmp_path), "node1", 10, key)
    path2 = committed.path_of(str(tmp_path), "node2")
    with open(path2, "w") as fh:
        json.dump({"node": "node2", "step": 999, "mac": "0" * 64}, fh)
    moved = committed.path_of(str(tmp_path), "node3")
    with open(committed.path_of(str(tmp_path), "node1")) as src, open(moved, "w") as dst:
        dst.write(src.read().replace('"node1"', '"node1"'))
    step, node, ignored = committed.newest(str(tmp_path), key)
    assert (step, node) == (10, "node1")
    assert any("does not match the run's key" in w for w in ignored)
    assert any("found under another name" in w for w in ignored)


def test_rollback_says_which_steps_and_why():
    assert committed.rollback(20, 20, "node1") is None
    assert committed.rollback(30, 20, "node1") is None
    assert committed.rollback(None, None, None) is None
    lost = committed.rollback(10, 20, "node2")
    assert "loads step 10" in lost and "committed and verified step 20" in lost and "no copy of step 20" in lost
    assert "was found but not taken" in committed.rollback(10, 20, "node2", skipped=[20])
    assert "nothing (a start from step 0)" in committed.rollback(None, 20, "node1")


def test_a_start_that_loads_an_older_step_than_committed_warns_once(tmp_path):
    run_dir = str(tmp_path)
    key = auth.load_or_create_key(run_dir)
    committed.record(run_dir, "node1", 20, key)
    events = EventLog(str(tmp_path / "events.jsonl"), job_id="j", restart=1, rank=0, node=0)
    assert _against_committed(run_dir, ReloadOutcome(20, "p", "ok", offered=True), events) == 20
    assert not [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "warning"]
    _against_committed(run_dir, ReloadOutcome(10, "p", "ok", offered=True), events)
    warns = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "warning"]
    assert len(warns) == 1 and warns[0]["reason"].startswith("rollback: this start loads step 10"), warns
