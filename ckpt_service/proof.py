"""The capture proof: the bytes staged for a snapshot equal the live state, without the user's model.

Once per job and capture plan (the first snapshot of a start whose plans no earlier proof passed: :mod:`.proof_cache`)
each rank computes, for every tensor of its state, a position-weighted fingerprint of what it staged (read back from
the slot) and of the same tensor as ``get_state_dict`` gives it (the framework's own sharded state dict, an
independent path to the same values).  A node's ranks together hold a complete copy, so per node the sums over its
ranks must agree, whatever box layout each path uses.  A wrong mapping (a box at the wrong offset, a missed rank, a
stale buffer) changes a weighted sum far beyond rounding.  The plain part (module buffers such as batch-norm
statistics, optimizer scalars) is compared too, key by key, as the daemon writes it (the node's first rank holding the
key): a plan that leaves a buffer out fails with the key named.

Who calls: :class:`ckpt_service.client.SnapshotClient` on every rank, on the first snapshot of a
start (collective: ``get_state_dict`` and one control-plane exchange).  Reads only state dicts.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import torch

#: Relative tolerance of a fingerprint comparison (float64 sums of the same values in another order).
RTOL = 1e-9


def weights(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """Float64 weight of every element of a box, from its global row-major index (deterministic, not smooth)."""
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    idx = torch.zeros((), dtype=torch.int64)
    for k, (o, s) in enumerate(zip(offsets, sizes)):
        view = [1] * len(sizes)
        view[k] = s
        idx = idx + (torch.arange(o, o + s, dtype=torch.int64) * strides[k]).view(view)
    return 1.0 + ((idx * 2654435761) % 65536).to(torch.float64) / 65536.0


def fingerprint(boxes: Iterable[tuple[Sequence[int], Sequence[int], Sequence[int], torch.Tensor]]) -> tuple[float, float]:
    """``(weighted sum, weighted absolute sum)`` over ``(shape, offsets, sizes, values)`` boxes."""
    total, scale = 0.0, 0.0
    for shape, offsets, sizes, values in boxes:
        if not math.prod(sizes):
            continue
        v = values.detach().reshape(list(sizes)).to("cpu", torch.float64)
        w = weights(list(shape), list(offsets), list(sizes))
        total += float((v * w).sum())
        scale += float((v.abs() * w).sum())
    return total, scale


def plan_fingerprints(plan: Any, buf: torch.Tensor | None = None) -> dict[str, tuple[float, float]]:
    """Per tensor key: the fingerprint of ``plan``'s boxes, read from the slot ``buf`` when given, else live; and
    of every tensor of its plain part (``PLAIN`` + its path: module buffers, optimizer scalars), which the
    descriptor carries as it is."""
    out: dict[str, tuple[float, float]] = {}
    if buf is not None:
        by_key: dict[str, list] = {}
        for e, b, view in plan.regions(buf):
            by_key.setdefault("/".join(e.key), []).append((e.shape, b.offsets, b.sizes, view))
        for e in plan.entries:
            out["/".join(e.key)] = fingerprint(by_key.get("/".join(e.key), []))
    else:
        for e in plan.entries:
            out["/".join(e.key)] = fingerprint((e.shape, b.offsets, b.sizes, b.src) for b in e.boxes)
    for path, t in plain_tensors(plan.plain):
        shape = list(t.shape)
        out[PLAIN + path] = fingerprint([(shape, [0] * len(shape), shape, t)])
    return out


#: Key prefix of a plain tensor's fingerprint: the node keeps its first rank's (the daemon's merge), not a sum.
PLAIN = "plain:"


def plain_tensors(value: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """``[(path, tensor)]`` of every tensor in a plan's plain part (nested dicts and lists), in order."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in plain_tensors(v, f"{path}/{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [x for i, v in enumerate(value) for x in plain_tensors(v, f"{path}/{i}" if path else str(i))]
    return []


def compare(staged: Sequence[Mapping[str, Sequence[float]]], live: Sequence[Mapping[str, Sequence[float]]],
            rtol: float = RTOL) -> tuple[bool, str]:
    """Pure: sum each key over a node's ranks (``staged[i]``, ``live[i]``: rank i of the node) and compare."""
    keys = set().union(*(s.keys() for s in staged)) if staged else set()
    lkeys = set().union(*(s.keys() for s in live)) if live else set()
    if keys != lkeys:
        missing = sorted(lkeys - keys)[:3]
        extra = sorted(keys - lkeys)[:3]
        return False, f"staged tensors differ from the state dict's: missing {missing}, unexpected {extra}"
    worst = 0.0
    for k in sorted(keys):
        if k.startswith(PLAIN):  # the value the daemon writes: the node's first rank holding it (not a sum)
            a = next(s[k][0] for s in staged if k in s)
            b, scale = next(s[k] for s in live if k in s)
            scale = max(scale, 1e-30)
        else:
            a = sum(s[k][0] for s in staged if k in s)
            b = sum(s[k][0] for s in live if k in s)
            scale = max(sum(s[k][1] for s in live if k in s), 1e-30)
        err = abs(a - b) / scale
        worst = max(worst, err)
        if err > rtol:
            return False, f"{k}: staged fingerprint {a!r} differs from the live {b!r} (relative {err:.2e})"
    plain = sum(k.startswith(PLAIN) for k in keys)
    return True, (f"{len(keys) - plain} tensors and {plain} plain tensors (buffers, optimizer scalars) match the live "
                  f"state dict (worst relative difference {worst:.1e})")
