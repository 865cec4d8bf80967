"""Two real node daemons (in this process, each with its own node directory, socket and staging root) fed by
one staging rank each: the shared tier written once per job, and retention agreed across nodes.

Each snapshot is a small tensor staged exactly as a rank stages it (a shared-memory slot and a descriptor),
handed over with the daemon's ``staged`` request and awaited with its ``wait`` request; the daemons write,
verify, retain, publish and upload on their own threads.  ``drain_and_close`` joins those threads, so the
assertions read a settled state: no sleeps.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist DCP save

from accelpact_slurm.core.events import read_events  # noqa: E402
from ckpt_service import staging  # noqa: E402
from ckpt_service.auth import load_or_create_key  # noqa: E402
from ckpt_service.capture import Box, Entry, Plan  # noqa: E402
from ckpt_service.daemon import Daemon, DaemonOptions  # noqa: E402
from ckpt_service.index import read_indexes, read_record, scan  # noqa: E402
from ckpt_service.layout import step_dirname  # noqa: E402
from ckpt_service.verify import verify_snapshot  # noqa: E402

DEADLINE_S = 60.0


class Node:
    """One node: its real daemon and the one rank that stages its snapshots."""

    def __init__(self, run_dir: str, index: int, ndir: str, **opts) -> None:
        self.name = f"node{index + 1}"
        self.index = index
        self.daemon = Daemon(DaemonOptions(node=self.name, node_dir=ndir, run_dir=run_dir, node_index=index,
                                           num_nodes=2, job_id="t", drain_s=DEADLINE_S, **opts))
        self.daemon.start()
        self.slot = staging.Slot(staging.slot_path(self.daemon.stage_root, 0, 0))
        self.closed = False

    def snapshot(self, step: int) -> str:
        """Stage a snapshot of ``step``, hand it over, return its final state (verified | rejected | failed)."""
        t = torch.full((4, 8), float(step))
        plan = Plan([Entry(("model", "w"), [4, 8], t.dtype, [Box([0, 0], [4, 8], t)])], {"lr": 0.1}, "test")
        nbytes = plan.layout()
        self.slot.ensure(staging.slot_bytes(nbytes))
        token = staging.new_token()
        staging.clear_stamp(self.slot.buf, nbytes)
        plan.copy_into(self.slot.buf)
        staging.write_stamp(self.slot.buf, nbytes, step, token)
        meta = {"job_id": "t", "config_digest": None, "config": None, "world_size": 2, "layout": [2, 1],
                "extra_json": json.dumps({"run": {"step": step}}), "capture": None}
        desc = staging.write_descriptor(self.daemon.stage_root, step, 0, {
            "step": step, "rank": self.index, "local_rank": 0, "meta": meta, "slot": self.slot.path,
            "slot_ino": self.slot.ino, "nbytes": nbytes, "stamp": {"at": nbytes, "token": token},
            "entries": plan.describe(), "plain": plan.plain,
            "source": plan.source})
        reply = self.daemon.handle({"op": "staged", "step": step, "local_rank": 0, "nranks": 1, "path": desc})
        assert reply["ok"] and reply["complete"], reply
        return self.daemon.handle({"op": "wait", "step": step, "timeout": DEADLINE_S})["state"]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            assert self.daemon.drain_and_close(), f"{self.name}'s daemon did not drain within {DEADLINE_S} s"

    def steps(self) -> dict[int, str]:
        return {r.step: r.state for r in scan(self.daemon.ndir)}


@pytest.fixture
def nodes():
    started: list[Node] = []

    def start(*args, **kwargs) -> Node:
        started.append(Node(*args, **kwargs))
        return started[-1]

    yield start
    for n in started:
        n.close()


def _uploads(run_dir):
    return [e for e in read_events(os.path.join(run_dir, "events.jsonl")) if e["event"] == "shared_upload"]


# --------------------------------------------------------------------------- the shared tier, once per job


@pytest.mark.slow
def test_every_2nd_snapshot_reaches_the_shared_tier_once_verified_from_the_rotating_node(tmp_path, nodes):
    """Snapshots 1..8 on both nodes, shared_every 2: steps 2, 4, 6, 8 go up once each, by node index
    (n // 2) % 2 (node2, node1, node2, node1), as verified copies; the tier keeps the newest 2.

    Node1 settles all its snapshots (uploads and the tier's retention included) before node2 takes
    any, so which node copied what is fixed.  Negative control: with every node uploading every due
    snapshot, node1 uploads all four and node2 uploads 2 and 4 again (six uploads, four from node1).
    """
    run_dir = str(tmp_path / "run")
    opts = dict(every_steps=1, shared_every=2, shared_keep=2, keep_last=2)
    n1 = nodes(run_dir, 0, str(tmp_path / "nvme" / "node1"), **opts)
    assert [n1.snapshot(s) for s in range(1, 9)] == ["verified"] * 8
    n1.close()
    n2 = nodes(run_dir, 1, str(tmp_path / "nvme" / "node2"), **opts)
    assert [n2.snapshot(s) for s in range(1, 9)] == ["verified"] * 8
    n2.close()

    ups = _uploads(run_dir)
    assert sorted((e["step"], e["hostname"]) for e in ups) == [(2, "node2"), (4, "node1"), (6, "node2"),
                                                               (8, "node1")], ups
    assert all(e["ok"] and e["size_bytes"] > 0 and e["copy_s"] >= 0 for e in ups)
    # each upload applies the tier's retention: node2's late copy of 2 is older than node1's 4 and 8
    assert {e["step"]: e["pruned"] for e in ups} == {2: [2], 4: [], 6: [4], 8: []}
    shared = tmp_path / "run" / "shared-ckpt"
    assert sorted(os.listdir(shared)) == [step_dirname(6), step_dirname(8)]  # no .tmp- or .del- left over
    key = load_or_create_key(run_dir)
    for step, node in ((6, "node2"), (8, "node1")):
        copy = str(shared / step_dirname(step))
        assert read_record(copy).state == "verified"  # uploaded after its daemon verified it
        assert json.loads((shared / step_dirname(step) / "manifest.json").read_text())["node"] == node
        assert verify_snapshot(copy, key) == (True, "manifest authenticated, checksums and coverage pass")


# --------------------------------------------------------------------------- retention agreed across nodes


@pytest.fixture
def full_disk(tmp_path):
    """A directory whose writes can be made to fail: a 1 MiB tmpfs filled up (as root), else made read-only."""
    mnt = tmp_path / "small-nvme"
    mnt.mkdir()
    mounted = False
    if os.getuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                 capture_output=True, timeout=30).returncode == 0
    if os.getuid() == 0 and not mounted:
        pytest.skip("cannot mount a tmpfs here and root ignores a read-only mode")

    def fill(ndir: str) -> None:
        if not mounted:
            os.chmod(ndir, 0o500)  # no new .tmp-step-N: every write fails as on a full disk
            return
        with open(mnt / "filler", "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
        assert os.statvfs(mnt).f_bavail == 0

    yield mnt, fill
    if mounted:
        subprocess.run(["umount", "-l", str(mnt)], timeout=30)
    else:
        for root, dirs, _files in os.walk(mnt):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o700)


@pytest.mark.slow
def test_newest_common_step_survives_while_one_nodes_writes_keep_failing(tmp_path, nodes, full_disk):
    """Node2's disk is full from step 3 on: its writes of 3..6 fail, it keeps 1 and 2.  Node1 verifies
    every step and keeps its newest 2 (5, 6) plus step 2, the newest step verified on both nodes.

    Negative control: without the agreed rule node1 keeps [5, 6] only, and no step is left that every
    node holds (a restart would have to copy one node's snapshot to the others first).
    """
    mnt, fill = full_disk
    run_dir = str(tmp_path / "run")
    opts = dict(every_steps=1, shared_every=0, keep_last=2)
    n1 = nodes(run_dir, 0, str(tmp_path / "nvme" / "node1"), **opts)
    n2 = nodes(run_dir, 1, str(mnt / "node2"), **opts)
    for step in (1, 2):
        assert (n1.snapshot(step), n2.snapshot(step)) == ("verified", "verified")
    fill(str(mnt / "node2"))
    for step in (3, 4, 5, 6):
        assert (n1.snapshot(step), n2.snapshot(step)) == ("verified", "failed")
    n1.close()
    n2.close()
    assert n2.steps() == {1: "verified", 2: "verified"}
    assert n1.steps() == {2: "verified", 5: "verified", 6: "verified"}
    published = read_indexes(run_dir)
    common = set.intersection(*({s["step"] for s in snaps if s["state"] == "verified"} for snaps in published.values()))
    assert set(published) == {"node1", "node2"} and max(common) == 2
    failed = [e for e in read_events(os.path.join(run_dir, "events.jsonl"))
              if e["event"] == "checkpoint" and e["state"] == "failed"]
    assert sorted(e["step"] for e in failed) == [3, 4, 5, 6] and all(e["hostname"] == "node2" for e in failed)
