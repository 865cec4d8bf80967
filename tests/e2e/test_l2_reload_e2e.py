"""L2 reload end to end: real 2 x 2 ranks and daemons; corrupted snapshots, the replay check, the fallbacks.

(The pure decisions and the agreement loop are unit-tested in tests/runtime/test_l2_reload.py.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckpt_service.index import read_record, scan
from ckpt_service.layout import step_dirname

# --------------------------------------------------------------------------- end to end (real ranks and daemons)

STEPS, EVERY = 12, 5  # snapshots 5 and 10 (keep_last 2); updates 11 and 12 run after the newest
FAULT = "forward:12:1"  # an L2 restart (uncommitted compute) after update 11 recorded the replay reference of 10


def _job_text(collective_s=5, max_restarts=20):
    from tests.conftest import decoder_text

    text = decoder_text()
    for old, new in [("steps: 25", f"steps: {STEPS}"), ("every_steps: 10", f"every_steps: {EVERY}"),
                     ("collective_s: 5", f"collective_s: {collective_s}"),
                     ("max_restarts: 20", f"max_restarts: {max_restarts}")]:
        assert old in text, old
        text = text.replace(old, new)
    return text


def _run(config, run_dir, *args, env=None, expect=0):
    """One launch of the job (the embedded default relaunches on exit 75 itself); ``expect=None``: any exit code."""
    from tests.conftest import run_cli

    proc = run_cli(["accelpact_slurm.cli.run", str(config), "--run-dir", str(run_dir), *args], env=env, timeout=240)
    assert expect is None or proc.returncode == expect, \
        (run_dir, proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _events(run_dir, kind, **match):
    from accelpact_slurm.core.events import read_events

    return [e for e in read_events(run_dir / "events.jsonl")
            if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]


def _states(run_dir):
    """``{node: [(step, state)]}`` from the state files beside the data."""
    return {n: [(r.step, r.state) for r in scan(str(run_dir / "node-local" / n))] for n in ("node1", "node2")}


def _index(run_dir, node):
    idx = json.loads((run_dir / "ckpt-index" / f"{node}.json").read_text())
    return [(s["step"], s["state"]) for s in idx["snapshots"]]


def _flip_a_weight_byte(step_dir):
    """Flip one bit in the middle of ``model.tok.weight``'s bytes (found through DCP's own metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(step_dir)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.tok.weight")
    shard = step_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def _forge_a_consistent_corruption(step_dir):
    """Damage ``layers.0.qkv.weight`` enough to move the loss, re-hash the manifest and sign it with the run's key
    (a consistent wrong snapshot, as a capture bug would write it): only the replay can tell."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckpt_service.auth import load_key, sign

    md = FileSystemReader(str(step_dir)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.layers.0.qkv.weight")
    shard = step_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    mid = info.offset + info.length // 2
    for j in range(64):  # 16 floats, exponent bytes included (one flipped mantissa bit may not move the loss)
        data[mid + j] ^= 0x40
    shard.write_bytes(bytes(data))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][info.relative_path]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(sign(manifest, load_key(str(step_dir.parents[2])))))


def _as_if_requeued_after(src, dst):
    """``dst``: the run directory a job requeued after update 11 (snapshots 5 and 10 verified) leaves behind.

    Training and snapshots are deterministic, so the uninterrupted run's node directories and indexes are
    bitwise what a run stopped there leaves.  Of its events only the ``replay_ref`` records travel (those of
    snapshots 5 and 10, written at updates 6 and 11): they are what the replay check of the restart reads;
    the rest is dropped so that ``dst`` shows only the restart (the restart is a new launcher, restart count 0).
    """
    from accelpact_slurm.core.events import read_events

    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("events.jsonl", "summary.json", "logs"))
    refs = [e for e in read_events(src / "events.jsonl") if e["event"] == "replay_ref"]
    assert [(e["snapshot"], e["step"]) for e in refs] == [(5, 6), (10, 11)]
    (dst / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in refs))


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """Six runs, two at a time (each is 4 ranks and 2 daemons; the machine may have only two cores):

    a: uninterrupted (the baseline);
    b: a's directory, node1's snapshot 10 bit-flipped, restarted;
    b_nocheck: the same corruption restarted with ``ACCELPACT_TEST_SKIP_RELOAD_CHECK=1`` (negative control);
    c: a's directory, node2's 10 consistently corrupted (checksums pass), restarted with ``max_restarts: 0``
       (the launcher stops where it would relaunch, so the rejection can be looked at), then started again;
    d: ``--inject-fault forward:12:1`` from scratch: fail-stop, relaunch, resume from 10;
    d_noextra: a's directory restarted with ``ACCELPACT_TEST_SKIP_EXTRA_RESTORE=1`` and ``max_restarts: 0``
       (negative control of d: the same load of 10 and the same first update 11, one start instead of two).
    """
    base = tmp_path_factory.mktemp("l2reload")
    job, job_fault, job_stop = (base / f"{n}.yaml" for n in ("job", "fault", "stop"))
    job.write_text(_job_text())
    job_fault.write_text(_job_text(collective_s=2))  # the peers of the withholding rank time out sooner
    job_stop.write_text(_job_text(max_restarts=0))
    r = {n: base / n for n in ("a", "b", "b_nocheck", "c", "d", "d_noextra")}
    out: dict = {"dirs": r}

    def scenario_b():
        _as_if_requeued_after(r["a"], r["b"])
        out["stopped"] = _states(r["b"])
        _flip_a_weight_byte(r["b"] / "node-local" / "node1" / step_dirname(10))
        _run(job, r["b"])

    def scenario_b_nocheck():
        _as_if_requeued_after(r["a"], r["b_nocheck"])
        _flip_a_weight_byte(r["b_nocheck"] / "node-local" / "node1" / step_dirname(10))
        out["b_nocheck_rc"] = _run(job, r["b_nocheck"], env={"ACCELPACT_TEST_SKIP_RELOAD_CHECK": "1"},
                                   expect=None).returncode

    def scenario_c():
        _as_if_requeued_after(r["a"], r["c"])
        _forge_a_consistent_corruption(r["c"] / "node-local" / "node2" / step_dirname(10))
        _run(job_stop, r["c"], expect=75)
        out["c_between"] = {"states": _states(r["c"]), "index": {n: _index(r["c"], n) for n in ("node1", "node2")},
                            "reasons": {n: read_record(str(r["c"] / "node-local" / n / step_dirname(10))).reason
                                        for n in ("node1", "node2")}}
        _run(job, r["c"])

    def scenario_d():
        out["d_stdout"] = _run(job_fault, r["d"], "--inject-fault", FAULT).stdout

    def scenario_d_noextra():
        _as_if_requeued_after(r["a"], r["d_noextra"])
        _run(job_stop, r["d_noextra"], env={"ACCELPACT_TEST_SKIP_EXTRA_RESTORE": "1"}, expect=75)

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(_run, job, r["a"]), pool.submit(scenario_d)]
        runs[0].result()  # the others start from a's directory
        runs += [pool.submit(f) for f in (scenario_c, scenario_b, scenario_b_nocheck, scenario_d_noextra)]
        for f in runs:
            f.result()
    return out


@pytest.mark.multiproc
def test_baseline_records_a_replay_reference_after_every_snapshot(e2e):
    a = e2e["dirs"]["a"]
    s = _summary(a)
    assert s["final_step"] == STEPS and len(s["losses"]) == STEPS and None not in s["losses"]
    assert s["restart_count"] == 0 and s["final_state_digest"]
    refs = _events(a, "replay_ref")
    assert [(e["snapshot"], e["step"], e["layout"], len(e["fingerprints"])) for e in refs] == \
        [(5, 6, [2, 2], 4), (10, 11, [2, 2], 4)]
    assert [e["loss"] for e in refs] == [s["losses"][5], s["losses"][10]]  # the job's mean loss of that update
    assert not _events(a, "restart_load") and not _events(a, "replay_check")
    assert _states(a) == {n: [(5, "verified"), (10, "verified")] for n in ("node1", "node2")}


@pytest.mark.multiproc
def test_corrupted_newest_is_rejected_and_the_previous_verified_reproduces_the_run(e2e):
    a, b = e2e["dirs"]["a"], e2e["dirs"]["b"]
    assert e2e["stopped"] == {n: [(5, "verified"), (10, "verified")] for n in ("node1", "node2")}
    (load,) = _events(b, "restart_load")
    assert load["step"] == 5 and load["path"] == str(b / "node-local" / "node1" / step_dirname(5))
    assert load["checked"] is True and [s["step"] for s in load["skipped"]] == [10]
    assert load["skipped"][0]["reason"].startswith("re-check at restart failed: node1: ")
    assert "fails its SHA-256 checksum" in load["skipped"][0]["reason"]
    (chk,) = _events(b, "replay_check")
    assert (chk["snapshot"], chk["step"], chk["verdict"]) == (5, 6, "match")
    assert "parameters of all 4 ranks" in chk["reason"]
    assert _summary(b)["final_state_digest"] == _summary(a)["final_state_digest"]
    assert _summary(b)["losses"] == _summary(a)["losses"]
    # node1's snapshot 10: rejected at restart (beside the data, by the restorer), then replaced by the
    # resumed run's own snapshot 10 (a rejected directory is never chosen again, only overwritten).
    ten = [(e["state"], e.get("source"), e.get("reason")) for e in _events(b, "checkpoint", step=10, hostname="node1")]
    assert [s for s, _src, _why in ten] == ["rejected", "committed", "verified"]
    assert ten[0][1] == "restore" and "fails its SHA-256 checksum" in ten[0][2]
    # node2's copy of 10 was fine: never rejected; the writer keeps it (same step, already verified).
    node2 = [(e["state"], e.get("reason") or "") for e in _events(b, "checkpoint", hostname="node2")]
    assert [st for st, _why in node2] == ["failed"] and "already exists and is verified" in node2[0][1]
    for node in ("node1", "node2"):
        assert _index(b, node) == [(5, "verified"), (10, "verified")]
    assert not _events(b, "fail_stop")


@pytest.mark.multiproc
def test_negative_control_without_the_reload_check_the_corruption_is_loaded(e2e):
    a, c = e2e["dirs"]["a"], e2e["dirs"]["b_nocheck"]
    (load,) = _events(c, "restart_load")
    assert load["step"] == 10 and load["skipped"] == [] and load["checked"] is False
    assert load["path"] == str(c / "node-local" / "node1" / step_dirname(10))
    assert not _events(c, "checkpoint", state="rejected") and not _events(c, "replay_check")
    if e2e["b_nocheck_rc"] == 0:
        assert _summary(c)["final_state_digest"] != _summary(a)["final_state_digest"]


@pytest.mark.multiproc
def test_consistent_corruption_fails_the_replay_check_and_the_next_start_falls_back(e2e):
    a, c = e2e["dirs"]["a"], e2e["dirs"]["c"]
    first, second = _events(c, "restart_load")
    assert first["job_id"] != second["job_id"]  # two launches of the job
    assert (first["step"], first["skipped"], first["checked"]) == (10, [], True)  # its checksums pass
    chk10, chk5 = _events(c, "replay_check")
    assert (chk10["snapshot"], chk10["step"], chk10["verdict"], chk10["job_id"]) == (10, 11, "mismatch",
                                                                                      first["job_id"])
    assert chk10["reason"].startswith("replay mismatch at update 11: loss ")
    # the first update after the load differs: every node's copy it loaded is rejected, the start fails stop
    rej = _events(c, "checkpoint", state="rejected")
    assert sorted((e["hostname"], e["step"], e["source"]) for e in rej) == [("node1", 10, "replay"),
                                                                             ("node2", 10, "replay")]
    assert all(e["reason"] == "replay check failed: " + chk10["reason"] for e in rej)
    (stop,) = [e for e in _events(c, "fail_stop") if e["rank"] == 0]
    assert (stop["phase"], stop["exit_code"], stop["frontier"]) == ("replay", 75, 10)
    between = e2e["c_between"]
    assert between["states"] == {n: [(5, "verified"), (10, "rejected")] for n in ("node1", "node2")}
    assert between["index"] == between["states"]
    assert all(why.startswith("replay check failed: replay mismatch") for why in between["reasons"].values())
    # the next start: 10 is no candidate any more, 5 is loaded and reproduces its next update bitwise
    assert second["step"] == 5 and second["path"] == str(c / "node-local" / "node1" / step_dirname(5))
    assert (chk5["snapshot"], chk5["step"], chk5["verdict"], chk5["job_id"]) == (5, 6, "match", second["job_id"])
    assert _summary(c)["final_state_digest"] == _summary(a)["final_state_digest"]
    assert _summary(c)["losses"] == _summary(a)["losses"]
    assert _states(c) == {n: [(5, "verified"), (10, "verified")] for n in ("node1", "node2")}  # 10 taken again


@pytest.mark.multiproc
def test_an_l2_restart_resumes_bitwise_with_the_extra_state(e2e):
    a, d = e2e["dirs"]["a"], e2e["dirs"]["d"]
    assert "relaunching the job (restart 1)" in e2e["d_stdout"]
    assert {e["restart"] for e in _events(d, "job_start")} == {0, 1}
    stops = _events(d, "fail_stop", rank=0)
    assert [(e["restart"], e["phase"], e["frontier"]) for e in stops] == [(0, "forward", 11)]
    assert [(e["snapshot"], e["step"]) for e in _events(d, "replay_ref", restart=0)] == [(5, 6), (10, 11)]
    (load,) = _events(d, "restart_load")
    assert (load["restart"], load["step"], load["skipped"]) == (1, 10, [])
    (chk,) = _events(d, "replay_check")
    assert (chk["restart"], chk["snapshot"], chk["step"], chk["verdict"]) == (1, 10, 11, "match")
    assert chk["reason"] == (f"update 11 reproduced bitwise: loss {_summary(a)['losses'][10]!r}, "
                             f"parameters of all 4 ranks")
    assert _summary(d)["final_state_digest"] == _summary(a)["final_state_digest"]
    assert _summary(d)["losses"] == _summary(a)["losses"] and _summary(d)["restart_count"] == 1
    assert not _events(d, "checkpoint", state="rejected")


@pytest.mark.multiproc
def test_negative_control_without_the_extra_state_the_replay_check_rejects_the_snapshot(e2e):
    d = e2e["dirs"]["d_noextra"]
    (load,) = _events(d, "restart_load")
    assert (load["step"], load["skipped"]) == (10, [])  # weights and optimizer state load fine
    (chk,) = _events(d, "replay_check")
    assert (chk["snapshot"], chk["step"], chk["verdict"]) == (10, 11, "mismatch")
    assert chk["reason"].startswith("replay mismatch at update 11: loss ")  # another batch, other dropout masks
    rej = _events(d, "checkpoint", state="rejected")
    assert sorted((e["hostname"], e["step"], e["source"]) for e in rej) == [("node1", 10, "replay"),
                                                                             ("node2", 10, "replay")]
    assert _states(d) == {n: [(5, "verified"), (10, "rejected")] for n in ("node1", "node2")}
    assert [e["phase"] for e in _events(d, "fail_stop", rank=0)] == ["replay"]
    assert not (d / "summary.json").exists()
