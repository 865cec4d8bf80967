"""``replace``, ``rebind`` and ``validate`` against a fake control plane, on real Gloo groups of a world of one.

A spawned process (Gloo's teardown stays out of pytest's) builds the replacement group under a fresh
prefix, rebinds, scans and validates.  The rebinding scan must find a reference to the retired group
that the framework's rebinders do not know about (the negative control of the invariant: a holder
object left pointing at the old group), and the clean case must pass all three phases.  A replaced group
that is the default group (DeviceMesh's group for a dimension spanning the world) is not destroyed: that
would destroy every other group of the process.  ``ACCELPACT_REPAIR_REBUILD=1``: this is the path of torch 2.13
and of GPU groups on every release, tested here on each (2.14.1+ would otherwise reconfigure a Gloo group in
place: ``test_group_reconfigure.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

SCRIPT = textwrap.dedent('''
    import io, json, os, sys
    from types import SimpleNamespace
    import torch, torch.distributed as dist
    from accelpact_slurm.core.errors import FailStop
    from accelpact_slurm.repair.engine import RepairEngine, RepairContext, Replaced
    from accelpact_slurm.repair import torch_compat as tc
    from accelpact_slurm.runtime.job.topology import Layout, Runtime

    class Control:
        def __init__(self, generation):
            self.generation, self.base_store = generation, dist.HashStore()
        def all_gather(self, name, value, ranks=None, timeout_s=None):
            return [value]
        def set_generation(self, g):
            self.generation = g

    class Holder(torch.nn.Module):
        """A module that cached the replication group where no rebinder looks."""
        def __init__(self, pg):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.cached = {"pg": pg}

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    out = {}
    for case in ("clean", "stale", "clean-ahead", "stale-ahead"):
        old = tc.build_gloo_group([0], dist.PrefixStore(f"old-{case}", store), f"old-{case}", 5)
        rt = SimpleNamespace(rank=0, layout=Layout(1, 1), local_rank=0, control=Control({"clean": 0, "stale": 5, "clean-ahead": 10, "stale-ahead": 12}[case]), replicate_group=old,
                             mesh=None, collective_timeout_s=5)
        model = Holder(old) if case.startswith("stale") else torch.nn.Linear(2, 2)
        # the runtime's own applier takes over what the engine returns (the engine assigns nothing to rt)
        engine = RepairEngine(model, rt, SimpleNamespace(emit=lambda *a, **k: None), fsdp="fsdp1", out=io.StringIO(),
                              on_replaced=lambda replaced, rt=rt: Runtime.adopt(rt, replaced))
        ctx = RepairContext(frontier=3, ranks=[0], observed=0.0, key="<k>", reason="test")
        if case.endswith("-ahead"):  # the walk the guard takes while its vote is in flight
            ctx.ahead = engine.walk_ahead()
        try:
            for phase in ("observe", "control_barrier", "replace", "rebind", "validate"):
                getattr(engine, phase)(ctx)
            out[case] = {"ok": True, "new_is_bound": rt.replicate_group is ctx.new and ctx.new is not old,
                         "returned": ctx.replaced == Replaced(replicate_group=ctx.new),
                         "name": tc.group_name(ctx.new), "generation": rt.control.generation,
                         "read_back": "rebind.walk_ahead" in ctx.parts}
        except FailStop as stop:
            out[case] = {"ok": False, "reason": stop.reason, "exit": stop.exit_code}

    # DeviceMesh hands out the default group for a dimension spanning the world (the replication dimension of
    # N nodes x 1 rank): retiring it after the repair must leave the other groups registered and usable.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed import distributed_c10d as c10d
    world = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")).get_group("replicate")
    was_default = world is dist.group.WORLD
    shard = tc.build_gloo_group([0], dist.PrefixStore("shard-world", store), "shard-world", 5)
    rt = SimpleNamespace(rank=0, layout=Layout(1, 1), local_rank=0, control=Control(7), replicate_group=world,
                         shard_group=shard, mesh=None, collective_timeout_s=5)
    engine = RepairEngine(torch.nn.Linear(2, 2), rt, SimpleNamespace(emit=lambda *a, **k: None), fsdp="fsdp1",
                          out=io.StringIO())
    ctx = RepairContext(frontier=3, ranks=[0], observed=0.0, key="<k>", reason="test")
    for phase in ("observe", "control_barrier", "replace", "rebind", "validate"):
        getattr(engine, phase)(ctx)
    got = [None]
    try:
        dist.gather_object("digest", got, dst=0, group=rt.shard_group)  # what the final state digest does
        gathered = got
    except Exception as exc:
        gathered = f"{type(exc).__name__}: {exc}"
    out["world"] = {"was_default": was_default, "initialized": dist.is_initialized(),
                    "registered": sorted(c10d._world.pg_names.get(g, "?") for g in (shard, ctx.new)
                                         if g in c10d._world.pg_map),
                    "gathered": gathered, "empty_tags": sorted(t for t, g in c10d._world.tags_to_pg.items() if not g)}
    print(json.dumps(out), flush=True)
    os._exit(0)
''')


@pytest.fixture(scope="module")
def results():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin",
                                         # the rebuild path on every release (2.14.1+ would reconfigure in place)
                                         "ACCELPACT_REPAIR_REBUILD": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_replace_rebind_validate_on_a_real_group(results):
    clean = results["clean"]
    assert clean["ok"] and clean["new_is_bound"] and clean["returned"], clean
    assert clean["name"] == "accelpact-replicate-0-g1" and clean["generation"] == 1


def test_a_reference_the_rebinders_miss_fails_the_invariant_scan(results):
    stale = results["stale"]
    assert not stale["ok"] and stale["exit"] == 75, stale
    assert "rebinding invariant violated: 1 reference(s) to the retired group remain" in stale["reason"], stale
    assert "cached" in stale["reason"]


def test_with_the_walk_taken_during_the_vote_the_invariant_holds_and_fails_alike(results):
    """The engine reads back the finds of the walk taken while the vote was in flight (``walk_ahead``) instead of
    walking after the rebinding: the clean repair passes, and the reference the rebinders miss fails it the same
    way, named by its path."""
    clean, stale = results["clean-ahead"], results["stale-ahead"]
    assert clean["ok"] and clean["new_is_bound"] and clean["read_back"], clean
    assert not stale["ok"] and stale["exit"] == 75, stale
    assert "rebinding invariant violated: 1 reference(s) to the retired group remain" in stale["reason"], stale
    assert "cached" in stale["reason"]


def test_retiring_the_default_group_leaves_every_other_group_registered(results):
    """2 nodes x 1 rank: the replication group is the default group.  Destroying it at its repair would destroy
    every group of the process (the new one and the untouched shard group included), and the final digest's
    gather on the shard group would fail with "Group ... is not registered"."""
    world = results["world"]
    assert world["was_default"] and world["initialized"], world
    assert world["registered"] == ["accelpact-replicate-0-g8", "shard-world"], world
    assert world["gathered"] == ["digest"], world


def test_a_retired_group_leaves_no_entry_in_the_registries(results):
    """After the replaced groups of the clean and stale cases were retired, c10d's tag registry keeps no empty
    entry for them (one per retired group would grow with every repair)."""
    assert results["world"]["empty_tags"] == [], results["world"]
