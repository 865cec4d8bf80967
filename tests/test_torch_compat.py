"""Notices when torch moves the private attributes the rebinders use (one process, a real Gloo world of 1)."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from accelpact_slurm.core.config import ModelConfig
from accelpact_slurm.repair import rebind as rb
from accelpact_slurm.repair import torch_compat as tc
from accelpact_slurm.workload.model import Block, build_model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    yield mesh
    dist.destroy_process_group()


CFG = ModelConfig(layers=2, width=16, heads=2, vocab=32, seq_len=8, dropout=0.0)


def test_fsdp1_slots_hold_the_replication_group(world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(build_model(CFG, 0), device_mesh=world, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
    rep = world.get_group("replicate")
    units = tc.fsdp1_units(model)
    assert len(units) == CFG.layers + 1
    for unit in units:
        for obj, attr in tc.fsdp1_slots(unit):
            assert getattr(obj, attr) is rep, (obj, attr)
    assert rep.group_name in tc.mesh_dim_group_names(world)
    ok, why = tc.fsdp_idle(model, "fsdp1")
    assert ok, why
    assert rb.find_references(tc.framework_roots(model, world), rep, world), "the scan must see live references"


def test_fsdp2_mesh_infos_hold_the_replication_group(world):
    from torch.distributed.fsdp import fully_shard

    model = build_model(CFG, 0)
    for layer in model.layers:
        fully_shard(layer, mesh=world)
    fully_shard(model, mesh=world)
    rep = world.get_group("replicate")
    infos = list(tc.fsdp2_mesh_infos(model))
    assert infos, "fully_shard state layout changed"
    slots = [s for info in infos for s in tc.fsdp2_slots(info)]
    assert slots and all(getattr(o, a) is rep for o, a in slots)
    ok, why = tc.fsdp_idle(model, "fsdp2")
    assert ok, why


def test_scan_finds_hidden_references_and_ignores_names():
    class PG:  # stands in for the object identity only
        group_name = "1"

    class Holder:
        def __init__(self, x):
            self.x = x

    old = PG.__new__(PG)
    assert rb.find_references([{"1": 1, "a": [Holder(Holder((0, old)))]}], old) == ["root0['a'][0].x.x[1]"]
    assert rb.find_references([{"1": "1", "k": Holder(3)}], old) == []

    class Slotted:
        __slots__ = ("s", "unset")

    slotted = Slotted()
    slotted.s = {old: 1}
    shared = [old]
    assert sorted(rb.find_references([old, slotted, (shared, shared), {3: {frozenset([old])}}], old)) == \
        ["root0", "root1.s[key]", "root2[1][0]", "root3[3][0][0]"]
