"""A failed Gloo group given a new transport in place (torch 2.14.1+), on two spawned ranks.

A collective one rank never joins times the other out; the group is dead after it (the negative
control: its next all-reduce fails).  Reconfigured over the same members, the same Python object
works again, with correct sums, and says which reconfigure it runs on.  On a release without the
call (2.13), and with ``ACCELPACT_REPAIR_REBUILD=1``, the repair must take the rebuild path.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from accelpact_slurm.repair import torch_compat as tc
from tests.conftest import free_port, spawn_ranks

WORLD = 2
HAS_RECONFIGURE = hasattr(dist, "_reconfigure")


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed import distributed_c10d as c10d

    torch.set_num_threads(1)
    res: dict = {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=30))
    try:
        store = c10d._get_default_store()
        res["can"] = tc.can_reconfigure(dist.group.WORLD)
        res["can_rebuild_forced"] = tc.can_reconfigure(dist.group.WORLD, {"ACCELPACT_REPAIR_REBUILD": "1"})
        if res["can"]:
            for variant in ("control", "reconfigured"):
                pg = tc.build_gloo_group([0, 1], dist.PrefixStore(variant, store), f"probe-{variant}", 1.0)
                t = torch.ones(1)
                dist.all_reduce(t, group=pg)
                if rank == 0:  # rank 1 withholds: rank 0 times out and the transport is dead
                    try:
                        dist.all_reduce(torch.ones(1), group=pg)
                    except RuntimeError:
                        pass
                store.set(f"{variant}/faulted/{rank}", "1")
                store.wait([f"{variant}/faulted/{r}" for r in range(WORLD)], timedelta(seconds=30))
                if variant == "reconfigured":
                    tc.reconfigure_group(pg, store, "probe/g1", 1, 10.0)
                    res["uuid"] = tc.reconfigured_uuid(pg)
                    res["same_rank"] = dist.get_rank(pg) == pg.rank() == rank
                sums = []
                for _ in range(3):
                    t = torch.full((1,), float(rank + 1))
                    try:
                        dist.all_reduce(t, group=pg)
                        sums.append(float(t))
                    except RuntimeError as exc:
                        sums.append(f"error: {str(exc)[:80]}")
                res[variant] = sums
                if variant == "reconfigured":  # and once more: a second repair of the same group
                    tc.reconfigure_group(pg, store, "probe/g2", 2, 10.0)
                    t = torch.ones(1)
                    dist.all_reduce(t, group=pg)
                    res["second"] = (tc.reconfigured_uuid(pg), float(t))
    except BaseException as exc:  # reported through the result file
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
            json.dump(res, fh)
        dist.barrier()
        os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("reconfigure")
    return spawn_ranks(_worker, (free_port(), str(out)), WORLD, out, 120)


@pytest.mark.multiproc
def test_a_failed_gloo_group_works_again_in_place_where_torch_can_reconfigure_it(ranks):
    for rank, res in ranks.items():
        assert "error" not in res, res
        assert res["can"] is HAS_RECONFIGURE, f"torch {torch.__version__}: reconfigure available = {HAS_RECONFIGURE}"
        assert res["can_rebuild_forced"] is False  # ACCELPACT_REPAIR_REBUILD=1: always the rebuild path
        if not HAS_RECONFIGURE:
            continue
        # Negative control: the group a peer left waiting is dead without the reconfigure ...
        assert all(isinstance(s, str) and s.startswith("error") for s in res["control"]), res["control"]
        # ... and the same object, reconfigured over the same members, sums right, in the same rank order.
        assert res["reconfigured"] == [3.0, 3.0, 3.0] and res["uuid"] == 1 and res["same_rank"], res
        assert res["second"] == [2, 2.0]
