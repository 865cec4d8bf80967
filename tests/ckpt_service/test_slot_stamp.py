"""A slot rewritten while the daemon still has to write it is never committed as the step it held before.

A real daemon (in this process) and a slot staged as a rank stages it.  The rank side's rule (reuse a slot only
once the daemon released it) is tested end to end with a stopped daemon in ``tests/e2e/test_stopped_daemon.py``;
this is the daemon's own guard behind it.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist DCP save

from ckpt_service import dcp_write, staging  # noqa: E402
from ckpt_service.capture import Box, Entry, Plan  # noqa: E402
from ckpt_service.daemon import Daemon, DaemonOptions  # noqa: E402
from ckpt_service.index import scan  # noqa: E402

DEADLINE_S = 60.0


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(DaemonOptions(node="node1", node_dir=str(tmp_path / "nvme" / "node1"), run_dir=str(tmp_path / "run"),
                             node_index=0, num_nodes=1, job_id="t", drain_s=DEADLINE_S))
    d.start()
    yield d
    assert d.drain_and_close()


def _stage(d: Daemon, slot: staging.Slot, step: int) -> str:
    """Copy a tensor full of ``step`` into ``slot`` as a rank does (stamp cleared, copy, stamp); its descriptor."""
    t = torch.full((4, 8), float(step))
    plan = Plan([Entry(("model", "w"), [4, 8], t.dtype, [Box([0, 0], [4, 8], t)])], {"lr": 0.1}, "test")
    nbytes = plan.layout()
    slot.ensure(staging.slot_bytes(nbytes))
    token = staging.new_token()
    staging.clear_stamp(slot.buf, nbytes)
    plan.copy_into(slot.buf)
    staging.write_stamp(slot.buf, nbytes, step, token)
    meta = {"job_id": "t", "config_digest": None, "config": None, "world_size": 1, "layout": [1, 1],
            "extra_json": json.dumps({"run": {"step": step}}), "capture": None}
    return staging.write_descriptor(d.stage_root, step, 0, {
        "step": step, "rank": 0, "local_rank": 0, "meta": meta, "slot": slot.path, "slot_ino": slot.ino,
        "nbytes": nbytes, "stamp": {"at": nbytes, "token": token}, "entries": plan.describe(), "plain": plan.plain,
        "source": plan.source})


def _hand_over(d: Daemon, step: int, desc: str) -> tuple[str, str | None]:
    assert d.handle({"op": "staged", "step": step, "local_rank": 0, "nranks": 1, "path": desc})["complete"]
    reply = d.handle({"op": "wait", "step": step, "timeout": DEADLINE_S})
    return reply["state"], reply["reason"]


def test_a_slot_restaged_before_the_write_fails_the_snapshot(daemon):
    """Step 3 staged, then the same slot (same file, same inode) restaged with step 4 before the daemon wrote 3, as
    a rank that took a silent daemon for a released slot did: 3 fails, nothing named step 3 is committed.
    Negative control: without the stamp check the daemon commits and verifies step 3 holding step 4's weights."""
    slot = staging.Slot(staging.slot_path(daemon.stage_root, 0, 0))
    desc3 = _stage(daemon, slot, 3)
    _stage(daemon, slot, 4)
    state, reason = _hand_over(daemon, 3, desc3)
    assert state == "failed" and "no longer holds snapshot 3: it is stamped with snapshot 4" in reason, reason
    assert [r.step for r in scan(daemon.ndir)] == []


@pytest.mark.slow
def test_a_slot_rewritten_during_the_write_is_not_committed(daemon, monkeypatch):
    """The rank starts restaging while the daemon writes (the stamp is cleared first): the check after the write,
    before the rename, fails the snapshot."""
    slot = staging.Slot(staging.slot_path(daemon.stage_root, 0, 0))
    desc = _stage(daemon, slot, 5)
    at = staging.read_descriptor(desc)["stamp"]["at"]
    real = dcp_write.fault_points.pause_point

    def restage_now(phase, ndir, step, faults):  # between the shard files and .metadata
        if phase == "writing":
            staging.clear_stamp(slot.buf, at)
        return real(phase, ndir, step, faults)

    monkeypatch.setattr(dcp_write.fault_points, "pause_point", restage_now)
    state, reason = _hand_over(daemon, 5, desc)
    assert state == "failed" and "no longer holds snapshot 5: its stamp was cleared" in reason, reason
    assert [r.step for r in scan(daemon.ndir)] == [] and not [n for n in os.listdir(daemon.ndir) if "step" in n]
    monkeypatch.undo()
    # an intact slot still goes through
    assert _hand_over(daemon, 6, _stage(daemon, slot, 6)) == ("verified", None)


def test_served_tells_a_live_daemon_from_a_gone_one(daemon, tmp_path):
    assert staging.served(daemon.ndir) is True  # the daemon holds ckptd.lock (a stopped one would too)
    assert staging.served(str(tmp_path / "never-served")) is False
