"""Pure parts of the checkpoint service: retention, selection, names, records, peer check, reassembly."""

from __future__ import annotations

import json
import math
import os

import pytest

from ckpt_service.index import common_step, newest_verified, read_record, record_state, scan
from ckpt_service.layout import node_dir, socket_path, step_dirname, step_of
from ckpt_service.protocol import peer_allowed
from ckpt_service.retention import Snap, is_milestone, plan_retention


def _deleted(snaps, keep=2, m=0):
    return [s for s, _ in plan_retention([Snap(*x) for x in snaps], keep, m)[0]]


V, C, R = "verified", "committed", "rejected"


@pytest.mark.parametrize("snaps, keep, m, expect", [
    ([], 2, 0, []),
    ([(10, V)], 2, 0, []),
    ([(10, V), (20, V)], 2, 0, []),
    ([(10, V), (20, V), (30, V)], 2, 0, [10]),
    ([(10, V), (20, V), (30, V), (40, V)], 3, 0, [10]),
    ([(10, V), (20, V), (30, V), (40, V)], 2, 20, [10]),  # 20 is a milestone
    ([(10, V), (20, C), (30, C)], 2, 0, []),  # 10 is the newest verified: never deleted
    ([(10, V), (20, V), (30, C), (40, C)], 2, 0, [10]),  # 20 newest verified, 30/40 pending
    ([(10, V), (20, R), (30, V)], 2, 0, []),  # rejected does not count toward the window
    ([(10, V), (20, V), (30, R), (40, V)], 2, 0, [10]),  # rejected 30 is inside the window span
    ([(10, R), (20, V), (30, V), (40, V)], 2, 0, [10, 20]),
    ([(10, V), (20, V), (30, V), (40, R), (50, R)], 2, 0, [10]),  # newest rejected stay visible
    ([(5, V), (10, V), (15, V), (20, V), (25, V)], 2, 10, [5, 15]),
    ([(10, C), (20, C), (30, C)], 2, 0, []),  # nothing verified yet: pending work is kept
])
def test_retention(snaps, keep, m, expect):
    assert _deleted(snaps, keep, m) == expect


def test_retention_reasons_and_keep_last_guard():
    deletions, why = plan_retention([Snap(1, V), Snap(2, V), Snap(3, V)], 2)
    assert deletions == [(1, "outside the newest 2 and not a milestone")] and "delete 1 of 3" in why
    assert "nothing to delete" in plan_retention([Snap(1, V)], 2)[1]
    with pytest.raises(ValueError, match="keep_last must be >= 2"):
        plan_retention([], 1)


def test_milestone():
    assert is_milestone(20, 10) and not is_milestone(25, 10) and not is_milestone(20, 0) and not is_milestone(0, 5)


@pytest.mark.parametrize("snaps, step, reason", [
    ([], None, "no snapshot at all"),
    ([{"step": 1, "state": C}], None, "none of 1 snapshot(s) is verified"),
    ([{"step": 1, "state": V}, {"step": 2, "state": R}], 1, "step 1"),
    ([{"step": 3, "state": V}, {"step": 1, "state": V}, {"step": 4, "state": C}], 3, "step 3"),
])
def test_newest_verified(snaps, step, reason):
    best, why = newest_verified(snaps)
    assert (best["step"] if best else None) == step and reason in why


@pytest.mark.parametrize("avail, step, reason", [
    ([], None, "no ranks"),
    ([[4, 8], [4, 8]], 8, "newest verified step every rank"),
    ([[4, 8], [4]], 4, "step 8 is verified on some nodes only"),
    ([[4], []], None, "rank(s) [1] can reach no"),
    ([[4], [8]], None, "no verified step is reachable"),
    ([[], []], None, "rank(s) [0, 1]"),
])
def test_common_step(avail, step, reason):
    got, why = common_step(avail)
    assert got == step and reason in why


def test_names_and_paths(tmp_path):
    assert step_dirname(7) == "step-0000000007" and step_of("step-0000000007") == 7
    assert step_of(".tmp-step-0000000007-12") is None and step_of("step-7") is None
    assert sorted([step_dirname(10), step_dirname(9)]) == [step_dirname(9), step_dirname(10)]
    assert node_dir("/r", "node1") == "/r/node-local/node1"
    os.environ["ACCELPACT_TEST_JOB"] = "42"
    assert node_dir("/r", "n1", "/nvme/${ACCELPACT_TEST_JOB}") == "/nvme/42/n1"
    long = tmp_path / ("x" * 200)
    assert len(socket_path(str(long))) < 100  # Unix socket paths are limited to 107 bytes


def test_peer_allowed():
    assert peer_allowed(1000, 1000)[0]
    ok, why = peer_allowed(65534, 1000)
    assert not ok and "65534" in why


def test_records_and_scan(tmp_path):
    d = tmp_path / step_dirname(3)
    d.mkdir()
    (tmp_path / ".tmp-step-0000000004-1").mkdir()
    rec = read_record(str(d))
    assert rec.state == "rejected" and "manifest" in rec.reason  # no manifest: never trusted
    (d / "manifest.json").write_text(json.dumps({"created": 5.0, "files": {}}))
    assert read_record(str(d)).state == "committed"  # renamed but not recorded
    record_state(str(d), "verified")
    record_state(str(d), "rejected", "bit flip")
    recs = scan(str(tmp_path))
    assert [(r.step, r.state, r.reason) for r in recs] == [(3, "rejected", "bit flip")]
    assert len(json.loads((d / "state.json").read_text())["history"]) == 2


def _stage_rows(root, t, rows, local_rank, step=7):
    """Stage rows [lo, hi) of ``t`` (cut at an element inside a row) the way a rank does."""
    from ckpt_service import staging
    from ckpt_service.capture import Box, Entry, Plan, range_boxes

    flat = t.reshape(-1)
    lo, hi = rows
    cuts = range_boxes(list(t.shape), lo, hi)
    boxes = [Box(o, s, flat[f:f + math.prod(s)]) for o, s, f in cuts]
    plan = Plan([Entry(("model", "w"), list(t.shape), t.dtype, boxes)], {"model": {}, "lr": 1}, "test")
    slot = staging.Slot(staging.slot_path(str(root), local_rank, 0))
    nbytes = plan.layout()
    slot.ensure(nbytes)
    plan.copy_into(slot.buf)
    return {"step": step, "rank": local_rank, "local_rank": local_rank, "slot": slot.path, "slot_ino": slot.ino,
            "nbytes": nbytes, "entries": plan.describe(), "plain": plan.plain, "_slot": slot}


def test_boxes_are_written_as_dcp_chunks_and_a_missing_rank_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from accelpact_slurm.core.errors import CheckpointError
    from ckpt_service import staging
    from ckpt_service.dcp_write import build_state

    t = torch.arange(35.0).reshape(5, 7)
    descs = [_stage_rows(tmp_path / "shm", t, (0, 17), 0), _stage_rows(tmp_path / "shm", t, (17, 35), 1)]
    for d in descs:
        d["buf"] = staging.map_slot(d["slot"], d["slot_ino"], d["nbytes"])
    state, tensors = build_state(descs)
    assert len(tensors[("model", "w")].chunks) == 4  # 17 = 2 rows + 3: two boxes per rank
    from ckpt_service.dcp_write import _planner

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ck")), planner=_planner(), no_dist=True)
    back = {"model": {"w": torch.zeros(5, 7)}, "lr": 0}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "ck")), no_dist=True)  # stock load
    assert torch.equal(back["model"]["w"], t) and back["lr"] == 1
    with pytest.raises(CheckpointError, match="cover 17 of 35"):
        build_state(descs[:1])
    # a slot replaced after staging (a restarted daemon cleared the staging root) is never read
    os.unlink(descs[1]["slot"])
    staging.Slot(descs[1]["slot"]).ensure(descs[1]["nbytes"])
    with pytest.raises(OSError, match="replaced"):
        staging.map_slot(descs[1]["slot"], descs[1]["slot_ino"], descs[1]["nbytes"])


def test_private_torch_shim_still_resolves():
    pytest.importorskip("torch")
    from ckpt_service.compat import zstd_extensions

    assert zstd_extensions(False) == [] and len(zstd_extensions(True)) == 1


def test_shared_tier_copy_is_atomic_and_first_wins(tmp_path):
    from ckpt_service.tiers import copy_to_shared

    src = tmp_path / "n1" / step_dirname(10)
    src.mkdir(parents=True)
    (src / ".metadata").write_bytes(b"m")
    (src / "manifest.json").write_text("{}")
    shared = tmp_path / "shared"
    path, why = copy_to_shared(str(src), str(shared), "node1")
    assert path == str(shared / step_dirname(10)) and (shared / step_dirname(10) / ".metadata").read_bytes() == b"m"
    again, why = copy_to_shared(str(src), str(shared), "node2")
    assert again is None and "already exists" in why
    assert os.listdir(shared) == [step_dirname(10)]  # no temporary copy left behind


def test_restore_prefers_the_node_copy_over_the_shared_tier(tmp_path):
    from accelpact_slurm.runtime.state.restore import reachable_verified

    for d in (tmp_path / "node" / step_dirname(4), tmp_path / "shared" / step_dirname(4),
              tmp_path / "shared" / step_dirname(8)):
        d.mkdir(parents=True)
        (d / "manifest.json").write_text("{}")
        record_state(str(d), "verified")
    got = reachable_verified(str(tmp_path / "node"), str(tmp_path / "shared"))
    assert got == {4: str(tmp_path / "node" / step_dirname(4)), 8: str(tmp_path / "shared" / step_dirname(8))}


def test_slot_pinning_is_for_gpu_plans_only(tmp_path):
    """On a CPU-only host a plan is not on a GPU and the slot stays pageable; the copy is the same either way
    (the GPU side, page-locked slot and side stream, is measured by scripts/gpu-check.sh --parts slot)."""
    torch = pytest.importorskip("torch")
    from ckpt_service import staging
    from ckpt_service.capture import Box, Entry, Plan

    t = torch.arange(10, dtype=torch.float32)
    plan = Plan([Entry(("model", "w"), [10], t.dtype, [Box([0], [10], t)])], {}, "test")
    slot = staging.Slot(str(tmp_path / "rank-0.slot-0"))
    slot.ensure(plan.layout())
    assert plan.on_gpu is False
    assert slot.pin() is torch.cuda.is_available() and slot.pinned is torch.cuda.is_available()
    assert plan.copy_into(slot.buf) == 40
    assert torch.equal(next(plan.regions(slot.buf))[2], t)
    slot.unpin()
    assert slot.pinned is False
