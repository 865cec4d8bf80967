"""What a snapshot saves is what its reload asks for: every persistent buffer, on every wrapping.

One spawned group of 4 ranks (a real 2 x 2 HSDP world over Gloo) takes each batch-norm model shaped like
torchvision's (``examples/vision/bn_models.py``: MobileNetV3-small and ResNet in miniature, BatchNorm inside
``nn.Sequential`` blocks and not, squeeze-excitation, ``num_batches_tracked``, a non-persistent buffer) through
every wrapping: FSDP1 with ``use_orig_params`` True (the capture's fast path) and False, with and without an
auto-wrap policy, and FSDP2 with and without per-block ``fully_shard``.  For each: two AdamW updates on each
rank's own batches (the ranks' batch-norm statistics differ), the capture plan the client takes, its capture
proof (against the client's reference of the live state and against ``get_state_dict``), the node's snapshot
written by the daemon's writer from the staging slots, and a stock ``appstate.load`` into a fresh model: every key of the unwrapped model's ``state_dict()`` (and no
non-persistent buffer) is in the plan, the proof passes, the reload restores the weights, the optimizer state
and the node's first rank's buffers bitwise (FSDP1 with ``use_orig_params``: each rank's own boxes read in place,
``ckpt_service.inplace``; the others through ``set_state_dict``).

Negative control (in the test): the same plan without its buffers (what ``fsdp1_plan`` captured before) fails the
capture proof naming a buffer, and its snapshot's reload raises ``Missing key in checkpoint state_dict`` when no
rank's own copy of them is in it either.  Such a snapshot with every rank's own changed buffers (as the runtime
saves them: every snapshot taken before the fix) restores each rank's state exactly.
Negative control (tried by hand): ``fsdp1_plan`` returning ``"model": {}`` again fails this test on the FSDP1
``use_orig_params=True`` wirings (the proof names ``plain:model/...running_mean``).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.multiproc

VISION = os.path.join(REPO, "examples", "vision")
#: (model, wrapping, use_orig_params, auto-wrap)
CONFIGS = [(kind, "fsdp1", uop, wrap) for kind in ("mobilenet", "resnet") for uop in (True, False)
           for wrap in (True, False)] + [(kind, "fsdp2", None, wrap) for kind in ("mobilenet", "resnet")
                                         for wrap in (True, False)]
KEY = b"k" * 32


def _wrap(model, flavour, uop, wrap, mesh):
    from bn_models import wrap_unit

    unit = wrap_unit(model)
    if flavour == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if wrap:
            for m in [m for m in model.modules() if isinstance(m, unit)]:
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    policy = {"auto_wrap_policy": ModuleWrapPolicy({unit})} if wrap else {}
    return FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, use_orig_params=uop,
                device_id=torch.device("cpu"), device_mesh=mesh, **policy)


def _train(model, opt, rank):
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * rank + step)  # each rank its own batches: its own statistics
        images = torch.randn(4, 3, 8, 8, generator=gen)
        labels = torch.randint(0, 5, (4,), generator=gen)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _write(plan, slot, step, rank, local, ndir, shard, meta):
    """Stage ``plan`` into ``slot`` as the client does; the node's first rank writes the snapshot as the daemon
    does; returns its path."""
    import torch.distributed as dist

    from ckpt_service import dcp_write, staging

    nbytes = plan.layout()
    slot.ensure(staging.slot_bytes(nbytes))
    plan.copy_into(slot.buf)
    desc = {"step": step, "rank": rank, "local_rank": local, "slot": slot.path, "slot_ino": slot.ino,
            "nbytes": nbytes, "entries": plan.describe(), "plain": plan.plain, "meta": meta}
    descs: list = [None] * 2
    dist.all_gather_object(descs, desc, group=shard)
    path = os.path.join(ndir, f"step-{step:010d}")
    if local == 0:
        for d in descs:
            d["buf"] = staging.map_slot(d["slot"], d["slot_ino"], d["nbytes"])
        dcp_write.write_snapshot(ndir, step, descs, key=KEY)
    dist.barrier()
    return path


def _digests(plan):
    """Every tensor of a plan, exactly: the bytes of each box (by key and offsets) and of each plain tensor."""
    import hashlib

    from ckpt_service.proof import PLAIN, plain_tensors

    out = {f"{'/'.join(e.key)}@{b.offsets}": hashlib.sha256(bytes(_bits(b.src).numpy())).hexdigest()
           for e in plan.entries for b in e.boxes}
    out.update((PLAIN + path, hashlib.sha256(bytes(_bits(t).numpy())).hexdigest()) for path, t in
               plain_tensors(plan.plain))
    return out


def _bits(t):
    """A tensor's bytes: equal bits, not merely equal values."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _full_state(model):
    """Collective: rank 0's trained model as one state dict (full weights, this rank's own buffers), as torch's full
    state dict gives it; FSDP1's is built under ``summon_full_params`` (its full-state-dict hook crashes on a CPU
    HSDP model in this release)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from accelpact_slurm.runtime.state.buffers import buffer_items, clean_name

    if not isinstance(model, FSDP):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with FSDP.summon_full_params(model, writeback=False):
        out = {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    out.update((n, b.detach().clone()) for n, b in buffer_items(model))
    return out


def _check_export(kind, model, rank, other_node_copy, plan, out):
    """Collective: torch's full state dict of the trained model (rank 0's buffers); on rank 0, both export formats
    of the *second* node's snapshot load into a fresh model with ``strict=True`` and compute, in eval mode, bitwise
    what the full state dict's model computes."""
    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import load_file
    from bn_models import build
    from ckpt_service.export import export_snapshot
    from ckpt_service.index import record_state

    full = _full_state(model)
    if rank == 0:
        assert all(torch.equal(full[k], v) for k, v in plan.plain["model"].items()), "full state dict: not rank 0's"
        ref = build(kind, classes=5, width=4, seed=3)
        ref.load_state_dict(full, strict=True)
        images = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(11))
        want = ref.eval()(images)
        record_state(other_node_copy, "verified")
        os.makedirs(out, exist_ok=True)
        for fmt, file in (("safetensors", "m.safetensors"), ("torch", "m.pt")):
            line = export_snapshot(other_node_copy, os.path.join(out, file), fmt, KEY)
            assert "buffers rank 0's" in line, line
            if fmt == "safetensors":
                sd = load_file(os.path.join(out, file))
                with safe_open(os.path.join(out, file), framework="pt") as fh:
                    assert fh.metadata()["buffers_rank"] == "0", fh.metadata()
            else:
                whole = torch.load(os.path.join(out, file))
                sd = whole["model"]
                assert whole["export"]["buffers_rank"] == "0", whole["export"]
            fresh = build(kind, classes=5, width=4, seed=4)
            fresh.load_state_dict(sd, strict=True)  # every key of state_dict(), persistent buffers included
            got = fresh.eval()(images)
            assert torch.equal(_bits(got), _bits(want)), f"{fmt}: eval outputs differ from rank 0's trained model's"
    dist.barrier()


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, VISION)
    from bn_models import build
    from accelpact_slurm.runtime.state import appstate
    from accelpact_slurm.runtime.state.buffers import ForwardState
    from ckpt_service import staging
    from ckpt_service.capture import Plan, plan_for, state_dict_plan
    from ckpt_service.proof import planned, prove, reference, staged

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    node, local = divmod(rank, 2)
    result = []
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        shard = mesh.get_group("shard")

        def gather(_tag, value):  # the proof's rounds over the node, as the client's control plane gives them
            out: list = [None] * 2
            dist.all_gather_object(out, value, group=shard)
            return out
        meta = {"job_id": "t", "config_digest": "0" * 64, "config": {}, "world_size": world, "layout": [2, 2],
                "extra_json": json.dumps({"run": {}, "ranks": {}}), "capture": None}
        slot = staging.Slot(staging.slot_path(os.path.join(out_dir, f"shm-{node}"), local, 0))
        for n, (kind, flavour, uop, wrap) in enumerate(CONFIGS):
            name = f"{kind} {flavour} use_orig_params={uop} auto_wrap={wrap}"
            want_keys = set(build(kind, classes=5, width=4).state_dict())
            model = _wrap(build(kind, classes=5, width=4, seed=0), flavour, uop, wrap, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            forward = ForwardState(model)
            forward.keep()  # as the first update begins: what a rank's own buffers are measured against
            _train(model, opt, rank)
            ranks: list = [None] * world  # every rank's own buffers in the extra state, as the runtime saves them
            dist.all_gather_object(ranks, {"buffers": appstate.encode(forward.per_rank(), "buffers")})
            meta["extra_json"] = json.dumps({"run": {}, "ranks": {str(r): x for r, x in enumerate(ranks)}})
            plan = plan_for(model, opt)
            assert plan.source == ("fsdp1" if uop else "state_dict"), (name, plan.source)
            keys = {e.key[1] for e in plan.entries if e.key[0] == "model"} | set(plan.plain["model"])
            assert keys == want_keys, f"{name}: missing {sorted(want_keys - keys)[:4]}, extra {sorted(keys - want_keys)[:4]}"
            msd, _ = get_state_dict(model, opt)
            assert set(msd) == want_keys, f"{name}: the state dict itself: {sorted(set(msd) ^ want_keys)[:4]}"
            bufs = {k: v for k, v in plan.plain["model"].items() if "running_mean" in k}
            assert bufs, name
            # the capture proof: the staged plan (read back from the slot) against the client's reference of the
            # live state, and against get_state_dict itself, per node
            ndir = os.path.join(out_dir, f"{n}-node{node}")
            path = _write(plan, slot, 2, rank, local, ndir, shard, meta)
            sd = state_dict_plan(model, opt)
            ok, proven = prove(staged(plan, slot.buf), reference(model, opt, plan), gather)
            assert ok and "plain tensors" in proven, f"{name}: {proven}"
            ok, why = prove(staged(plan, slot.buf), planned(sd), gather)
            assert ok, f"{name}: against get_state_dict: {why}"
            live = _digests(sd)
            both: list = [None] * 2
            dist.all_gather_object(both, (live, bufs), group=shard)
            assert any(not torch.equal(both[0][1][k], both[1][1][k]) for k in bufs), f"{name}: per-rank statistics"
            # negative control: the plan without its buffers fails the proof, naming one, and its reload raises
            old = Plan(plan.entries, {**plan.plain, "model": {}}, plan.source)
            refs = (reference(model, opt, plan), planned(sd)) if plan.source == "fsdp1" else (planned(sd),)
            for ref in refs:
                ok, why = prove(planned(old), ref, gather)
                assert not ok and "missing ['plain:model/" in why, f"{name}: {why}"
            old_path = _write(old, slot, 3, rank, local, ndir, shard, meta)
            bare = dict(meta, extra_json=json.dumps({"run": {}, "ranks": {str(r): {} for r in range(world)}}))
            bare_path = _write(old, slot, 4, rank, local, ndir, shard, bare)  # no rank's own copy either
            # a fresh model with other weights takes the snapshot: the weights, the optimizer state and the node's
            # first rank's buffers come back bitwise
            fresh = _wrap(build(kind, classes=5, width=4, seed=1), flavour, uop, wrap, mesh)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, foreach=False)
            _train(fresh, fresh_opt, rank + 7)
            try:
                appstate.load(fresh, fresh_opt, bare_path, KEY)
            except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                assert "Missing key in checkpoint state_dict: model." in str(exc), f"{name}: {exc}"
            else:
                raise AssertionError(f"{name}: a snapshot without any copy of its buffers loaded")
            # a snapshot without the shared copy (as the FSDP1 capture took them before) but with every rank's own
            # changed buffers restores exactly: each rank its own
            doc = appstate.load(fresh, fresh_opt, old_path, KEY)
            assert ForwardState(fresh).load(appstate.decode(doc["ranks"][str(rank)]["buffers"])) == [], name
            back = _digests(state_dict_plan(fresh, fresh_opt))
            assert back == live, f"{name}: the snapshot without shared buffers did not restore this rank's state"
            fresh = _wrap(build(kind, classes=5, width=4, seed=1), flavour, uop, wrap, mesh)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, foreach=False)
            _train(fresh, fresh_opt, rank + 7)
            parts: dict = {}
            appstate.load(fresh, fresh_opt, path, KEY, parts=parts)
            # FSDP1 with use_orig_params reads its own boxes in place (ckpt_service.inplace); the others, generally
            assert ("read_s" in parts["inplace"]) == bool(uop and flavour == "fsdp1"), (name, parts)
            back = _digests(state_dict_plan(fresh, fresh_opt))
            mine = {k: v for k, v in live.items() if not k.startswith("plain:model/")}
            assert {k: v for k, v in back.items() if k in mine} == mine, f"{name}: weights or optimizer state differ"
            first = {k: v for k, v in both[0][0].items() if k.startswith("plain:model/")}  # local rank 0's buffers
            assert {k: v for k, v in back.items() if k.startswith("plain:model/")} == first, f"{name}: buffers"
            # as a restart loads: an optimizer without state yet; afterwards state for exactly the parameters the
            # saving run had state for (none for a parameter this rank holds no element of: the replay check's
            # fingerprint counts it; the fast path once left one there)
            cold = _wrap(build(kind, classes=5, width=4, seed=1), flavour, uop, wrap, mesh)
            cold_opt = torch.optim.AdamW(cold.parameters(), lr=1e-2, foreach=False)
            appstate.load(cold, cold_opt, path, KEY)
            with_state = sorted(n for n, p in model.named_parameters() if p in opt.state)
            assert sorted(n for n, p in cold.named_parameters() if p in cold_opt.state) == with_state, name
            _check_export(kind, model, rank, os.path.join(out_dir, f"{n}-node1", "step-0000000002"), plan,
                          os.path.join(out_dir, f"{n}-export"))
            result.append(f"{name}: ok ({len(want_keys)} keys; {proven})")
    except BaseException as exc:  # reported to the test through the result file
        import traceback

        result.append(f"FAIL {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        with open(os.path.join(out_dir, f"rank-{rank}.txt"), "w") as fh:
            fh.write("\n".join(result))
        dist.barrier()  # rank 0 hosts the store: nobody leaves before everyone is done with it
        os._exit(0)


def test_every_buffer_is_captured_proven_written_and_reloaded_on_every_wrapping(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.spawn(_worker, args=(4, str(tmp_path / "store"), str(tmp_path)), nprocs=4, join=False)
    deadline = 400.0
    end = time.monotonic() + deadline
    while not ctx.join(timeout=max(0.1, end - time.monotonic())):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the 4 ranks did not finish within {deadline:g} s")
    for r in range(4):
        text = (tmp_path / f"rank-{r}.txt").read_text()
        assert "FAIL" not in text, f"rank {r}: {text}"
        assert text.count(": ok") == len(CONFIGS), f"rank {r}: {text}"
