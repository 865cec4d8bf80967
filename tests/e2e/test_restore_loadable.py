"""Verified means loadable, end to end: real 2 x 2 ranks and daemons, real DCP snapshots whose checksums pass.

- a snapshot that lacks a tensor the model asks for (the capture left it out, as FSDP1's fast plan left out every
  BatchNorm buffer) is rejected like a bad checksum: the restart takes the next older one and ends bitwise;
- a model that asks for a buffer no snapshot holds (the model changed since they were taken): one stop with the
  cause, exit 76, no relaunch, the snapshots left verified, ``accelpact-status`` names the cause.

(The agreement rounds are unit-tested in tests/runtime/test_load_fit.py.)
"""

from __future__ import annotations

import json
import os
import pickle
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckpt_service.index import read_record
from ckpt_service.layout import step_dirname
from tests.conftest import REPO, run_cli
from tests.e2e.test_l2_reload_e2e import STEPS, _as_if_requeued_after, _events, _job_text, _run, _states, _summary

#: The key snapshot 10 is made to lack: a LayerNorm's bias of the first block (a tensor every rank loads).
DROPPED = "model.layers.0.ln1.bias"

#: The decoder with one persistent buffer more per block (a BatchNorm's running statistics, say): a model that
#: asks a reload for state the snapshots of the plain decoder never held.
BUFFER_ENTRY = f'''
import sys

sys.path.insert(0, {os.path.join(REPO, "examples", "decoder")!r})

import torch

import train_decoder
from decoder_model import build_model as _build


def build_model(seed, **shape):
    model = _build(seed, **shape)
    for block in model.layers:
        block.register_buffer("running_mean", torch.zeros(shape["width"]))
    return model


train_decoder.build_model = build_model
main = train_decoder.main
'''


def _drop_a_key(step_dir, key=DROPPED):
    """Take ``key`` out of the snapshot's DCP metadata, re-hash ``.metadata`` in the manifest and sign it with the
    run's key: a snapshot as a capture that left the tensor out writes it (every checksum passes)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckpt_service import digest
    from ckpt_service.auth import load_key, sign

    md = FileSystemReader(str(step_dir)).read_metadata()
    assert key in md.state_dict_metadata, sorted(md.state_dict_metadata)[:5]
    del md.state_dict_metadata[key]
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
    data = pickle.dumps(md)
    (step_dir / ".metadata").write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][".metadata"].update({digest.manifest_algorithm(manifest): digest.of_bytes(data),
                                          "size": len(data)})
    (step_dir / "manifest.json").write_text(json.dumps(sign(manifest, load_key(str(step_dir.parents[2])))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """a: uninterrupted (the baseline); fall: a's directory as a job requeued after update 11 leaves it, snapshot
    10 lacking ``DROPPED`` on both nodes, restarted; changed: a's directory restarted with the buffered model."""
    base = tmp_path_factory.mktemp("loadable")
    job = base / "job.yaml"
    job.write_text(_job_text())
    changed = base / "changed.yaml"
    (base / "train_buffered.py").write_text(BUFFER_ENTRY)
    text, n = re.subn(r"(?m)^entry: \S+", f"entry: {base / 'train_buffered.py'}:main", _job_text())
    assert n == 1
    changed.write_text(text)
    r = {n: base / n for n in ("a", "fall", "changed")}
    out: dict = {"dirs": r}

    def fall():
        _as_if_requeued_after(r["a"], r["fall"])
        for node in ("node1", "node2"):
            _drop_a_key(r["fall"] / "node-local" / node / step_dirname(10))
        out["fall"] = _run(job, r["fall"])

    def model_changed():
        _as_if_requeued_after(r["a"], r["changed"])
        out["changed"] = _run(changed, r["changed"], "--allow-config-change", expect=None)
        out["changed_states"] = _states(r["changed"])
        out["status"] = run_cli(["accelpact_slurm.cli.status", str(r["changed"])], timeout=120)

    _run(job, r["a"])
    with ThreadPoolExecutor(max_workers=2) as pool:
        for f in [pool.submit(fall), pool.submit(model_changed)]:
            f.result()
    return out


@pytest.mark.multiproc
def test_a_snapshot_lacking_a_tensor_is_rejected_and_the_older_one_reproduces_the_run(runs):
    """Snapshot 10 passes its checksums on both nodes but lacks ``DROPPED``: every rank finds that before the load,
    10 is rejected on both nodes (state file, index, event naming the step, the path and the key), 5 is loaded, its
    replay matches and the run ends with the uninterrupted run's digest.

    Negative control: ``io.load(path)`` called bare in ``restore.reload`` (the fit and load rounds of
    ``loadfit.load_agreed`` taken out): DCP's planner raises its CheckpointException (a BaseException) on every
    rank, no rank decides, the launcher relaunches into the same crash (restarts 0..4) until the no-progress rule
    stops it with exit 76 and no summary (the run above fails its ``expect=0``: seen).
    """
    a, f = runs["dirs"]["a"], runs["dirs"]["fall"]
    (load,) = _events(f, "restart_load")
    assert load["step"] == 5 and load["path"] == str(f / "node-local" / "node1" / step_dirname(5))
    (skip,) = load["skipped"]
    assert skip["step"] == 10 and skip["reason"].startswith("cannot be restored: the model's state differs from "
                                                            "the snapshot's: missing " + DROPPED)
    assert "(on node1, node2)" in skip["reason"]
    rej = _events(f, "checkpoint", state="rejected")
    assert sorted((e["hostname"], e["step"], e["source"], e["path"]) for e in rej) == [
        (n, 10, "restore", str(f / "node-local" / n / step_dirname(10))) for n in ("node1", "node2")]
    assert all(e["reason"].startswith("cannot be restored: the model's state differs") and DROPPED in e["reason"]
               for e in rej)
    (chk,) = _events(f, "replay_check")
    assert (chk["snapshot"], chk["step"], chk["verdict"]) == (5, 6, "match")
    assert [e["step"] for e in _events(f, "step")] == list(range(6, STEPS + 1))
    assert _summary(f)["final_state_digest"] == _summary(a)["final_state_digest"]
    assert _summary(f)["losses"] == _summary(a)["losses"]
    assert not _events(f, "fail_stop") and {e["restart"] for e in _events(f, "job_start")} == {0}


@pytest.mark.multiproc
def test_a_model_no_snapshot_fits_stops_once_with_the_cause_and_is_not_relaunched(runs):
    """The model asks for a buffer per block that snapshots 5 and 10 never held: one start, every rank stops with
    "no snapshot can be restored: ..." naming both steps, the missing buffer and the fix, exit 76; the launcher
    does not start it again; nothing is rejected (the model's author may put the old model back); status shows
    the cause.

    Negative control: ``io.load(path)`` called bare in ``restore.reload``: the load raises DCP's
    CheckpointException on every rank, no rank decides, relaunched (restarts 0..4) until the no-progress rule ends
    it ("no progress: 3 consecutive restarts did not advance the committed frontier"), the cause named nowhere
    (seen: the no-relaunch assertion fails).
    """
    c = runs["dirs"]["changed"]
    proc = runs["changed"]
    assert proc.returncode == 76, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {e["restart"] for e in _events(c, "job_start")} == {0}  # no relaunch
    assert "relaunching" not in proc.stdout
    stops = _events(c, "fail_stop")
    assert len(stops) == 4 and {(e["exit_code"], e["cause"], e["phase"]) for e in stops} == {(76, "checkpoint",
                                                                                              "restore")}
    (reason,) = {e["reason"] for e in stops}
    assert reason.startswith("no snapshot can be restored: steps 10, 5: the model's state differs from the "
                             "snapshot's: missing model.layers.0.running_mean, model.layers.1.running_mean, "
                             "model.layers.2.running_mean (+1 more) (the model has them, the snapshot does not) "
                             "(on node1, node2); did the model change")
    assert "--run-dir" in reason and "\n" not in reason
    assert "(exit 76)" in proc.stdout and "no snapshot can be restored" in proc.stdout
    (load,) = _events(c, "restart_load")
    assert load["step"] is None and [s["step"] for s in load["skipped"]] == [10, 5]
    assert runs["changed_states"] == {n: [(5, "verified"), (10, "verified")] for n in ("node1", "node2")}
    assert not _events(c, "checkpoint", state="rejected") and not _events(c, "step")
    assert read_record(str(c / "node-local" / "node1" / step_dirname(10))).state == "verified"
    assert not (c / "summary.json").exists()
    assert "no snapshot can be restored" in runs["status"].stdout, runs["status"].stdout[-3000:]
