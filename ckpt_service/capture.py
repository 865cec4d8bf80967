"""The rank side of a snapshot: which boxes of which tensors this rank holds, copied into a staging slot.

A *plan* lists, for every tensor of the rank's application state in ``get_state_dict``'s nested layout (``{"model":
{fqn: ...}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}}``), its key path, global shape, dtype and the
rectangular *boxes* (offsets + sizes) this rank holds, each with a live source view (no copy).  Everything else
(AdamW's ``step`` scalars, ``param_groups``, the persistent buffers) is *plain*: small, taken from the node's first
rank (a rank's own batch-norm statistics travel in its extra state: :mod:`accelpact_slurm.runtime.state.buffers`).

Two ways to build it: **FSDP1** (``use_orig_params=True``) reads FSDP's flat-parameter shard info directly: a rank
holds a 1-D range of every parameter's flattened elements (AdamW's moments the same range), which
:func:`range_boxes` cuts into at most ``2 * ndim - 1`` boxes, what DCP stores as chunks; no ``get_state_dict``, no
collective, no copy until :meth:`Plan.copy_into`.  **Anything else** (FSDP2, a plain module): ``get_state_dict`` and
the local chunks of its DTensors/ShardedTensors.

Who calls: :class:`ckpt_service.client.SnapshotClient` (build + copy into its slot); the daemon reads the boxes back
through :mod:`.staging` and writes them as DCP chunks (:mod:`.dcp_write`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from accelpact_slurm.core.torch_warnings import quiet_state_dict_calls
from ckpt_service.compat import (canonical_fqn, flat_param_parts, fsdp1_flat_params, persistent_buffers,
                                 sharded_tensor_type, writes_own_state_dict)
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

#: Byte alignment of every box in a slot: a page, so the daemon's writer hands a large box to the disk from the
#: slot itself (``O_DIRECT`` wants page-aligned memory: :class:`ckpt_service.sink.Sink`).
ALIGN = 4096


@dataclass
class Box:
    offsets: list[int]
    sizes: list[int]
    src: torch.Tensor | None = None  # rank side: a contiguous view with numel == prod(sizes)
    byte_offset: int = 0  # position in the slot


@dataclass
class Entry:
    key: tuple[str, ...]
    shape: list[int]
    dtype: torch.dtype
    boxes: list[Box] = field(default_factory=list)


@dataclass
class Plan:
    entries: list[Entry]
    plain: dict[str, Any]
    source: str  # "fsdp1" or "state_dict"

    @property
    def on_gpu(self) -> bool:
        """Whether any box lives on a GPU (the slot is then worth page-locking)."""
        return any(b.src is not None and b.src.is_cuda for e in self.entries for b in e.boxes)

    def layout(self) -> int:
        """Assign every box its byte offset in the slot; return the bytes needed."""
        end = 0
        for e in self.entries:
            item = torch.empty((), dtype=e.dtype).element_size()
            for b in e.boxes:
                b.byte_offset = _align(end)
                end = b.byte_offset + math.prod(b.sizes) * item
        return _align(end)

    def regions(self, buf: torch.Tensor) -> Iterator[tuple[Entry, Box, torch.Tensor]]:
        """``(entry, box, view)``: each non-empty box's place in the uint8 slot ``buf``, viewed as its dtype."""
        for e in self.entries:
            item = torch.empty((), dtype=e.dtype).element_size()
            for b in e.boxes:
                nbytes = math.prod(b.sizes) * item
                if nbytes:
                    yield e, b, buf[b.byte_offset:b.byte_offset + nbytes].view(e.dtype)

    def copy_into(self, buf: torch.Tensor) -> int:
        """Copy every box's source into the uint8 slot ``buf`` at its offset; returns bytes copied.

        Boxes on a GPU are copied on a side stream that first waits for the work already queued
        (so it reads the committed values), as non-blocking copies (one DMA each when the slot is
        page-locked, :meth:`ckpt_service.staging.Slot.pin`), then waited for once: on return the
        slot holds every byte, whatever the device.
        """
        n = 0
        side = None
        for _e, b, dst in self.regions(buf):
            src = b.src.reshape(-1)
            if src.is_cuda:
                if side is None:
                    side = _side_stream(src.device)
                    side.wait_stream(torch.cuda.current_stream(src.device))
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            n += dst.numel() * dst.element_size()
        if side is not None:
            side.synchronize()
        return n

    def describe(self) -> list[dict[str, Any]]:
        """The plan without its tensors (what the daemon needs to find the boxes in the slot)."""
        return [{"key": list(e.key), "shape": list(e.shape), "dtype": str(e.dtype).removeprefix("torch."),
                 "boxes": [[list(b.offsets), list(b.sizes), b.byte_offset] for b in e.boxes]}
                for e in self.entries]


_side_streams: dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """One staging stream per device, made once (creating streams is not free)."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def range_boxes(shape: list[int] | tuple[int, ...], start: int, end: int) -> list[tuple[list[int], list[int], int]]:
    """Cut the row-major element range ``[start, end)`` of a tensor of ``shape`` into rectangular boxes.

    Returns ``[(offsets, sizes, flat_start)]`` in element order; each box is contiguous in the
    flattened tensor, so ``flat[flat_start : flat_start + prod(sizes)].view(sizes)`` is its data.
    """
    shape = list(shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"range [{start}, {end}) outside a tensor of {total} elements (shape {shape})")
    if start == end:
        return []
    if not shape:
        return [([], [], 0)]
    return _cut(shape, start, end)


def _cut(shape: list[int], start: int, end: int) -> list[tuple[list[int], list[int], int]]:
    if len(shape) == 1:
        return [([start], [end - start], start)]
    row = math.prod(shape[1:])
    r0, c0 = divmod(start, row)
    r1, c1 = divmod(end, row)
    if r0 == r1:  # inside one row
        return _row(shape, r0, c0, c1)
    out = []
    if c0:  # partial first row
        out += _row(shape, r0, c0, row)
        r0 += 1
    if r1 > r0:  # whole rows
        out.append(([r0] + [0] * (len(shape) - 1), [r1 - r0] + shape[1:], r0 * row))
    if c1:  # partial last row
        out += _row(shape, r1, 0, c1)
    return out


def _row(shape: list[int], r: int, c0: int, c1: int) -> list[tuple[list[int], list[int], int]]:
    row = math.prod(shape[1:])
    return [([r] + o, [1] + s, r * row + f) for o, s, f in _cut(shape[1:], c0, c1)]


# ------------------------------------------------------------------ plans


def plan_for(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Plan:
    """This rank's plan: the FSDP1 fast path where it applies, else through ``get_state_dict``."""
    plan = fsdp1_plan(model, optimizer)
    return plan if plan is not None else state_dict_plan(model, optimizer)


_FQNS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str]]" = weakref.WeakKeyDictionary()
_BUFFER_FQNS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str]]" = weakref.WeakKeyDictionary()


def fsdp1_plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Plan | None:
    """Plan from FSDP1's flat parameters (``use_orig_params=True``); ``None`` when the model is not such.
    ``optimizer`` None: the model's part alone (what a reload's fit check compares with a snapshot)."""
    flats = [flat_param_parts(fp) for fp in fsdp1_flat_params(model)]
    if not flats or any(parts is None for parts in flats) or not _fast_path_fits(model):
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = _FQNS.get(model)
    if fqns is None:  # a parameter's name never changes: resolved once per model, not on every snapshot
        fqns = _FQNS[model] = {}
    entries: list[Entry] = []
    optim_state: dict[str, Any] = {}
    fqn_of: dict[int, str] = {}
    for parts in flats:
        for p, info, shape in parts or ():
            name = names[id(p)]
            fqn = fqns.get(name)
            if fqn is None:
                fqn = fqns[name] = canonical_fqn(model, name)
            fqn_of[id(p)] = fqn
            shape = list(shape)
            if info.in_shard:
                start, end = info.intra_param_start_idx, info.intra_param_end_idx + 1
            else:
                start = end = 0
            local = p.detach()
            if local.numel() != end - start:
                return None  # not the sharded view FSDP leaves between updates: use the generic path
            cuts = range_boxes(shape, start, end)
            entries.append(_entry(("model", fqn), shape, p.dtype, cuts, local.reshape(-1), start))
            st = optimizer.state.get(p, {}) if optimizer is not None else {}
            per: dict[str, Any] = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel() == local.numel() and v.dim() <= 1:
                    entries.append(_entry(("optim", "state", fqn, k), shape, v.dtype, cuts, v.detach().reshape(-1),
                                          start))
                elif isinstance(v, torch.Tensor):
                    per[k] = _host_copy(v)
                else:
                    per[k] = v
            optim_state[fqn] = per
    groups = []
    for g in optimizer.param_groups if optimizer is not None else ():
        d = {k: v for k, v in g.items() if k != "params"}
        d["params"] = [fqn_of[id(p)] for p in g["params"] if id(p) in fqn_of]
        groups.append(d)
    # The module buffers (batch-norm statistics and counters): plain, as get_state_dict gives them.  Without them
    # the snapshot holds no buffer and its reload fails on the first one it asks for.
    return Plan(entries, {"model": module_buffers(model), "optim": {"state": optim_state, "param_groups": groups}},
                "fsdp1")


def module_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s persistent buffers under ``get_state_dict``'s names (FSDP wrapper prefixes removed),
    in the model's order; non-persistent ones left out, as ``state_dict()`` leaves them out."""
    return {fqn: _host_copy(buf) for fqn, buf in live_buffers(model)}


def live_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(get_state_dict's name, the buffer itself)`` of every persistent buffer of ``model``, in the model's order
    (every name ``state_dict()`` gives)."""
    names = _BUFFER_FQNS.get(model)
    if names is None:  # a buffer's name never changes: resolved once per model
        names = _BUFFER_FQNS[model] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, buf in persistent_buffers(mod):
            full = f"{mod_name}.{attr}" if mod_name else attr
            fqn = names.get(full)
            if fqn is None:
                fqn = names[full] = canonical_fqn(model, full)
            out.append((fqn, buf))
    return out


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a plain tensor: the descriptor carries it to the daemon, which must not need a GPU to read it
    (small: buffers and optimizer scalars)."""
    return t.detach().to("cpu", copy=True)


def _fast_path_fits(model: torch.nn.Module) -> bool:
    """Whether the model holds nothing the FSDP1 plan would miss or change: no module with its own extra state
    (``get_extra_state``: not a tensor of ``named_buffers``), none outside FSDP's own writing its state dict itself
    (:func:`ckpt_service.compat.writes_own_state_dict`: state the plan would not see, nor the capture proof, whose
    reference reads the same parameters and buffers), no unit casting its buffers for compute
    (``MixedPrecision(buffer_dtype=...)``: the state dict casts them back)."""
    for mod in model.modules():
        if type(mod).get_extra_state is not torch.nn.Module.get_extra_state:
            return False
        if not isinstance(mod, FSDP) and writes_own_state_dict(mod):
            return False
        if isinstance(mod, FSDP) and getattr(getattr(mod, "mixed_precision", None), "buffer_dtype", None) is not None:
            return False
    return True


def _entry(key: tuple[str, ...], shape: list[int], dtype: torch.dtype, cuts: list, flat: torch.Tensor,
           start: int) -> Entry:
    boxes = [Box(list(o), list(s), flat[f - start:f - start + math.prod(s)]) for o, s, f in cuts]
    return Entry(key, shape, dtype, boxes)


_SKIP = object()  # a sharded value moved into the entries


def state_dict_plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Plan:
    """Collective: plan from ``get_state_dict`` (DTensor / ShardedTensor local chunks, plain values kept)."""
    with quiet_state_dict_calls():  # torch's deprecation noise on a group pair's ShardedTensors, on every rank
        msd, osd = get_state_dict(model, optimizer)
        entries: list[Entry] = []
        plain = {"model": _split(("model",), msd, entries), "optim": _split(("optim",), osd, entries)}
    return Plan(entries, plain, "state_dict")


def _split(key: tuple[str, ...], value: Any, entries: list[Entry]) -> Any:
    chunks = _local_chunks(value)
    if chunks is not None:
        boxes = [Box(list(o), list(t.shape), t.detach().contiguous()) for o, t in chunks if t.numel()]
        entries.append(Entry(key, list(value.shape), value.dtype, boxes))
        return _SKIP
    if isinstance(value, torch.Tensor):
        return _host_copy(value)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            r = _split(key + (str(k),), v, entries)
            if r is not _SKIP:
                out[k] = r
        return out
    if isinstance(value, (list, tuple)):
        out_l = [_split(key + (str(i),), v, entries) for i, v in enumerate(value)]
        if any(x is _SKIP for x in out_l):
            raise ValueError(f"{'.'.join(key)}: sharded tensors inside a list are not supported")
        return out_l if isinstance(value, list) else tuple(out_l)
    return value



def _local_chunks(value: Any) -> list[tuple[list[int], torch.Tensor]] | None:
    """``[(global offsets, local tensor)]`` for a DTensor or ShardedTensor, ``None`` for anything else."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        DTensor = ()  # type: ignore[assignment]
    if DTensor and isinstance(value, DTensor):
        chunks = value.__create_chunk_list__()
        return [(list(chunks[0].offsets), value.to_local())] if chunks else []
    if isinstance(value, sharded_tensor_type()):
        return [(list(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    return None
