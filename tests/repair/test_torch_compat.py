"""Notices when torch moves the private attributes the rebinders use.

The probes run on a real 2 x 2 HSDP world (4 spawned ranks over Gloo): at world size 1 FSDP
falls back to NO_SHARD and the shard and replication groups are one group, so a probe that
picked the wrong slot would still pass.  Here the replication group {r % 2, r % 2 + 2} and the
shard group {2 (r // 2), 2 (r // 2) + 1} are distinct, and every slot must hold the former.
The model is defined here (an FSDP unit per Block), so the test needs no example workload.
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from accelpact_slurm.repair import rebind as rb
from accelpact_slurm.repair import torch_compat as tc
from tests.conftest import free_port, spawn_ranks

WORLD = 4
LAYERS = 2
WIDTH = 8
TIMEOUT_S = 20.0  # a rank that dies leaves its peers blocked at most this long
DEADLINE_S = 90.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _groups(rank, mesh):
    rep, shard = mesh.get_group("replicate"), mesh.get_group("shard")
    assert rep is not shard, "the 2 x 2 mesh must have two distinct groups"
    assert dist.get_process_group_ranks(rep) == [rank % 2, rank % 2 + 2]
    assert dist.get_process_group_ranks(shard) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert tc.mesh_dim_group_names(mesh) == [rep.group_name, shard.group_name]
    return rep, shard


def _step_probing_idle(model, inner_block, fsdp):
    """One forward/backward; returns what ``fsdp_idle`` said inside a unit's forward and after."""
    seen = []
    h = inner_block.register_forward_pre_hook(lambda *_: seen.append(tc.fsdp_idle(model, fsdp)))
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()
    h.remove()
    assert seen, "the forward hook did not run"
    return seen[0], tc.fsdp_idle(model, fsdp)


def _fsdp1(rank, mesh):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rep, shard = _groups(rank, mesh)
    model = FSDP(Net(), device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
    units = tc.fsdp1_units(model)
    assert len(units) == LAYERS + 1
    for unit in units:
        assert unit.sharding_strategy == ShardingStrategy.HYBRID_SHARD, unit.sharding_strategy
        assert unit.process_group is shard, "FSDP1 shards over the shard group"
        slots = tc.fsdp1_slots(unit)
        assert len(slots) == 2
        for obj, attr in slots:
            assert getattr(obj, attr) is rep, (type(obj).__name__, attr)
            assert getattr(obj, attr) is not shard

    inside, after = _step_probing_idle(model, units[1].module, "fsdp1")
    assert not inside[0], f"fsdp_idle said idle inside a forward: {inside}"
    assert after[0], after

    found = rb.find_references(tc.framework_roots(model, mesh), rep, mesh)
    assert any("_inter_node_pg" in p for p in found), found
    assert any("process_group" in p and "_inter_node_state" in p for p in found), found
    assert not set(found) & set(rb.find_references(tc.framework_roots(model, mesh), shard, mesh))


def _fsdp2(rank, mesh):
    from torch.distributed.fsdp import fully_shard

    rep, shard = _groups(rank, mesh)
    model = Net()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    infos = list(tc.fsdp2_mesh_infos(model))
    assert len(infos) >= LAYERS + 1, "fully_shard state layout changed"
    for info in infos:
        slots = tc.fsdp2_slots(info)
        assert len(slots) == 1, f"{type(info).__name__} has no replication slot"
        obj, attr = slots[0]
        assert getattr(obj, attr) is rep, (type(info).__name__, attr)
        assert info.shard_process_group is shard, "FSDP2 shards over the shard group"
        assert getattr(obj, attr) is not shard

    inside, after = _step_probing_idle(model, model.blocks[0], "fsdp2")
    assert not inside[0], f"fsdp_idle said idle inside a forward: {inside}"
    assert after[0], after


def _mesh_rebind(rank, mesh):
    from torch.distributed import distributed_c10d as c10d

    old, shard = _groups(rank, mesh)
    members = [rank % 2, rank % 2 + 2]
    name = f"compat-rep-{rank % 2}"
    before = tc.registered_groups()
    new = tc.build_gloo_group(members, dist.PrefixStore(f"compat/{name}", c10d._get_default_store()), name, TIMEOUT_S)
    assert tc.registered_groups() == before + 1
    assert tc.group_name(new) == name and dist.get_process_group_ranks(new) == members
    assert tc.mesh_set_dim_group(mesh, 0, new) >= 1
    assert mesh.get_group("replicate") is new and mesh.get_group("shard") is shard
    assert tc.mesh_dim_group_names(mesh) == [name, shard.group_name]
    assert tc.mesh_set_dim_group(mesh, 0, new) == 0, "rebinding twice changes nothing"
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=new)
    assert t.item() == float(sum(members))
    assert not rb.find_references([mesh, mesh._get_root_mesh()], old, mesh)


def _tap(rank, mesh):
    """Every collective FSDP1 and FSDP2 issue in a forward and backward reaches the tap, on both groups (the
    detector watches them there): a torch that moved them to other methods fails here."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rep, shard = _groups(rank, mesh)
    seen: dict[str, set[str]] = {}

    def on_call(pg, method, original, args, kwargs):
        kind = "replicate" if pg is rep else "shard" if pg is shard else "other"
        seen.setdefault(kind, set()).add(method)
        return original(pg, *args, **kwargs)

    patched = tc.install_collective_tap(on_call)
    try:
        assert "allreduce" in patched
        fsdp1 = FSDP(Net(), device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                     auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu"))
        _step_probing_idle(fsdp1, tc.fsdp1_units(fsdp1)[1].module, "fsdp1")
        assert {"replicate", "shard"} <= set(seen), seen
        assert "allreduce" in seen["replicate"], seen  # the replication all-reduce of HSDP's gradients
        assert len(seen["shard"]) >= 2, seen  # all-gathers and reduce-scatters
        seen.clear()
        fsdp2 = Net()
        for b in fsdp2.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(fsdp2, mesh=mesh)
        _step_probing_idle(fsdp2, fsdp2.blocks[0], "fsdp2")
        assert "allreduce" in seen.get("replicate", ()) and len(seen.get("shard", ())) >= 2, seen
    finally:
        tc.remove_collective_tap()
    seen.clear()
    t = torch.ones(1)
    dist.all_reduce(t, group=rep)
    assert not seen, "the tap is gone once removed"


def _set_timeout(rank, mesh):
    """A group's timeout is set without a deprecated call (torch 2.14.1 deprecated ``_set_pg_timeout``), and it
    holds: a collective a peer never joins ends at the new timeout."""
    import time
    import warnings

    from torch.distributed import distributed_c10d as c10d

    pg = tc.build_gloo_group([0, 1, 2, 3], c10d._get_default_store(), f"timeout-{rank // 4}", 60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning would raise here
        tc.set_group_timeout(pg, 0.5)
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=pg)
        except RuntimeError:
            took = time.monotonic() - t0
            assert took < 20, f"the collective waited {took:.1f} s, not the 0.5 s timeout set"
        else:
            raise AssertionError("a collective no peer joined completed")
    tc.retire_group(pg)


SECTIONS = {"fsdp1": _fsdp1, "fsdp2": _fsdp2, "tap": _tap, "mesh_rebind": _mesh_rebind,
            "set_timeout": _set_timeout}


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    results = {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for g in (mesh.get_group("replicate"), mesh.get_group("shard")):
            tc.set_group_timeout(g, TIMEOUT_S)
        for name, fn in SECTIONS.items():
            try:
                fn(rank, mesh)
                results[name] = "ok"
            except BaseException as exc:  # reported to the test through the result file
                results[name] = f"FAIL {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
            json.dump(results, fh)
        dist.barrier()  # rank 0 hosts the store: nobody leaves before everyone is done with it
        # Leave without Gloo's teardown: with groups replaced mid-run it can abort the process at exit
        # ("terminate called without an active exception") after every result is written.
        os._exit(0)



@pytest.fixture(scope="module")
def hsdp_2x2(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat")
    return spawn_ranks(_worker, (free_port(), str(out)), WORLD, out, DEADLINE_S)


def _check(results, section):
    for r, res in results.items():
        assert res.get(section) == "ok", f"rank {r}, {section}: {res.get(section, 'not run')}"


@pytest.mark.multiproc
def test_fsdp1_slots_hold_the_replication_group(hsdp_2x2):
    _check(hsdp_2x2, "fsdp1")


@pytest.mark.multiproc
def test_fsdp2_mesh_infos_hold_the_replication_group(hsdp_2x2):
    _check(hsdp_2x2, "fsdp2")


@pytest.mark.multiproc
def test_the_collective_tap_sees_every_fsdp_collective_on_both_groups(hsdp_2x2):
    _check(hsdp_2x2, "tap")


@pytest.mark.multiproc
def test_mesh_dimension_rebinds_to_a_new_group(hsdp_2x2):
    _check(hsdp_2x2, "mesh_rebind")


@pytest.mark.multiproc
def test_a_group_timeout_is_set_through_the_current_api_and_holds(hsdp_2x2):
    _check(hsdp_2x2, "set_timeout")


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


def test_scan_of_several_groups_in_one_walk_misses_nothing_it_prunes():
    """One walk for several groups; another object of a target's type seen first does not hide the target;
    empty containers are not entered, but an OrderedDict with attributes is; slots of base classes and a
    deque's items are followed."""
    from collections import OrderedDict, deque

    class PG:
        def __init__(self, name):
            self.group_name = name

    a, b, other = PG("1"), PG("2"), PG("3")

    class Base:
        __slots__ = ("__hidden", "plain")

    class Derived(Base):
        __slots__ = ("extra",)

    d = Derived()
    d._Base__hidden = b
    d.plain = other
    od = OrderedDict()
    od.note = a
    roots = [{"first": other, "empty": {}, "od": od}, [(), [], OrderedDict()], d, deque([[a]])]
    found = rb.find_references_to(roots, {"a": a, "b": b})
    assert sorted(found["a"]) == ["root0['od'].note", "root3[0][0]"]
    assert found["b"] == ["root2._Base__hidden"]
    assert sorted(rb.find_references(roots, other)) == ["root0['first']", "root2.plain"]


def test_a_walk_ahead_reads_its_finds_back_after_the_rebinding_and_walks_again_where_one_stays():
    """The repair's walk taken while its vote is in flight records where each reference is held (an attribute, a
    slot, a mapping's value and key, a list's and a set's item); after a rebinding that replaced every one,
    reading those places back finds none.  One the rebinding missed is found, with its path (the control: a read
    back that trusted the rebinding would miss it).  A holder the rebinding replaced instead of changing leaves
    the old one holding the group: the full walk then decides, and finds none reachable."""
    class PG:
        group_name = "1"

    class Holder:
        def __init__(self, x):
            self.x = x

    class Slotted:
        __slots__ = ("s",)

    old, new = PG(), PG()
    slotted = Slotted()
    slotted.s = old
    state = {"attr": Holder(old), "slot": slotted, "value": {"pg": old}, "key": {old: 1}, "list": [0, old],
             "set": {old}}
    ahead = rb.WalkAhead([state], old)
    assert ahead.found == 6 and len(ahead.locations) == 6
    state["attr"].x, slotted.s, state["value"]["pg"], state["list"][1] = new, new, new, new
    state["key"][new] = state["key"].pop(old)
    state["set"].discard(old)
    state["set"].add(new)
    assert ahead.left(lambda: [state], None) == []
    missed = rb.WalkAhead([state], new)  # now a rebinding from `new` that misses the mapping's value
    state["attr"].x, slotted.s, state["list"][1] = old, old, old
    state["key"][old] = state["key"].pop(new)
    state["set"] = {old}
    assert missed.left(lambda: [state], None) == ["root0['value']['pg']"]
    replaced = rb.WalkAhead([state], old)
    holder = state["attr"]
    state["attr"] = Holder(new)  # the holder replaced, not changed: the old one still holds the group
    assert any(h is holder and rb.holds(h, how, key, old) for h, how, key in replaced.locations)
    for k in ("slot", "key", "list", "set"):
        state[k] = None
    assert replaced.left(lambda: [state], None) == []


def test_an_fsdp2_parameter_loses_every_gradient_whichever_form_its_release_gives_the_accumulated_one():
    """Up to torch 2.14 ``unsharded_accumulated_grad`` is an attribute of its own; 2.15 makes it a read-only property
    reading ``_unsharded_param.grad``.  The drop handles both, and this release's ``FSDPParam`` has one of them."""
    import inspect

    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    def grad_param():
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        return p

    class Attribute:  # torch 2.13 / 2.14
        def __init__(self):
            self._unsharded_param, self.sharded_param = grad_param(), grad_param()
            self.unsharded_accumulated_grad = torch.ones(2)

    class Alias:  # torch 2.15
        def __init__(self):
            self._unsharded_param, self.sharded_param = grad_param(), grad_param()

        @property
        def unsharded_accumulated_grad(self):
            return self._unsharded_param.grad

    a, b = Attribute(), Alias()
    assert tc.fsdp2_drop_param_grads(a) == ["unsharded_grads", "accumulated_grads", "sharded_grads"]
    assert a.unsharded_accumulated_grad is None and a._unsharded_param.grad is None and a.sharded_param.grad is None
    assert tc.fsdp2_drop_param_grads(b) == ["unsharded_grads", "sharded_grads"]
    assert b.unsharded_accumulated_grad is None and b.sharded_param.grad is None
    with pytest.raises(AttributeError):  # the control: what assigning the 2.15 form does
        b.unsharded_accumulated_grad = None
    form = inspect.getattr_static(FSDPParam, "unsharded_accumulated_grad", None)
    if form is not None:  # this release's class: a property without a setter, or a plain instance attribute
        assert isinstance(form, property) and form.fset is None, form
