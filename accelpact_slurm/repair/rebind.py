"""Reference rebinding: point every cached reference to the retired group at its replacement.

One rebinder per framework wrapping; each returns how many references it changed.
:func:`find_references` then scans the framework's object graph for anything still
naming the retired group (by object or by registered name); the engine fails stop
when it finds one.  The scan is a bounded walk of plain Python containers and
object ``__dict__``s, skipping tensors, so it is cheap enough to run on every repair.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from accelpact_slurm.repair import torch_compat as tc

log = logging.getLogger(__name__)

MAX_SCAN_NODES = 200_000
_MISSING = object()


def rebind_fsdp1(model: nn.Module, old: dist.ProcessGroup, new: dist.ProcessGroup) -> int:
    count = 0
    for unit in tc.fsdp1_units(model):
        for obj, attr in tc.fsdp1_slots(unit):
            if getattr(obj, attr) is old:
                setattr(obj, attr, new)
                count += 1
    return count


def rebind_fsdp2(model: nn.Module, old: dist.ProcessGroup, new: dist.ProcessGroup) -> int:
    count = 0
    for info in tc.fsdp2_mesh_infos(model):
        for obj, attr in tc.fsdp2_slots(info):
            if getattr(obj, attr) is old:
                setattr(obj, attr, new)
                count += 1
    return count


def rebind_mesh(mesh: Any, dim: int, new: dist.ProcessGroup) -> int:
    return tc.mesh_set_dim_group(mesh, dim, new) if mesh is not None else 0


def rebind_all(model: nn.Module, fsdp: str, mesh: Any, replicate_dim: int,
               old: dist.ProcessGroup, new: dist.ProcessGroup) -> dict[str, int]:
    """Rebind every framework reference; returns counts per kind."""
    counts = {"mesh": rebind_mesh(mesh, replicate_dim, new)}
    if fsdp == "fsdp2":
        counts["fsdp2"] = rebind_fsdp2(model, old, new)
    else:
        counts["fsdp1"] = rebind_fsdp1(model, old, new)
    return counts


def rebind_groups(model: nn.Module, fsdp: str, mesh: Any,
                  mapping: dict[dist.ProcessGroup, dist.ProcessGroup]) -> dict[str, int]:
    """Point every framework reference to each key of ``mapping`` (an old group) at its value (the new one).

    Covers both HSDP groups at once (shard and replication): FSDP1's per-unit, per-handle and
    execution-order slots, FSDP2's mesh-info slots, and every mesh dimension naming an old group.
    Returns how many slots changed, per kind.  Idempotent: a second call changes nothing.
    """
    by_id = {id(old): new for old, new in mapping.items()}
    counts = {"mesh": 0}
    if mesh is not None:
        for m in (mesh, mesh._get_root_mesh()):
            for dim, name in enumerate(list(tc.mesh_dim_group_names(m))):
                for old, new in mapping.items():
                    if name == old.group_name:
                        counts["mesh"] += tc.mesh_set_dim_group(m, dim, new)
    if fsdp == "fsdp2":
        slots = [slot for info in tc.fsdp2_mesh_infos(model) for slot in tc.fsdp2_group_slots(info)]
    else:
        slots = [slot for unit in tc.fsdp1_units(model) for slot in tc.fsdp1_group_slots(unit)]
    counts[fsdp] = 0
    for obj, attr in slots:
        new = by_id.get(id(getattr(obj, attr)))
        if new is not None:
            setattr(obj, attr, new)
            counts[fsdp] += 1
    return counts


#: Values the scan never enters: no group can hide inside them (a group other than the retired one included).
_LEAF_TYPES = (str, int, float, bool, bytes, type(None), torch.Tensor, torch.device, torch.dtype, type,
               types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodType,
               dist.ProcessGroup)
_leaf_by_type: dict[type, bool] = {}


def _is_leaf(t: type) -> bool:
    leaf = _leaf_by_type.get(t)
    if leaf is None:
        leaf = _leaf_by_type[t] = issubclass(t, _LEAF_TYPES)
    return leaf


_SPELL = {"[]": "[{!r}]", "key": "[key]", ".": ".{}", "root": "root{}"}


def _path(trail: list[tuple[int, str, Any]], at: int, kind: str, key: Any) -> str:
    """Spell the path to a find from the parent links (only ever done for a find)."""
    parts: list[str] = []
    while True:
        parts.append(_SPELL[kind].format(key))
        if at < 0:
            return "".join(reversed(parts))
        at, kind, key = trail[at]


def find_references(roots: Iterable[Any], old: dist.ProcessGroup, mesh: Any = None) -> list[str]:
    """Paths from ``roots`` to any reference to ``old``, plus any mesh dimension still resolving to it by name.

    (Group names are short strings such as ``"3"``; only the mesh's own name slots
    are compared, since the same string is a legitimate module key elsewhere.)

    Every object is entered once; a value's type decides in one dictionary lookup whether
    it can hold anything (tensors, strings, numbers and other groups cannot), and the
    path is spelt only for a find, from parent links kept per entered object.
    """
    found: list[str] = []
    seen: set[int] = set()
    trail: list[tuple[int, str, Any]] = []  # per entered object: (parent's index, how reached, key)
    stack: list[tuple[Any, int, str, Any]] = []
    for i, r in enumerate(roots):
        if r is old:
            found.append(f"root{i}")
        elif not _is_leaf(type(r)):
            stack.append((r, -1, "root", i))
    visited = 0
    while stack:
        obj, parent, kind, key = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        visited += 1
        if visited > MAX_SCAN_NODES:
            log.warning("reference scan stopped after %d objects", visited)
            break
        trail.append((parent, kind, key))
        me = len(trail) - 1
        if isinstance(obj, dict):
            children: Iterable[tuple[Any, str, Any]] = (
                pair for k, v in obj.items() for pair in ((k, "key", None), (v, "[]", k)))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = ((v, "[]", i) for i, v in enumerate(obj))
        else:
            d = getattr(obj, "__dict__", None)
            attrs = [(v, ".", k) for k, v in d.items() if k not in ("_parameters", "_buffers")] \
                if isinstance(d, dict) else []
            for slot in getattr(type(obj), "__slots__", ()) or ():
                if isinstance(slot, str):
                    v = getattr(obj, slot, _MISSING)
                    if v is not _MISSING:
                        attrs.append((v, ".", slot))
            children = attrs
        for v, how, k in children:
            if v is old:
                found.append(_path(trail, me, how, k))
            elif not _is_leaf(type(v)) and id(v) not in seen:
                stack.append((v, me, how, k))
    if mesh is not None:
        for m in (mesh, mesh._get_root_mesh()):
            for dim, name in enumerate(tc.mesh_dim_group_names(m)):
                if name == old.group_name:
                    found.append(f"mesh._dim_group_names[{dim}] = {name!r}")
    return found
