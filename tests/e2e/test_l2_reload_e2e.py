"""L2 reload end to end: real 2 x 2 ranks and daemons; corrupted snapshots, the replay check, the fallbacks.

(The pure decisions and the agreement loop are unit-tested in tests/runtime/test_l2_reload.py.)
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckpt_service.index import read_record, scan
from ckpt_service.layout import step_dirname

# --------------------------------------------------------------------------- end to end (real ranks and daemons)

STEPS, EVERY = 12, 5  # snapshots 5 and 10 (keep_last 2); updates 11 and 12 run after the newest
FAULT = "forward:12:1"  # an L2 restart (uncommitted compute) after update 11 recorded the replay reference of 10


def _job_text(collective_s=5, max_restarts=20, steps=STEPS, nodes=2, ranks_per_node=2, fsdp="fsdp1"):
    """The decoder's job file, shortened; the shared tier's cadence off (``shared_every: 0``): here every copy a
    restart loads is a node's own or the copy the restart makes (the shared tier's own uploads are tested with
    the daemon)."""
    import re

    from tests.conftest import decoder_text

    # no snapshot at the end: the runs copied from "a" stand for a job requeued after update 11 (snapshots 5, 10)
    text = re.sub(r"shared_every: \d+", "shared_every: 0\n  at_end: false", decoder_text())
    for old, new in [("steps: 25", f"steps: {steps}"), ("every_steps: 10", f"every_steps: {EVERY}"),
                     ("collective_s: 5", f"collective_s: {collective_s}"),
                     ("max_restarts: 20", f"max_restarts: {max_restarts}"),
                     ("  nodes: 2\n", f"  nodes: {nodes}\n"), ("ranks_per_node: 2\n", f"ranks_per_node: {ranks_per_node}\n"),
                     ("fsdp: fsdp1 ", f"fsdp: {fsdp} ")]:
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

    from ckpt_service import digest
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
    alg = digest.manifest_algorithm(manifest)
    manifest["files"][info.relative_path][alg] = digest.of_bytes(bytes(data), alg)
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
       (negative control of d: the same load of 10 and the same first update 11, one start instead of two);
    e_lost: a's directory without node2's node directory (the node was lost; the requeue lands on an empty
       disk), restarted; e_nocopy: the same with ``ACCELPACT_TEST_NO_RESTORE_COPY=1`` (negative control);
    a10: a's directory on the same 2 x 2, 10 updates (nothing to train: the state at 10 as the same allocation
       loads it, which the tests above prove bitwise the uninterrupted run's; a fresh 10-update run would not
       do: the learning-rate schedule depends on the number of updates);
    l12: a's directory on 1 node x 2 ranks, 10 updates (nothing to train: the loaded state is the end state);
    l21: a's directory without node2's directory, on 2 nodes x 1 rank with FSDP2 (FSDP1 cannot shard over one
       rank), 10 updates; l12c: a's directory on 1 x 2, trained on to 12.
    """
    base = tmp_path_factory.mktemp("l2reload")
    job, job_fault, job_stop = (base / f"{n}.yaml" for n in ("job", "fault", "stop"))
    job.write_text(_job_text())
    job_fault.write_text(_job_text(collective_s=2))  # the peers of the withholding rank time out sooner
    job_stop.write_text(_job_text(max_restarts=0))
    r = {n: base / n for n in ("a", "b", "b_nocheck", "c", "d", "d_noextra", "e_lost", "e_nocopy", "a10", "l12",
                               "l21", "l12c")}
    job10, job12_10, job21_10, job12 = (base / f"{n}.yaml" for n in ("ten", "l12_10", "l21_10", "l12"))
    job10.write_text(_job_text(steps=10))
    job12_10.write_text(_job_text(steps=10, nodes=1))
    job21_10.write_text(_job_text(steps=10, ranks_per_node=1, fsdp="fsdp2"))
    job12.write_text(_job_text(nodes=1))
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
        # the shared tier holds node2's (wrong) 10 too: the replay mismatch must reject that copy as well
        shutil.copytree(r["c"] / "node-local" / "node2" / step_dirname(10), r["c"] / "shared-ckpt" / step_dirname(10))
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

    def node_lost(name, env=None):
        _as_if_requeued_after(r["a"], r[name])
        shutil.rmtree(r[name] / "node-local" / "node2")
        _run(job, r[name], env=env)

    def elsewhere(name, config, *args, lose_node2=False):
        _as_if_requeued_after(r["a"], r[name])
        if lose_node2:
            shutil.rmtree(r[name] / "node-local" / "node2")
        _run(config, r[name], *args)

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(_run, job, r["a"]), pool.submit(scenario_d)]
        runs[0].result()  # the others start from a's directory
        runs += [pool.submit(f) for f in (scenario_c, scenario_b, scenario_b_nocheck, scenario_d_noextra)]
        runs += [pool.submit(node_lost, "e_lost"), pool.submit(node_lost, "e_nocopy", {"ACCELPACT_TEST_NO_RESTORE_COPY": "1"}),
                 pool.submit(elsewhere, "a10", job10, "--allow-config-change"),
                 pool.submit(elsewhere, "l12", job12_10, "--allow-config-change"),
                 pool.submit(elsewhere, "l21", job21_10, "--allow-config-change", lose_node2=True),
                 pool.submit(elsewhere, "l12c", job12)]
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
def test_a_corrupted_copy_is_rejected_and_the_other_nodes_copy_of_that_step_reproduces_the_run(e2e):
    a, b = e2e["dirs"]["a"], e2e["dirs"]["b"]
    assert e2e["stopped"] == {n: [(5, "verified"), (10, "verified")] for n in ("node1", "node2")}
    (load,) = _events(b, "restart_load")
    shared = str(b / "shared-ckpt" / step_dirname(10))
    assert load["step"] == 10 and load["path"] == shared and load["checked"] is True and load["skipped"] == []
    assert (load["copied"]["from"], load["copied"]["to"], load["copied"]["hosts"]) == ("node2", shared, ["node1"])
    assert load["copied"]["after"].startswith("re-check at restart failed: node1: ")
    assert "fails its BLAKE3 checksum" in load["copied"]["after"]
    (chk,) = _events(b, "replay_check")
    assert (chk["snapshot"], chk["step"], chk["verdict"]) == (10, 11, "match")
    assert "parameters of all 4 ranks" in chk["reason"]
    assert _summary(b)["final_state_digest"] == _summary(a)["final_state_digest"]
    assert _summary(b)["losses"] == _summary(a)["losses"]
    # node1's snapshot 10: rejected at restart (beside the data, by the restorer); it stays rejected.
    ten = [(e["state"], e.get("source"), e.get("reason")) for e in _events(b, "checkpoint", step=10, hostname="node1")]
    assert [s for s, _src, _why in ten] == ["rejected"]
    assert ten[0][1] == "restore" and "fails its BLAKE3 checksum" in ten[0][2]
    assert _index(b, "node1") == [(5, "verified"), (10, "rejected")]
    assert _index(b, "node2") == [(5, "verified"), (10, "verified")]
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
    shared10 = str(c / "shared-ckpt" / step_dirname(10))
    assert sorted((e["hostname"], e["step"], e["source"], e["path"] == shared10) for e in rej) == [
        ("node1", 10, "replay", False), ("node1", 10, "replay", True), ("node2", 10, "replay", False)]
    assert all(e["reason"] == "replay check failed: " + chk10["reason"] for e in rej)
    assert read_record(shared10).state == "rejected"  # else the next start would load the shared copy of 10
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
    # the relaunch reads the files node1's daemon verified, unchanged: none is hashed twice (ckpt_service.seal)
    check = load["parts"]["check"]
    assert " match: 0 hashed, " in check and "still the files the daemon hashed" in check, load["parts"]
    assert "read_s" in load["parts"]["restore"]["inplace"], load["parts"]  # each rank's own boxes, in place
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


# --------------------------------------------------------------------------- node loss and other allocations


@pytest.mark.multiproc
def test_a_lost_node_directory_resumes_from_the_survivors_copy_bitwise(e2e):
    """node2's directory is gone (a requeue onto a fresh node): node1's verified 10 is copied to the shared
    tier, checked on arrival, loaded by node2's ranks; the replay of update 11 matches on all four ranks and
    the run ends in the uninterrupted run's state."""
    a, e = e2e["dirs"]["a"], e2e["dirs"]["e_lost"]
    (load,) = _events(e, "restart_load")
    shared = str(e / "shared-ckpt" / step_dirname(10))
    assert load["step"] == 10 and load["copied"]["from"] == "node1" and load["copied"]["hosts"] == ["node2"]
    assert load["copied"]["to"] == shared and "copied to the shared tier for node2" in load["reason"]
    (copy,) = _events(e, "checkpoint_copy")
    assert copy["step"] == 10 and copy["path"] == shared and copy["size_bytes"] > 0
    assert read_record(shared).state == "verified"
    (chk,) = _events(e, "replay_check")
    assert (chk["snapshot"], chk["step"], chk["verdict"]) == (10, 11, "match")
    assert "parameters of all 4 ranks" in chk["reason"]
    assert [ev["step"] for ev in _events(e, "step")] == [11, 12]  # only the two updates after 10 ran again
    assert _summary(e)["final_state_digest"] == _summary(a)["final_state_digest"]
    assert _summary(e)["losses"] == _summary(a)["losses"]


@pytest.mark.multiproc
def test_negative_control_without_the_copy_a_lost_node_directory_loses_the_progress(e2e):
    e = e2e["dirs"]["e_nocopy"]
    (load,) = _events(e, "restart_load")
    assert load["step"] is None and [s["step"] for s in load["skipped"]] == [10, 5]
    assert "copying is disabled" in load["skipped"][0]["reason"]
    assert len(_events(e, "step")) == STEPS  # every update ran again


@pytest.mark.multiproc
def test_resume_on_one_node_after_two_holds_the_snapshots_state_bitwise(e2e):
    """1 x 2 after 2 x 2: the loaded state (weights, optimizer state, frontier) is bitwise the state the same
    allocation loads (the model digest names it on any allocation)."""
    l12, a10 = e2e["dirs"]["l12"], e2e["dirs"]["a10"]
    (load,) = _events(l12, "restart_load")
    assert load["step"] == 10 and load["copied"] is None
    s = _summary(l12)
    assert (s["nodes"], s["ranks_per_node"], s["final_step"]) == (1, 2, 10) and not _events(l12, "step")
    assert s["final_model_digest"] == _summary(a10)["final_model_digest"]
    assert s["final_state_digest"] != _summary(a10)["final_state_digest"]  # per-rank state: 2 ranks, not 4


@pytest.mark.multiproc
def test_resume_on_two_by_one_after_two_by_two_with_a_lost_node_holds_the_state_bitwise(e2e):
    """2 x 1 (FSDP2) after 2 x 2 (FSDP1), node2's directory lost: a copy, DCP resharding on load, same state."""
    l21, a10 = e2e["dirs"]["l21"], e2e["dirs"]["a10"]
    (load,) = _events(l21, "restart_load")
    assert load["step"] == 10 and load["copied"]["from"] == "node1" and load["copied"]["hosts"] == ["node2"]
    s = _summary(l21)
    assert (s["nodes"], s["ranks_per_node"], s["final_step"]) == (2, 1, 10)
    assert s["final_model_digest"] == _summary(a10)["final_model_digest"]


@pytest.mark.multiproc
def test_training_on_after_a_resume_on_another_allocation_follows_the_loss_curve(e2e):
    """1 x 2 trained on from 10: another global batch, so not bitwise; the replay check says unconfirmed (no
    rejection of a good snapshot) and the losses of 11 and 12 stay within 10% of the uninterrupted run's."""
    a, c = e2e["dirs"]["a"], e2e["dirs"]["l12c"]
    (chk,) = _events(c, "replay_check")
    assert chk["verdict"] == "unconfirmed" and "recorded with 4 ranks and ran again with 2" in chk["reason"]
    assert not _events(c, "checkpoint", state="rejected")
    got, want = _summary(c)["losses"], _summary(a)["losses"]
    assert got[:10] == want[:10]  # the recorded curve up to the snapshot travels with it
    assert all(abs(x - y) <= 0.1 * abs(y) for x, y in zip(got[10:], want[10:])) and len(got) == STEPS
