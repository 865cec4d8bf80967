"""The FSDP1 capture path reads FSDP's flat-parameter shards directly: it must hold exactly what
``get_state_dict`` holds (same keys, same values, same plain state), on a real 2 x 2 HSDP world over Gloo; and so
must the capture proof's FSDP1 reference, which finds the same values by FSDP's unflattening layout instead.

The job's final digest and a reload's fit check read the same plan (no state dict, no copy of the optimizer's
shards): the digest must name the state exactly as the digest of ``get_state_dict``'s tensors did, and the fit check
must see the names, shapes and dtypes the model's state dict has.

One spawned group of 4 ranks checks both FSDP1 wirings (2-D device mesh and the group pair); the box
arithmetic is checked exhaustively on small shapes in one process.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from ckpt_service.capture import range_boxes


def test_range_boxes_cover_every_range_exactly():
    rng = random.Random(0)
    for _ in range(2000):
        nd = rng.randint(0, 4)
        shape = [rng.randint(1, 5) for _ in range(nd)]
        total = math.prod(shape)
        a = rng.randint(0, total)
        b = rng.randint(a, total)
        t = torch.arange(total).reshape(shape)
        flat = t.reshape(-1)
        pos = a
        boxes = range_boxes(shape, a, b)
        assert len(boxes) <= max(1, 2 * nd - 1)
        for offsets, sizes, f in boxes:
            box = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            n = math.prod(sizes)
            assert f == pos and torch.equal(box.reshape(-1), flat[f:f + n])
            pos += n
        assert pos == b


def test_range_boxes_refuse_a_range_outside_the_tensor():
    with pytest.raises(ValueError, match="outside"):
        range_boxes([3, 4], 5, 13)


def _full(plan, key, shape, dtype, group):
    """The node's full tensor of ``key`` from every rank's boxes (sum over the shard group)."""
    import torch.distributed as dist

    full = torch.zeros(shape, dtype=dtype)
    count = torch.zeros(shape, dtype=torch.int32)
    for e in plan.entries:
        if e.key != key:
            continue
        for b in e.boxes:
            idx = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))
            full[idx] += b.src.reshape(b.sizes)
            count[idx] += 1
    dist.all_reduce(full, group=group)
    dist.all_reduce(count, group=group)
    return full, count


def _full_flat(part, shape, dtype, group):
    """The node's full tensor from every rank's flat boxes of one reference part, and how often each element came."""
    import torch.distributed as dist

    full = torch.zeros(math.prod(shape), dtype=dtype)
    count = torch.zeros(math.prod(shape), dtype=torch.int32)
    assert part is None or (part.flat and list(part.shape) == list(shape))
    for (start,), (n,), values in part.boxes if part is not None else ():
        full[start:start + n] += values
        count[start:start + n] += 1
    dist.all_reduce(full, group=group)
    dist.all_reduce(count, group=group)
    return full.reshape(shape), count.reshape(shape)


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 3 * width)
        self.down = torch.nn.Linear(3 * width, width)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, width))  # a persistent buffer: plain in every plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) * self.gain


class Net(torch.nn.Module):
    """Small enough to spawn fast; width 24 with 3 layers puts flat-parameter boundaries inside rows."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        with torch.no_grad():
            for _, p in sorted(self.named_parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ckpt_service.capture import fsdp1_plan, state_dict_plan
    from ckpt_service.proof import fsdp1_reference, planned, prove
    from accelpact_slurm.runtime.state.digest import state_digests

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    result = []
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        # width 24 with 3 layers: flat-parameter boundaries fall inside rows of the 2-D weights
        vocab, seq_len = 40, 8
        for wiring in ("device_mesh", "group_pair"):
            torch.manual_seed(0)
            kw = dict(device_mesh=mesh) if wiring == "device_mesh" else dict(
                process_group=(mesh.get_group("shard"), mesh.get_group("replicate")))
            model = FSDP(Net(vocab, 24, 3), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                         auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                         device_id=torch.device("cpu"), **kw)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # adds initial_lr like the trainer's
            for step in range(2):
                tokens = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(rank + step))
                logits = model(tokens[:, :-1])
                torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            fast = fsdp1_plan(model, opt)
            assert fast is not None and fast.source == "fsdp1"
            ref = state_dict_plan(model, opt)
            shard = mesh.get_group("shard")
            keys = sorted({e.key for e in ref.entries})
            # a rank has no AdamW state for a parameter wholly on its node peer: the node's union counts
            mine: list = [None] * 2
            dist.all_gather_object(mine, sorted({e.key for e in fast.entries}), group=shard)
            fk = sorted(set(mine[0]) | set(mine[1]))
            assert fk == keys, f"the two plans name different tensors: {sorted(set(fk) ^ set(keys))[:6]}"
            for key in keys:
                e = next(x for x in ref.entries if x.key == key)  # every rank has every key here
                want, wc = _full(ref, key, e.shape, e.dtype, shard)
                got, gc = _full(fast, key, e.shape, e.dtype, shard)
                assert torch.equal(gc, torch.ones_like(gc)), f"{key}: boxes overlap or leave holes"
                assert torch.equal(wc, torch.ones_like(wc))
                assert torch.equal(got, want), f"{key}: values differ"
            ref_groups = ref.plain["optim"]["param_groups"]
            assert fast.plain["optim"]["param_groups"] == ref_groups
            # AdamW's step scalars: every rank has them for the parameters it holds; the node has them all
            fast_steps = {k: float(v["step"]) for k, v in fast.plain["optim"]["state"].items() if "step" in v}
            ref_steps = {k: float(v["step"]) for k, v in ref.plain["optim"]["state"].items() if "step" in v}
            gathered: list = [None] * world
            dist.all_gather_object(gathered, fast_steps)
            merged = {k: v for d in gathered[rank - rank % 2:rank - rank % 2 + 2] for k, v in d.items()}
            assert merged == ref_steps
            # the proof's FSDP1 reference (FSDP's unflattening layout, views of the flat parameters) holds exactly
            # what get_state_dict holds: every tensor of the node, every element once
            live = fsdp1_reference(model, opt)
            assert sorted(live.parts) == sorted("/".join(e.key) for e in fast.entries), "other tensors than the plan's"
            for key in keys:
                e = next(x for x in ref.entries if x.key == key)
                want, _wc = _full(ref, key, e.shape, e.dtype, shard)
                got, gc = _full_flat(live.parts.get("/".join(key)), e.shape, e.dtype, shard)
                assert torch.equal(gc, torch.ones_like(gc)), f"{key}: the reference's boxes overlap or leave holes"
                assert torch.equal(got, want), f"{key}: the reference's values differ from get_state_dict's"

            def gather(_tag, value):  # the proof's rounds over the node
                out: list = [None] * 2
                dist.all_gather_object(out, value, group=shard)
                return out

            # the capture proof: per node, the fast plan against the reference and against the state dict itself
            ok, why = prove(planned(fast), live, gather)
            assert ok, why
            ok, why = prove(planned(fast), planned(ref), gather)
            assert ok, why
            # ... and a box read at the wrong place (a wrong mapping) does not pass it
            box = next(b for e in fast.entries if e.key[0] == "model" for b in e.boxes if b.src.numel() > 1)
            box.src = box.src.flip(0)
            for other in (live, planned(ref)):
                ok, why = prove(planned(fast), other, gather)
                assert not ok and "differs from the live" in why, why
            # the final digest from the plan's views names the state as the digest of get_state_dict's tensors did
            box.src = box.src.flip(0)  # the live view again
            rt = _DigestRt(rank, shard)
            got_digest = state_digests(rt, model, opt, {}, _NoBuffers(), 2, 0)
            want_digest = _state_dict_digest(rt, model, opt, 2, 0)
            # a reload's fit check reads the model's names, shapes and dtypes from the same plan: as the state dict's
            from accelpact_slurm.runtime.state import loadfit

            assert loadfit.expected(model) == loadfit.expected_from_state_dict(model)
            same: list = [None] * world  # rank 0 compares; every rank learns it (and leaves together)
            dist.all_gather_object(same, got_digest == want_digest)
            assert all(same), f"the plan's digest differs from get_state_dict's: {got_digest} != {want_digest}"
            assert (got_digest[0] is not None) == (rank == 0)
            result.append(f"{wiring}: {len(keys)} tensors match")
    except BaseException as exc:  # reported to the test through the result file
        result.append(f"FAIL {type(exc).__name__}: {exc}")
    finally:
        with open(os.path.join(out_dir, f"rank-{rank}.txt"), "w") as fh:
            fh.write("\n".join(result))
        dist.barrier()  # rank 0 hosts the store: nobody leaves before everyone is done with it
        # Leave without Gloo's teardown: with groups replaced mid-run it can abort the process at exit
        # ("terminate called without an active exception") after every result is written.
        os._exit(0)


class _NoBuffers:
    def digest_items(self) -> list:
        return []


class _DigestRt:
    """What the digest reads of the job's runtime: rank, node, node layout, shard group, the control round."""

    def __init__(self, rank: int, shard) -> None:
        import types

        import torch.distributed as dist

        self.rank, self.node, self.shard_group = rank, rank // 2, shard
        self.layout = types.SimpleNamespace(ranks_per_node=2)

        def all_gather(_tag, value):
            out: list = [None] * dist.get_world_size()
            dist.all_gather_object(out, value)
            return out

        self.control = types.SimpleNamespace(all_gather=all_gather)


def _state_dict_digest(rt, model, optimizer, step, epoch):
    """The final digest as it was computed from ``get_state_dict`` (the reference the plan's digest must equal)."""
    import hashlib

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from accelpact_slurm.runtime.state.digest import _update_tensor, rank_fingerprint
    from ckpt_service.capture import _local_chunks

    msd, osd = get_state_dict(model, optimizer)
    ranks = rt.control.all_gather("digest-rank", rank_fingerprint({}, _NoBuffers()))
    h = hashlib.sha256() if rt.rank == 0 else None
    items = [(f"param:{n}", msd[n]) for n in sorted(msd)]
    items += [(f"optim:{f}:{k}", osd["state"][f][k]) for f in sorted(osd["state"]) for k in sorted(osd["state"][f])]
    for name, value in items:
        chunks = _local_chunks(value)
        if chunks is None:
            if h is not None:
                _update_tensor(h, name, value)
            continue
        if rt.node != 0:
            continue
        mine = [(list(o), t.detach().contiguous()) for o, t in chunks if t.numel()]
        got: list = [None] * 2 if rt.rank == 0 else None
        dist.gather_object(mine, got, dst=0, group=rt.shard_group)
        if h is not None:
            full = torch.empty(tuple(value.shape), dtype=value.dtype)
            for part in got:
                for offsets, t in part:
                    full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))].copy_(t)
            _update_tensor(h, name, full)
    if h is None:
        return None, None
    h.update(f"frontier:{step};epoch:{epoch}".encode())
    model_digest = h.hexdigest()
    for r, fp in enumerate(ranks):
        h.update(f"rank:{r}:{fp['rng']}:{fp['state']}".encode())
    return h.hexdigest(), model_digest


@pytest.mark.slow
def test_fsdp1_capture_equals_get_state_dict(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.spawn(_worker, args=(4, str(tmp_path / "store"), str(tmp_path)), nprocs=4, join=False)
    deadline = 240.0
    import time

    end = time.monotonic() + deadline
    while not ctx.join(timeout=max(0.1, end - time.monotonic())):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the 4 ranks did not finish within {deadline:g} s")
    for r in range(4):
        text = (tmp_path / f"rank-{r}.txt").read_text()
        assert "FAIL" not in text, f"rank {r}: {text}"
        assert text.count("match") == 2, f"rank {r}: {text}"
