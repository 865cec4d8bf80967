"""A daemon started again after a kill gets a snapshot from some of its node's ranks only: it lets go of it.

The killed daemon had taken snapshot 3 from local rank 0; the new one gets it from local rank 1 only, then
snapshot 6 from both.  A real daemon in this process, real shared-memory slots and descriptors as ranks stage
them; ``drain_and_close`` joins its threads, so the assertions read a settled state: no sleeps.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist DCP save

from ckpt_service import staging  # noqa: E402
from ckpt_service.daemon import Daemon, DaemonOptions  # noqa: E402
from tests.conftest import stage_half  # noqa: E402
from ckpt_service.index import scan  # noqa: E402

DEADLINE_S = 60.0


def _stage(daemon: Daemon, slot: staging.Slot, step: int, local_rank: int) -> dict:
    """Stage rank ``local_rank``'s half of ``step`` (rows 4*local_rank..) and hand it over; the daemon's reply."""
    return stage_half(daemon, slot, step, local_rank, torch.full((4, 8), float(step + local_rank)))


def test_a_snapshot_short_of_ranks_is_let_go_once_a_newer_one_is_complete(tmp_path):
    """Snapshot 3 from local rank 1 only stays pending (rank 0 handed it to the killed daemon); once snapshot 6
    is complete it is failed with the reason, its staging dropped and its slot released, and 6 is verified.

    Negative control: without the stale-step rule in ``Daemon._on_staged`` snapshot 3 stays pending to the end:
    ``released`` says False for it (the ranks' slot that holds it stays busy, and a snapshot that needs it is
    skipped)."""
    run_dir = str(tmp_path / "run")
    d = Daemon(DaemonOptions(node="node1", node_dir=str(tmp_path / "node1"), run_dir=run_dir, node_index=0,
                             num_nodes=1, job_id="t", drain_s=DEADLINE_S))
    d.start()
    try:
        slots = [[staging.Slot(staging.slot_path(d.stage_root, lr, i)) for i in range(2)] for lr in range(2)]
        assert _stage(d, slots[1][0], 3, 1)["complete"] is False
        assert d.handle({"op": "released", "step": 3, "timeout": 0})["released"] is False  # pending
        assert _stage(d, slots[0][1], 6, 0)["complete"] is False
        assert _stage(d, slots[1][1], 6, 1)["complete"] is True
        three = d.handle({"op": "released", "step": 3, "timeout": 0})
        assert three["released"] is True and three["state"] == "failed", three
        assert "earlier daemon" in three["reason"]
        assert not os.path.exists(staging.step_stage_dir(d.stage_root, 3))
        assert d.handle({"op": "wait", "step": 6, "timeout": DEADLINE_S})["state"] == "verified"
    finally:
        assert d.drain_and_close()
    assert {r.step: r.state for r in scan(d.ndir)} == {6: "verified"}
