"""L1 repair of a replication fault in backward: discard the update, replace every group, redo it bitwise.

One spawned 2 nodes x 2 ranks Gloo world (collective timeout 2 s) runs every scenario, each on a
fresh model and on fresh HSDP groups, for the three wrappings (FSDP1 on the 2-D mesh with
``use_orig_params=True``, FSDP1 on an explicit (shard, replicate) group pair with
``use_orig_params=False``, FSDP2 ``fully_shard`` on the 2-D mesh): a root unit and three
Linear/ReLU/Dropout blocks, each its own unit, AdamW, 6 updates, a fixed seed.

- ``reference``: uninterrupted.
- ``repair``: in update 4 rank 1 withholds its replication all-reduces in backward; every rank learns
  of the fault from a vote over the store (before ``optimizer.step``), calls ``discard_update`` and
  ``replace_broken_groups``, restores the RNG state saved at the update's start and redoes the update
  on the same batch.  Each rank's digest of its local shards (weights and AdamW state) must equal the
  reference's, bit for bit.
- ``no_rng``, ``no_discard`` and ``partial``: the same without the RNG restore, without
  ``discard_update``, with only part of it (FSDP2: torch's ``reset_iter_state`` alone; FSDP1: the
  half-reduced ``_saved_grad_shard`` kept): negative controls, the digest differs or the redo fails.

The time of discard, replacement (build, rebind, scan, retire) per rank is printed (``pytest -s``);
on a 2-core machine it was a few tens of milliseconds per rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from tests.conftest import free_port, spawn_ranks

WORLD = 4
RPN = 2  # ranks per node: replicate = dim 0 (nodes), shard = dim 1
WIDTH = 16
STEPS = 6
FAULT_STEP = 4
FAULT_RANK = 1
TIMEOUT_S = 2.0  # the data plane's collective timeout
VOTE_S = 20.0  # a vote waits past the collective timeout (plus stalls)
DEADLINE_S = 150.0
WRAPPINGS = ("fsdp1_mesh", "fsdp1_pair", "fsdp2_mesh")
VARIANTS = ("reference", "repair", "no_rng", "no_discard", "partial")
# FSDP2 with set_separate_reduce_scatter_group: its reduce-scatter on a group of its own, replaced too.
SCENARIOS = [(w, v) for w in WRAPPINGS for v in VARIANTS] + [("fsdp2_rs", "reference"), ("fsdp2_rs", "repair")]

pytestmark = pytest.mark.multiproc


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        return self.drop(self.act(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _fresh_groups(rank, mesh, store, tag):
    """New shard and replication groups for one scenario, the mesh pointed at them."""
    from accelpact_slurm.repair import torch_compat as tc

    node, local = divmod(rank, RPN)
    rep = tc.build_gloo_group([n * RPN + local for n in range(WORLD // RPN)],
                              dist.PrefixStore(f"{tag}/init/rep/{local}", store), f"{tag}-rep-{local}", TIMEOUT_S)
    shard = tc.build_gloo_group([node * RPN + i for i in range(RPN)],
                                dist.PrefixStore(f"{tag}/init/shard/{node}", store), f"{tag}-shard-{node}", TIMEOUT_S)
    old = [mesh.get_group(0), mesh.get_group(1)]
    tc.mesh_set_dim_group(mesh, 0, rep)
    tc.mesh_set_dim_group(mesh, 1, shard)
    for pg in old:
        tc.retire_group(pg)
    return shard, rep


def _wrap(wrapping, mesh, shard, rep):
    torch.manual_seed(0)
    net = Net()
    if wrapping in ("fsdp2_mesh", "fsdp2_rs"):
        from torch.distributed.fsdp import fully_shard

        from accelpact_slurm.repair import torch_compat as tc

        for b in net.blocks:
            fully_shard(b, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
        if wrapping == "fsdp2_rs":
            model.set_separate_reduce_scatter_group()
            for pg in tc.fsdp2_separate_reduce_scatter_groups(model):
                tc.set_group_timeout(pg, TIMEOUT_S)
        return model, "fsdp2"
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    where = dict(device_mesh=mesh) if wrapping == "fsdp1_mesh" else dict(process_group=(shard, rep))
    model = FSDP(net, sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=ModuleWrapPolicy({Block}),
                 use_orig_params=wrapping == "fsdp1_mesh", device_id=torch.device("cpu"), **where)
    return model, "fsdp1"


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _digest(model, optimizer):
    """sha256 of this rank's local shards: weights, then AdamW state (no collective)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(_local(p).detach().contiguous().numpy().tobytes())
        for k, v in sorted(optimizer.state.get(p, {}).items()):
            h.update(k.encode())
            h.update(_local(v).detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _barrier(store, key, rank):
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{r}" for r in range(WORLD)], timedelta(seconds=VOTE_S))


def _vote(store, key, rank, ok):
    """Every rank learns whether any rank failed its forward/backward (before ``optimizer.step``)."""
    store.set(f"{key}/{rank}", "ok" if ok else "fault")
    keys = [f"{key}/{r}" for r in range(WORLD)]
    store.wait(keys, timedelta(seconds=VOTE_S))
    return all(store.get(k) == b"ok" for k in keys)


def _partial_discard(model, optimizer, fsdp):
    """What the negative control leaves out: the stale gradient of a reduction that never ran.

    FSDP2: torch's documented recovery (``reset_iter_state``, ``zero_grad``) with the unsharded parameters'
    gradients kept, as ``reset_iter_state`` itself leaves them up to torch 2.14 (2.15's clears them: the
    control must not depend on which release cleans up).  FSDP1: ``discard_update`` with the half-reduced
    ``_saved_grad_shard`` kept."""
    from accelpact_slurm.repair import torch_compat as tc
    from accelpact_slurm.repair.discard import discard_update

    if fsdp == "fsdp2":
        stale = [(fp._unsharded_param, fp._unsharded_param.grad) for group in tc.fsdp2_param_groups(model)
                 for fp in group.fsdp_params
                 if getattr(fp, "_unsharded_param", None) is not None and fp._unsharded_param.grad is not None]
        assert stale, "the faulted backward left no unsharded gradient: nothing for the control to keep"
        tc.fsdp2_root(model).reset_iter_state()
        optimizer.zero_grad(set_to_none=True)
        for param, grad in stale:
            param.grad = grad
        return
    kept = {id(u): u._handle.flat_param._saved_grad_shard for u in tc.fsdp1_units(model)
            if u._handle is not None and hasattr(u._handle.flat_param, "_saved_grad_shard")}
    discard_update(model, optimizer, fsdp)
    for u in tc.fsdp1_units(model):
        if id(u) in kept:
            u._handle.flat_param._saved_grad_shard = kept[id(u)]


def _scenario(rank, mesh, store, wrapping, variant):
    from accelpact_slurm.repair import torch_compat as tc
    from accelpact_slurm.repair.discard import discard_update, replace_broken_groups, withhold_replication

    tag = f"{wrapping}-{variant}"
    shard, rep = _fresh_groups(rank, mesh, store, tag)
    model, fsdp = _wrap(wrapping, mesh, shard, rep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Start together: a rank still wrapping (imports on first use) would time its peers' first
    # all-gather out.  From then on each update's vote lines the ranks up again.
    _barrier(store, f"{tag}/start", rank)
    torch.manual_seed(100 + rank)  # dropout: a different stream per rank, the same in every run
    out = {"events": []}
    holder = {"shard": shard, "replicate": rep}
    for step in range(1, STEPS + 1):
        rng = torch.get_rng_state()
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, 1, generator=g)
        for attempt in range(2):
            inject = variant != "reference" and step == FAULT_STEP and rank == FAULT_RANK and attempt == 0
            t_start = time.monotonic()
            try:
                if inject:
                    with withhold_replication(model, fsdp) as record:
                        try:
                            nn.functional.mse_loss(model(x), y).backward()
                        finally:
                            out["withheld"] = record.withheld
                else:
                    nn.functional.mse_loss(model(x), y).backward()
                ok, error = True, None
            except RuntimeError as exc:  # a dead peer (Gloo timeout) or the injected fault itself
                ok, error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            raised_after = time.monotonic() - t_start
            if _vote(store, f"{tag}/vote/{step}/{attempt}", rank, ok):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                break
            event = {"step": step, "attempt": attempt, "error": error, "raised_after_s": raised_after}
            out["events"].append(event)
            if attempt == 1:
                out["redo_failed"] = True
                out["digest"] = None
                return out
            t0 = time.monotonic()
            if variant == "partial":
                _partial_discard(model, optimizer, fsdp)
            elif variant != "no_discard":
                event["discarded"] = discard_update(model, optimizer, fsdp)
                event["idle"] = tc.fsdp_idle(model, fsdp)[0]
                event["grads_left"] = sum(p.grad is not None for p in model.parameters())
            t1 = time.monotonic()
            # (With the group pair too: the job's mesh holds the groups it handed out as the pair.)  The
            # holder stands for the runtime's own references, updated before the scan that covers it.
            new = replace_broken_groups(model, fsdp, store=store, tag=f"{tag}-u{step}", timeout_s=TIMEOUT_S,
                                        mesh=mesh, extra_roots=(holder,),
                                        on_rebound=lambda groups: holder.update(groups))
            t2 = time.monotonic()
            event.update(rebound=new.rebound, retired=new.retired, replace_s=new.seconds,
                         discard_s=t1 - t0, discard_replace_s=t2 - t0,
                         groups_now=[tc.group_name(g) for g in tc.hsdp_groups(model, fsdp)],
                         rs_groups=[tc.group_name(g) for g in tc.fsdp2_separate_reduce_scatter_groups(model)]
                         if fsdp == "fsdp2" else [],
                         holder_follows=[holder["shard"], holder["replicate"]] == list(tc.hsdp_groups(model, fsdp)))
            if variant != "no_rng":
                torch.set_rng_state(rng)
    out["digest"] = _digest(model, optimizer)
    if fsdp == "fsdp2":
        out["rs_first"] = [tc.group_name(g) for g in tc.fsdp2_separate_reduce_scatter_groups(model)]
        out["shard_first"] = tc.group_name(tc.hsdp_groups(model, fsdp)[0])
    if variant == "reference":
        out["scan_control"] = _rebinders_without_shard_slots(model, fsdp, mesh, store, f"{tag}-scan")
    return out


def _rebinders_without_shard_slots(model, fsdp, mesh, store, tag):
    """Negative control of the rebinding: with the replication-only slot lists (the shard slots
    forgotten), the reference scan must refuse the replacement, naming the shard group."""
    from accelpact_slurm.core.errors import RepairError
    from accelpact_slurm.repair import torch_compat as tc
    from accelpact_slurm.repair.discard import replace_broken_groups

    saved = tc.fsdp1_group_slots, tc.fsdp2_group_slots
    tc.fsdp1_group_slots, tc.fsdp2_group_slots = tc.fsdp1_slots, tc.fsdp2_slots
    try:
        replace_broken_groups(model, fsdp, store=store, tag=tag, timeout_s=TIMEOUT_S, mesh=mesh)
        return "accepted"
    except RepairError as exc:
        return str(exc)
    finally:
        tc.fsdp1_group_slots, tc.fsdp2_group_slots = saved


def _worker(rank: int, port: int, store_port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    results = {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    store = dist.TCPStore("127.0.0.1", store_port, WORLD, rank == 0, timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (WORLD // RPN, RPN), mesh_dim_names=("replicate", "shard"))
        for wrapping, variant in SCENARIOS:
            key = f"{wrapping}/{variant}"
            try:
                results[key] = _scenario(rank, mesh, store, wrapping, variant)
            except BaseException as exc:  # reported to the test through the result file
                results[key] = {"fail": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            # Every rank starts the next scenario together (a scenario may end early on one rank).
            _barrier(store, f"{key}/done", rank)
    finally:
        with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as fh:
            json.dump(results, fh)
        store.set(f"exit/{rank}", "1")
        if rank == 0:  # rank 0 hosts both stores: nobody leaves before everyone is done with them
            store.wait([f"exit/{r}" for r in range(WORLD)], timedelta(seconds=VOTE_S))
        # Leave without Gloo's teardown: dead groups can abort the process at exit after every result
        # is written.
        os._exit(0)



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("discard")
    return spawn_ranks(_worker, (free_port(), free_port(), str(out)), WORLD, out, DEADLINE_S)


def _get(runs, wrapping, variant):
    per_rank = {}
    for r, res in runs.items():
        got = res.get(f"{wrapping}/{variant}", {"fail": "not run"})
        assert "fail" not in got, f"rank {r}, {wrapping}/{variant}: {got['fail']}"
        per_rank[r] = got
    return per_rank


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_repaired_run_is_bitwise_the_uninterrupted_one(runs, wrapping):
    ref, rep = _get(runs, wrapping, "reference"), _get(runs, wrapping, "repair")
    kind = "fsdp2" if wrapping == "fsdp2_mesh" else "fsdp1"
    for r in range(WORLD):  # the replicas of a shard (same local rank) hold identical state
        assert ref[r]["digest"] == ref[r % RPN]["digest"], f"rank {r} is not a replica of rank {r % RPN}"
    for r in range(WORLD):
        assert not ref[r]["events"], ref[r]["events"]
        (event,) = rep[r]["events"]  # exactly one fault, at the injected update, repaired once
        assert event["step"] == FAULT_STEP and event["attempt"] == 0 and event["error"], event
        assert event["idle"] and event["grads_left"] == 0, event
        assert event["holder_follows"], event
        names = [f"accelpact-shard-{r // RPN * RPN}", f"accelpact-replicate-{r % RPN}"]  # by lowest member
        assert event["groups_now"] == [f"{n}-{wrapping}-repair-u{FAULT_STEP}" for n in names], event
        assert event["retired"] == 2 and event["rebound"][kind] > 0, event
        assert rep[r]["digest"] == ref[r]["digest"], f"rank {r}: repaired run differs from the reference"
    assert rep[FAULT_RANK]["withheld"] == 1
    assert rep[FAULT_RANK]["events"][0]["error"].startswith("ReplicationWithheld")
    peers = [r for r in range(WORLD) if r != FAULT_RANK]
    for r in peers:  # the peers fail in their own backward, on a Gloo error
        assert rep[r]["events"][0]["error"].startswith("RuntimeError"), rep[r]["events"][0]
    # ... and at least one only once the collective timeout had passed
    assert max(rep[r]["events"][0]["raised_after_s"] for r in peers) >= TIMEOUT_S * 0.9, rep


def test_a_separate_reduce_scatter_group_is_replaced_too_and_the_redo_is_bitwise(runs):
    ref, rep = _get(runs, "fsdp2_rs", "reference"), _get(runs, "fsdp2_rs", "repair")
    for r in range(WORLD):
        (event,) = rep[r]["events"]
        first = r // RPN * RPN  # the lowest member of this rank's shard group
        assert event["rs_groups"] == [f"accelpact-reduce_scatter-{first}-fsdp2_rs-repair-u{FAULT_STEP}"], event
        assert event["retired"] == 3, event  # replication, shard and reduce-scatter groups
        assert rep[r]["digest"] == ref[r]["digest"], f"rank {r}: repaired run differs from the reference"
    # The control: before the repair the reduce-scatter ran on a group of its own, not on the shard group.
    assert ref[0]["rs_first"] and ref[0]["shard_first"] not in ref[0]["rs_first"], ref[0]


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_a_shard_group_reference_left_behind_fails_the_scan(runs, wrapping):
    ref = _get(runs, wrapping, "reference")
    for r in range(WORLD):
        said = ref[r]["scan_control"]
        assert said.startswith("rebinding invariant violated") and "shard:" in said, f"rank {r}: {said}"
        assert "replicate:" not in said, f"rank {r}: {said}"


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_without_rng_restore_the_redo_differs(runs, wrapping):
    ref, bad = _get(runs, wrapping, "reference"), _get(runs, wrapping, "no_rng")
    differs = [r for r in range(WORLD) if bad[r].get("redo_failed") or bad[r]["digest"] != ref[r]["digest"]]
    assert differs, "negative control: skipping the RNG restore changed nothing"


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_without_discard_the_redo_fails_or_differs(runs, wrapping):
    ref, bad = _get(runs, wrapping, "reference"), _get(runs, wrapping, "no_discard")
    differs = [r for r in range(WORLD) if bad[r].get("redo_failed") or bad[r]["digest"] != ref[r]["digest"]]
    assert differs, "negative control: skipping discard_update changed nothing"


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_a_partial_discard_silently_differs(runs, wrapping):
    """The stale gradient is the silent failure: the redo completes, every rank steps, the state is wrong."""
    ref, bad = _get(runs, wrapping, "reference"), _get(runs, wrapping, "partial")
    assert not any(bad[r].get("redo_failed") for r in range(WORLD)), bad
    differs = [r for r in range(WORLD) if bad[r]["digest"] != ref[r]["digest"]]
    assert differs, "negative control: the stale gradient changed nothing"


def test_report_repair_times(runs):
    lines = []
    for wrapping in WRAPPINGS:
        rep = _get(runs, wrapping, "repair")
        for r in range(WORLD):
            e = rep[r]["events"][0]
            s = e["replace_s"]
            parts = ", ".join(f"{k} {s[k] * 1e3:.1f} ms" for k in ("build", "rebind", "scan", "retire"))
            lines.append(f"{wrapping} rank {r}: discard {e['discard_s'] * 1e3:.1f} ms, {parts}; "
                         f"discard+replace {e['discard_replace_s'] * 1e3:.1f} ms; "
                         f"reset {e['discarded']}; rebound {e['rebound']}")
            assert e["discard_replace_s"] < 5.0, lines[-1]
        for variant in ("no_rng", "no_discard", "partial"):
            bad, ref = _get(runs, wrapping, variant), _get(runs, wrapping, "reference")
            lines.append(f"{wrapping} {variant}: " + ", ".join(
                f"rank {r} " + ("redo failed: " + str(bad[r]["events"][-1]["error"]) if bad[r].get("redo_failed")
                                else "differs" if bad[r]["digest"] != ref[r]["digest"] else "equal")
                for r in range(WORLD)))
        lines.append(f"{wrapping} scan control, rank 0: {_get(runs, wrapping, 'reference')[0]['scan_control'][:300]}")
        lines.append(f"{wrapping} errors at the fault: " + "; ".join(
            f"rank {r} after {e['raised_after_s']:.2f} s: {e['error']}"
            for r in range(WORLD) for e in _get(runs, wrapping, "repair")[r]["events"][:1]))
    print("\n" + "\n".join(lines))
