"""The reload's fast path (``ckpt_service.inplace``): a rank of the sharding that saved a snapshot reads its own boxes
straight into its live tensors, and ends bitwise where the general load (``set_state_dict``) ends; where a chunk is
not one plain record of its box, nothing is changed and the general load runs.

One FSDP1 rank (``use_orig_params=True``) in a one-rank Gloo world, its snapshot written by the daemon's writer
from a staging slot as the daemon writes it.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # FSDP at world size 1, no_dist DCP

from accelpact_slurm.runtime.state import appstate  # noqa: E402
from ckpt_service import dcp_write, inplace, staging  # noqa: E402
from ckpt_service.capture import fsdp1_plan  # noqa: E402

KEY = b"k" * 32


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.bn = torch.nn.BatchNorm1d(5)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if own:
        dist.destroy_process_group()


def _fsdp(seed: int, steps: int):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = FSDP(Net(), use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9), foreach=False)
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 100 + step)
        model(torch.randn(8, 6, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _snapshot(tmp_path, model, opt) -> str:
    """The rank's plan staged into a slot and written by the daemon's writer (signed with :data:`KEY`)."""
    plan = fsdp1_plan(model, opt)
    assert plan is not None
    slot = staging.Slot(staging.slot_path(str(tmp_path / "shm"), 0, 0))
    nbytes = plan.layout()
    slot.ensure(staging.slot_bytes(nbytes))
    plan.copy_into(slot.buf)
    meta = {"job_id": "t", "config_digest": "0" * 64, "config": {}, "world_size": 1, "layout": [1, 1],
            "extra_json": json.dumps({"run": {"step": 3}, "ranks": {}}), "capture": None}
    desc = {"step": 3, "rank": 0, "local_rank": 0, "slot": slot.path, "slot_ino": slot.ino, "nbytes": nbytes,
            "entries": plan.describe(), "plain": plan.plain, "meta": meta}
    desc["buf"] = staging.map_slot(slot.path, slot.ino, nbytes)
    ndir = str(tmp_path / "node1")
    dcp_write.write_snapshot(ndir, 3, [desc], key=KEY)
    return os.path.join(ndir, "step-0000000003")


def _state(model, opt) -> dict:
    """Every bit a reload restores: parameters, buffers, optimizer state and param-group values."""
    out = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update((f"b:{n}", b.detach().clone()) for n, b in model.named_buffers())
    for i, p in enumerate(opt.param_groups[0]["params"]):
        out.update((f"o:{i}:{k}", v.detach().clone()) for k, v in opt.state.get(p, {}).items())
    out.update((f"g:{k}", v) for k, v in opt.param_groups[0].items() if k != "params")
    return out


def _same(a: dict, b: dict) -> bool:
    def bits(v):
        return v.contiguous().reshape(-1).view(torch.uint8) if isinstance(v, torch.Tensor) else v

    return a.keys() == b.keys() and all(
        torch.equal(bits(a[k]), bits(b[k])) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_a_rank_reads_its_own_boxes_in_place_and_ends_where_the_general_load_ends(world, tmp_path, monkeypatch):
    model, opt = _fsdp(seed=1, steps=3)
    want = _state(model, opt)
    path = _snapshot(tmp_path, model, opt)
    fresh, fresh_opt = _fsdp(seed=2, steps=0)  # a fresh optimizer: no state until the load creates it
    assert not fresh_opt.state and not _same(_state(fresh, fresh_opt), want)
    parts: dict = {}
    doc = appstate.load(fresh, fresh_opt, path, KEY, parts=parts)
    assert doc["run"]["step"] == 3 and "read_s" in parts["inplace"], parts
    assert _same(_state(fresh, fresh_opt), want)
    # the control: the general load (a chunk that is not its box's record) from the same snapshot, the same bits
    monkeypatch.setattr(inplace, "_payload", lambda *a: None)
    other, other_opt = _fsdp(seed=3, steps=0)
    parts = {}
    appstate.load(other, other_opt, path, KEY, parts=parts)
    assert "read_s" not in parts["inplace"] and "set_state_dict_s" in parts, parts
    assert _same(_state(other, other_opt), want)


def test_a_chunk_that_is_not_its_boxs_record_changes_nothing(world, tmp_path):
    model, opt = _fsdp(seed=1, steps=2)
    path = _snapshot(tmp_path, model, opt)
    from ckpt_service.verified import verified_metadata_bytes

    checked = verified_metadata_bytes(path, KEY)
    fresh, fresh_opt = _fsdp(seed=2, steps=1)
    before = _state(fresh, fresh_opt)
    small = torch.zeros(1)  # a box of another size: its record does not hold exactly it
    data = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    fd = os.open(os.path.join(path, data), os.O_RDONLY)
    try:
        assert inplace._payload(fd, 0, os.fstat(fd).st_size, small) is None
    finally:
        os.close(fd)
    real = inplace._payload
    calls = []

    def second_fails(fd, offset, length, dst):  # the second chunk of the file is not its box's: give up
        calls.append(offset)
        return None if len(calls) == 2 else real(fd, offset, length, dst)

    inplace._payload = second_fails
    try:
        assert inplace.load(fresh, fresh_opt, path, KEY, checked, None) is None
    finally:
        inplace._payload = real
    assert len(calls) == 2 and _same(_state(fresh, fresh_opt), before)


def test_the_ranks_take_one_way_in_place_everywhere_or_nowhere(world, tmp_path, monkeypatch):
    """The general load is collective (FSDP's all-gathers): a rank that read in place alone would leave its peers
    waiting there.  With ``gather`` (one round of the job's control plane), this rank reads in place only when every
    rank can; another rank's failure ends the load here too; this rank's own failure is told before it raises.
    Negative control: the same rank, the same snapshot, every rank saying ``ok``: it reads in place."""
    from accelpact_slurm.core.errors import CheckpointError
    from ckpt_service.verified import verified_metadata_bytes

    model, opt = _fsdp(seed=1, steps=2)
    path = _snapshot(tmp_path, model, opt)
    checked = verified_metadata_bytes(path, KEY)
    said: list = []

    def peers(*others):
        def gather(word):
            said.append(word)
            return [word, *others]
        return gather

    fresh, fresh_opt = _fsdp(seed=2, steps=1)
    before = _state(fresh, fresh_opt)
    assert inplace.load(fresh, fresh_opt, path, KEY, checked, None, {}, peers("no")) is None
    assert said == ["ok"] and _same(_state(fresh, fresh_opt), before)  # this rank could, another could not
    with pytest.raises(CheckpointError, match="the reload in place failed on rank 1: OSError: disk"):
        inplace.load(fresh, fresh_opt, path, KEY, checked, None, {}, peers("OSError: disk"))
    assert _same(_state(fresh, fresh_opt), before)

    def broken(*_a, **_k):
        raise CheckpointError("x.distcp fails its checksum (corrupted)")

    monkeypatch.setattr(inplace, "open_checked", broken)
    said.clear()
    with pytest.raises(CheckpointError, match="corrupted"):
        inplace.load(fresh, fresh_opt, path, KEY, checked, None, {}, peers("ok"))
    assert said == ["CheckpointError: x.distcp fails its checksum (corrupted)"]  # told before it raised
    monkeypatch.undo()
    parts: dict = {}
    assert inplace.load(fresh, fresh_opt, path, KEY, checked, None, parts, peers("ok")) is not None
    assert "read_s" in parts and _same(_state(fresh, fresh_opt), _state(model, opt))


class _NeedsMore(torch.optim.SGD):
    """An optimizer whose constructor wants more than its param groups: the stand-in cannot be built."""

    def __init__(self, params, scale, **kw) -> None:
        super().__init__(params, **kw)
        self.scale = scale


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: _NeedsMore(ps, 2.0, lr=0.1, momentum=0.9),
], ids=["adamw", "adamw-amsgrad", "sgd-momentum", "own-constructor"])
def test_the_reloads_unwritten_optimizer_state_is_shaped_as_the_real_init_makes_it(make):
    """The reload in place makes the optimizer's state without a step over the model: the same keys in the same
    order, shapes, dtypes and scalars as ``init_optim_state`` (what the general load and the fingerprints see)."""
    from ckpt_service import compat

    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(0)),
              torch.nn.Parameter(torch.randn(5, dtype=torch.float64))]
        ps.append(torch.nn.Parameter(torch.randn(2), requires_grad=False))
        return ps

    real_ps, ours_ps = params(), params()
    real, ours = make(real_ps), make(ours_ps)
    compat.init_optim_state(real)
    inplace.unwritten_optim_state(ours)
    assert len(ours.state) == len(real.state) == 3
    for p, q in zip(real_ps, ours_ps):
        a, b = real.state.get(p, {}), ours.state.get(q, {})
        assert list(a) == list(b)
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert (a[k].shape, a[k].dtype, a[k].device) == (b[k].shape, b[k].dtype, b[k].device), k
                if a[k].dim() == 0:
                    assert torch.equal(a[k], b[k]), k
            else:
                assert a[k] == b[k], k
    assert all(torch.equal(p, q) for p, q in zip(real_ps, ours_ps))  # the parameters untouched
    before = dict(ours.state)
    inplace.unwritten_optim_state(ours)  # state already there: nothing made
    assert dict(ours.state) == before


def test_a_fresh_optimizer_keeps_no_state_when_the_reload_in_place_declines(world, tmp_path, monkeypatch):
    """The general load then makes the optimizer's state itself (``get_state_dict`` makes none where some exists):
    the unwritten state the fast path made must not stay.  Negative control: the same decline on an optimizer that
    had state keeps it."""
    model, opt = _fsdp(seed=1, steps=2)
    path = _snapshot(tmp_path, model, opt)
    from ckpt_service.verified import verified_metadata_bytes

    checked = verified_metadata_bytes(path, KEY)
    monkeypatch.setattr(inplace, "_payload", lambda *a: None)
    fresh, fresh_opt = _fsdp(seed=2, steps=0)
    assert inplace.load(fresh, fresh_opt, path, KEY, checked, None) is None
    assert not fresh_opt.state
    used, used_opt = _fsdp(seed=2, steps=1)
    before = _state(used, used_opt)
    assert inplace.load(used, used_opt, path, KEY, checked, None) is None
    assert used_opt.state and _same(_state(used, used_opt), before)
