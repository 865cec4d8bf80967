"""The capture proof: the bytes staged for a snapshot are the live state at the places the plan gives them, shown
without the user's model, without a copy of the state and without stalling training.

Once per job and capture plan (the first snapshot of a start whose plans no earlier proof passed: :mod:`.proof_cache`)
each rank compares what it staged, read back from its slot, with a *reference*: a view of the same live state that
does not go through the plan's mapping, and that copies nothing.

- **FSDP1** (the plan reads each flat parameter's per-rank shard info): every parameter is found by FSDP's own
  unflattening layout (where forward finds it in the unsharded flat parameter) inside this rank's part of the flat
  parameter (its index in the shard group times the shard's length), and read from the flat parameter itself; the
  optimizer's state of a parameter is placed as that parameter (a parameter whose own view is not where the layout
  puts it fails the proof); the persistent module buffers and the optimizer's other tensors as the model and the
  optimizer hold them now; names as ``get_state_dict`` gives them.  ``get_state_dict`` itself would all-gather every
  parameter and optimizer state and hand back a copy of the rank's whole state: the cost this proof avoids.
- **A plan made from** ``get_state_dict`` (FSDP2, FSDP1 without original parameters, an unwrapped module): its
  sources are the framework's own state dict, so they are the reference (no second call).

Per node (its ranks together hold one complete copy), the proof passes when

1. both sides name the same tensors with the same shapes and dtypes, and the same plain tensors;
2. on each side the node's boxes of every tensor tile it exactly: no element missing, none held twice;
3. a deterministic sample of every tensor's elements is equal bit for bit, whichever rank holds each element on
   either side: every box's first, middle and last element (of both sides, on every rank of the node) and
   :data:`SPREAD` more spread over the tensor;
4. every plain tensor (module buffers, optimizer scalars) is equal whole, by digest, as the daemon writes it (the
   node's first rank holding the key).

So a box at the wrong offset (2, or 3 at its ends), a missed rank (1 or 2), a stale slot region or a box copied from
the wrong place (3: every box's ends are read back from the slot), a buffer or plain key left out (1) fail it, with
the tensor named.  Not seen: a change strictly inside a box between its sampled elements (a box is one ``copy_``:
it moves whole or not at all).  Costs O(boxes + samples) and two rounds of the node's ranks: the layouts, then the
samples.

Who calls: :class:`ckpt_service.client.SnapshotClient` on every rank, on the first snapshot of a start whose plans
are not proven yet, after the copy (:func:`reference`, then :func:`prove` over its node's ranks on the control
plane; the nodes' verdicts in one more round of the world).  Reads only the plan, the slot, the model's parameters
and buffers and the optimizer's state.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from ckpt_service.compat import canonical_fqn, fsdp1_flat_layouts, persistent_buffers

#: Elements sampled per tensor besides every box's first, middle and last.
SPREAD = 16
#: Key prefix of a plain tensor: the node keeps its first rank's (the daemon's merge), compared whole.
PLAIN = "plain:"


@dataclass
class Part:
    """One tensor as one side holds it on this rank: ``(offsets, sizes, values)`` boxes, ``values`` 1-D with
    ``prod(sizes)`` elements; ``flat``: the boxes index the flattened tensor (``[start]``, ``[count]``)."""

    shape: list[int]
    dtype: torch.dtype
    boxes: list[tuple[list[int], list[int], torch.Tensor]] = field(default_factory=list)
    flat: bool = False


@dataclass
class Side:
    """What one side holds on this rank: its tensors by key (``"/".join(entry.key)``) and its plain part."""

    parts: dict[str, Part]
    plain: Any


def planned(plan: Any) -> Side:
    """The plan's own sources (for a plan made from ``get_state_dict``: the framework's state dict itself)."""
    parts = {"/".join(e.key): Part(list(e.shape), e.dtype, [(list(b.offsets), list(b.sizes), b.src.reshape(-1))
                                                           for b in e.boxes
                                                           if b.src is not None and math.prod(b.sizes)])
             for e in plan.entries}
    return Side(parts, plan.plain)


def staged(plan: Any, buf: torch.Tensor) -> Side:
    """What the plan staged into the uint8 slot ``buf``, read back from it (views of the slot)."""
    parts = {"/".join(e.key): Part(list(e.shape), e.dtype) for e in plan.entries}
    for e, b, view in plan.regions(buf):
        parts["/".join(e.key)].boxes.append((list(b.offsets), list(b.sizes), view))
    return Side(parts, plan.plain)


def reference(model: Any, optimizer: Any, plan: Any) -> Side:
    """The live state the proof compares ``plan``'s capture with (see the module docstring): views, no copy."""
    return fsdp1_reference(model, optimizer) if plan.source == "fsdp1" else planned(plan)


def fsdp1_reference(model: Any, optimizer: Any) -> Side:
    """FSDP1's live state located by its unflattening layout, not by the shard info the plan reads (flat boxes)."""
    names = {id(p): n for n, p in model.named_parameters()}
    parts: dict[str, Part] = {}
    optim: dict[str, Any] = {}
    seen: set[int] = set()
    for fp, rank, layout in fsdp1_flat_layouts(model):
        if layout is None:
            raise ValueError("an FSDP1 unit keeps no original parameters (use_orig_params=False): no FSDP1 reference")
        shard = fp.detach().reshape(-1)
        lo_shard, n = rank * shard.numel(), shard.numel()
        for p, shape, start in layout:
            seen.add(id(p))
            fqn = canonical_fqn(model, names[id(p)])
            numel = math.prod(shape)
            lo, hi = max(start, lo_shard), min(start + numel, lo_shard + n)
            held = max(0, hi - lo)
            local = p.detach()
            if local.numel() != held or (held and (local.dtype != shard.dtype or local.data_ptr() !=
                                                   shard[lo - lo_shard].data_ptr())):
                raise ValueError(f"model/{fqn}: this rank's view of the parameter ({local.numel()} elements) is not "
                                 f"where FSDP's flat layout puts it (elements [{lo - start}, {hi - start}) at "
                                 f"{lo - lo_shard} of the rank's shard)")
            box = [([lo - start], [held], shard[lo - lo_shard:hi - lo_shard])] if held else []
            parts[f"model/{fqn}"] = Part(list(shape), p.dtype, box, flat=True)
            per: dict[str, Any] = {}
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == held:  # placed as its parameter
                    vbox = [([lo - start], [held], v.detach().reshape(-1))] if held else []
                    parts[f"optim/state/{fqn}/{k}"] = Part(list(shape), v.dtype, vbox, flat=True)
                elif isinstance(v, torch.Tensor):
                    per[k] = v.detach()
            optim[fqn] = per
    for name, p in model.named_parameters():  # outside every flat parameter (an ignored module's): held whole
        if id(p) not in seen:
            parts[f"model/{canonical_fqn(model, name)}"] = Part(list(p.shape), p.dtype, [
                ([0] * p.dim(), list(p.shape), p.detach().reshape(-1))] if p.numel() else [])
    buffers: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, buf in persistent_buffers(mod):
            buffers[canonical_fqn(model, f"{mod_name}.{attr}" if mod_name else attr)] = buf.detach()
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": None} for g in optimizer.param_groups]
    return Side(parts, {"model": buffers, "optim": {"state": optim, "param_groups": groups}})


# ------------------------------------------------------------------ the layout (JSON: the node's first round)


def describe(staged_side: Side, live: Side) -> dict[str, Any]:
    """Both sides' layouts on this rank (keys, shapes, dtypes, boxes) and digests of their plain tensors."""
    def parts(side: Side) -> dict[str, Any]:
        return {k: [p.shape, _dtype(p.dtype), p.flat, [[o, s] for o, s, _v in p.boxes]] for k, p in side.parts.items()}

    def plain(side: Side) -> dict[str, Any]:
        return {path: [list(t.shape), _dtype(t.dtype), _digest(t)] for path, t in plain_tensors(side.plain)}

    return {"staged": parts(staged_side), "live": parts(live), "plain_staged": plain(staged_side),
            "plain_live": plain(live)}


def sample_sets(metas: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    """Per tensor key of a node (``metas``: :func:`describe` of each of its ranks), the flat indices sampled:
    :data:`SPREAD` spread ones and every box's first, middle and last, sorted (the same on every rank)."""
    shapes: dict[str, list[int]] = {}
    corners: dict[str, set[int]] = {}
    for m in metas:
        for side in ("staged", "live"):
            for key, (shape, _dtype_name, flat, boxes) in (m.get(side) or {}).items():
                shapes.setdefault(key, shape)
                geo = [math.prod(shape)] if flat else shape
                acc = corners.setdefault(key, set())
                for o, s in boxes:
                    acc.update(_corners(geo, o, s))
    out = {}
    for key in sorted(shapes):
        n = math.prod(shapes[key])
        acc = corners[key] | set(_spread(key, n))
        out[key] = sorted(g for g in acc if 0 <= g < n)
    return out


# ------------------------------------------------------------------ the samples (JSON: the node's second round)


def read(staged_side: Side, live: Side, sets: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """This rank's sampled values of both sides (JSON): per side, how many of its boxes hold each sample (0: another
    rank's) and the value's bits, in the order of ``sets``' sorted keys."""
    return {"staged": _read(staged_side, sets), "live": _read(live, sets)}


def _read(side: Side, sets: Mapping[str, Sequence[int]]) -> list[str]:
    total = sum(len(v) for v in sets.values())
    marks = [0] * (total + 1)  # +1 where a box's samples start, -1 past them: their running sum counts the holders
    # one gather per underlying storage and dtype (the slot is one storage; FSDP1's parameters share their unit's)
    groups: dict[tuple[Any, ...], tuple[torch.Tensor, list[int], list[int]]] = {}
    base = 0
    for key in sorted(sets):
        gs = sets[key]
        part = side.parts.get(key)
        if part is not None:
            geo = [math.prod(part.shape)] if part.flat else part.shape
            for offsets, sizes, values in part.boxes:
                if not math.prod(sizes):
                    continue
                span = _span(geo, offsets, sizes)
                if span is not None and values.dim() == 1 and values.stride(0) == 1:
                    i, j = bisect.bisect_left(gs, span[0]), bisect.bisect_left(gs, span[1])
                    if i == j:
                        continue
                    marks[base + i] += 1
                    marks[base + j] -= 1
                    storage = values.untyped_storage()
                    gid: tuple[Any, ...] = (values.device, storage.data_ptr(), values.dtype)
                    if gid not in groups:
                        whole = torch.empty(0, dtype=values.dtype, device=values.device)
                        whole.set_(storage, 0, (storage.nbytes() // values.element_size(),), (1,))
                        groups[gid] = (whole, [], [])
                    _w, pos, index = groups[gid]
                    pos.extend(range(base + i, base + j))
                    shift = values.storage_offset() - span[0]  # flat index -> element of the storage
                    index.extend([g + shift for g in gs[i:j]])
                else:  # a strided box or view: its samples one by one
                    pos_list, local = _inside(geo, offsets, sizes, gs)
                    for p in pos_list:
                        marks[base + p] += 1
                        marks[base + p + 1] -= 1
                    groups[(id(values), len(groups))] = (values.reshape(-1), [base + p for p in pos_list], list(local))
        base += len(gs)
    count = torch.tensor(marks[:total], dtype=torch.int32).cumsum(0).clamp(max=255).to(torch.uint8)
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
    for whole, pos, index in groups.values():
        got = whole[torch.tensor(index, dtype=torch.int64, device=whole.device)]
        acc = by_dtype.setdefault(whole.dtype, ([], []))
        acc[0].append(got)
        acc[1].extend(pos)
    bits = torch.zeros(total, dtype=torch.int64)
    for got_list, pos in by_dtype.values():
        bits[torch.tensor(pos, dtype=torch.int64)] = _bits(torch.cat(got_list).cpu())
    return [_pack(count), _pack(bits)]


def compare(metas: Sequence[Mapping[str, Any]], reads: Sequence[Mapping[str, Any]]) -> tuple[bool, str]:
    """Pure: a node's verdict from its ranks' :func:`describe` (``metas``) and :func:`read` (``reads``), in rank
    order; the same on every rank that computes it."""
    for m in (*metas, *reads):
        if m.get("error"):
            return False, str(m["error"])
    if any("staged" not in r or "live" not in r for r in reads):
        return False, "a rank of the node sent no samples"
    keys = {side: {k for m in metas for k in m[side]} | {PLAIN + k for m in metas for k in m[f"plain_{side}"]}
            for side in ("staged", "live")}
    if keys["staged"] != keys["live"]:
        missing = sorted(keys["live"] - keys["staged"])[:3]
        extra = sorted(keys["staged"] - keys["live"])[:3]
        return False, f"staged tensors differ from the state dict's: missing {missing}, unexpected {extra}"
    tensors = sorted(k for k in keys["live"] if not k.startswith(PLAIN))
    for key in tensors:
        held = {side: [m[side][key] for m in metas if key in m[side]] for side in ("staged", "live")}
        want = held["live"][0][:2]
        for side, entries in held.items():
            for shape, dtype_name, flat, boxes in entries:
                if [shape, dtype_name] != want:
                    return False, (f"{key}: staged as {shape} {dtype_name}, the live state holds {want[0]} {want[1]}"
                                   if side == "staged" else f"{key}: the ranks' live states disagree on its shape")
            flat = entries[0][2]
            geo = [math.prod(want[0])] if flat else want[0]
            why = _tiling(geo, [b for e in entries for b in e[3]])
            if why:
                return False, f"{key}: the node's {side} boxes {why}"
    sets = sample_sets(metas)
    order = sorted(sets)
    picked = {}
    for side in ("staged", "live"):
        count = sum(_unpack(r[side][0], torch.uint8).to(torch.int32) for r in reads)
        bits = sum(_unpack(r[side][1], torch.int64) for r in reads)
        if not isinstance(count, torch.Tensor) or count.numel() != sum(len(sets[k]) for k in order):
            return False, f"the node's ranks sampled different elements ({side})"
        bad = (count != 1).nonzero()
        if bad.numel():
            key, g = _locate(sets, order, int(bad[0]))
            return False, f"{key}: element {g} is held by {int(count[int(bad[0])])} of the node's {side} boxes"
        picked[side] = bits
    diff = (picked["staged"] != picked["live"]).nonzero()
    if diff.numel():
        i = int(diff[0])
        key, g = _locate(sets, order, i)
        dtype_name = next(m["live"][key] for m in metas if key in m["live"])[1]
        a, b = _show(int(picked["staged"][i]), dtype_name), _show(int(picked["live"][i]), dtype_name)
        return False, (f"{key}: staged element {g} ({a!r}) differs from the live ({b!r}); "
                       f"{int(diff.numel())} of {len(picked['live'])} sampled elements differ")
    plain = sorted(k[len(PLAIN):] for k in keys["live"] if k.startswith(PLAIN))
    for path in plain:
        a = next(m["plain_staged"][path] for m in metas if path in m["plain_staged"])
        b = next(m["plain_live"][path] for m in metas if path in m["plain_live"])
        if a != b:
            return False, f"{PLAIN}{path}: staged {a[0]} {a[1]} differs from the live {b[0]} {b[1]} (digest)"
    return True, (f"{len(tensors)} tensors (their boxes tile them; {len(picked['live'])} sampled elements, every "
                  f"box's ends among them, equal bit for bit) and {len(plain)} plain tensors (buffers, optimizer "
                  f"scalars) match the live state dict")


def verdict(metas: Sequence[Mapping[str, Any]], reads: Sequence[Mapping[str, Any]]) -> tuple[bool, str]:
    """:func:`compare`, a malformed round included (the same verdict on every rank: it fails, naming why)."""
    try:
        return compare(metas, reads)
    except Exception as exc:  # noqa: BLE001 - a proof that cannot be decided does not pass
        return False, f"the capture proof could not be decided: {type(exc).__name__}: {exc}"


def prove(staged_side: Side, live: Side | str, gather: Callable[[str, Any], list[Any]]) -> tuple[bool, str]:
    """This rank's part of the proof of its node: two rounds of ``gather(tag, value)``, an all-gather over the node's
    ranks in rank order (the layouts, then the samples); returns the node's verdict, the same on each of its ranks.
    ``live``: the reference (:func:`reference`), or why there is none (the proof then fails with it)."""
    meta: dict[str, Any]
    if isinstance(live, str):
        meta = {"error": live}
    else:
        try:
            meta = describe(staged_side, live)
        except Exception as exc:  # noqa: BLE001 - the proof fails with the reason
            meta = {"error": f"a rank could not describe its state: {type(exc).__name__}: {exc}"}
    metas = gather("layout", meta)
    sampled: dict[str, Any] = {}
    if not isinstance(live, str) and "error" not in meta:
        try:
            sampled = read(staged_side, live, sample_sets(metas))
        except Exception as exc:  # noqa: BLE001 - the proof fails with the reason
            sampled = {"error": f"a rank could not sample its state: {type(exc).__name__}: {exc}"}
    return verdict(metas, gather("samples", sampled))


def plain_tensors(value: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """``[(path, tensor)]`` of every tensor in a plan's plain part (nested dicts and lists), in order."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in plain_tensors(v, f"{path}/{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [x for i, v in enumerate(value) for x in plain_tensors(v, f"{path}/{i}" if path else str(i))]
    return []


# ------------------------------------------------------------------ geometry and encoding


def _strides(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[k + 1:]) for k in range(len(shape))]


def _ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    return sum(i * s for i, s in zip(index, _strides(shape)))


def _span(geo: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> tuple[int, int] | None:
    """``[a, b)`` of flat indices when the box is one contiguous run of row-major elements, else None."""
    k = next((j for j, s in enumerate(sizes) if s != 1), len(sizes))
    if all(sizes[j] == geo[j] for j in range(k + 1, len(geo))):
        a = _ravel(offsets, geo)
        return a, a + math.prod(sizes)
    return None


def _corners(geo: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """A box's first, middle and last element (flat indices); none for an empty box."""
    n = math.prod(sizes)
    if not n:
        return []
    span = _span(geo, offsets, sizes)
    if span is not None:
        return [span[0], span[0] + n // 2, span[1] - 1]
    return [_ravel(offsets, geo), _ravel([o + s // 2 for o, s in zip(offsets, sizes)], geo),
            _ravel([o + s - 1 for o, s in zip(offsets, sizes)], geo)]


def _spread(key: str, n: int) -> list[int]:
    """:data:`SPREAD` flat indices spread over ``n`` elements, each jittered inside its stretch by the key."""
    if n <= SPREAD:
        return list(range(n))
    step = n // SPREAD
    h = zlib.crc32(key.encode())
    return [k * step + (h * (k + 1)) % step for k in range(SPREAD)]


def _inside(geo: Sequence[int], offsets: Sequence[int], sizes: Sequence[int],
            gs: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(positions in gs, local flat indices)`` of the sorted flat indices ``gs`` that lie in the box."""
    if not math.prod(sizes):
        return [], []
    span = _span(geo, offsets, sizes)
    if span is not None:
        i, j = bisect.bisect_left(gs, span[0]), bisect.bisect_left(gs, span[1])
        return list(range(i, j)), [g - span[0] for g in gs[i:j]]
    strides, bstrides = _strides(geo), _strides(sizes)
    pos, local = [], []
    for i, g in enumerate(gs):
        idx = [(g // st) % d for st, d in zip(strides, geo)]
        if all(o <= x < o + s for x, o, s in zip(idx, offsets, sizes)):
            pos.append(i)
            local.append(sum((x - o) * bs for x, o, bs in zip(idx, offsets, bstrides)))
    return pos, local


def _tiling(geo: Sequence[int], boxes: Sequence[Sequence[Sequence[int]]]) -> str | None:
    """Why ``boxes`` (``[offsets, sizes]``) do not tile a tensor of shape ``geo`` exactly; None when they do."""
    numel = math.prod(geo)
    live = []
    for o, s in boxes:
        if len(o) != len(geo) or len(s) != len(geo) or any(x < 0 or n < 0 or x + n > d for x, n, d in zip(o, s, geo)):
            return f"hold a box outside it ({o}, {s} in {list(geo)})"
        if math.prod(s):
            live.append((o, s))
    for i, (o1, s1) in enumerate(live):
        for o2, s2 in live[i + 1:]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(o1, s1, o2, s2)):
                return f"overlap ({o1}, {s1} and {o2}, {s2})"
    covered = sum(math.prod(s) for _o, s in live)
    if covered != numel:
        return f"cover {covered} of its {numel} elements"
    return None


def _locate(sets: Mapping[str, Sequence[int]], order: Sequence[str], i: int) -> tuple[str, int]:
    for key in order:
        if i < len(sets[key]):
            return key, sets[key][i]
        i -= len(sets[key])
    raise IndexError(i)


def _bits(v: torch.Tensor) -> torch.Tensor:
    """The values' bits, zero-extended to int64 (what is compared: equal bits, not equal numbers)."""
    size = v.element_size()
    if size == 8:
        return v.view(torch.int64)
    if size == 4:
        return v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if size == 2:
        return v.view(torch.int16).to(torch.int64) & 0xFFFF
    if size == 1:
        return v.view(torch.uint8).to(torch.int64)
    raise ValueError(f"the capture proof cannot sample {v.dtype} elements ({size} bytes)")


def _show(bits: int, dtype_name: str) -> Any:
    """The value of ``bits`` read as ``dtype_name`` (for the reason a failed proof gives)."""
    dtype = getattr(torch, dtype_name)
    size = torch.empty((), dtype=dtype).element_size()
    raw = bytearray(struct.pack("<q", bits)[:size])
    return torch.frombuffer(raw, dtype=dtype)[0].item()


def _pack(t: torch.Tensor) -> str:
    return base64.b64encode(zlib.compress(t.numpy().tobytes(), 1)).decode("ascii")


def _unpack(text: str, dtype: torch.dtype) -> torch.Tensor:
    raw = bytearray(zlib.decompress(base64.b64decode(text)))
    return torch.frombuffer(raw, dtype=dtype) if raw else torch.zeros(0, dtype=dtype)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().reshape(-1).cpu().contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()
