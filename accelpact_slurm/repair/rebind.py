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

from . import torch_compat as tc

log = logging.getLogger(__name__)

MAX_SCAN_NODES = 200_000


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


def find_references(roots: Iterable[Any], old: dist.ProcessGroup, mesh: Any = None) -> list[str]:
    """Paths from ``roots`` to any reference to ``old``, plus any mesh dimension still resolving to it by name.

    (Group names are short strings such as ``"3"``; only the mesh's own name slots
    are compared, since the same string is a legitimate module key elsewhere.)
    """
    found: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(r, f"root{i}") for i, r in enumerate(roots)]
    visited = 0
    while stack:
        obj, path = stack.pop()
        if obj is old:
            found.append(path)
            continue
        if isinstance(obj, str):
            continue
        if isinstance(obj, (int, float, bool, bytes, type(None), torch.Tensor, torch.device, torch.dtype,
                            type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType,
                            types.MethodType)):
            continue
        if isinstance(obj, dist.ProcessGroup):
            continue  # a different group: nothing to follow inside it
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        visited += 1
        if visited > MAX_SCAN_NODES:
            log.warning("reference scan stopped after %d objects", visited)
            break
        if isinstance(obj, dict):
            for k, v in obj.items():
                stack.append((k, f"{path}[key]"))
                stack.append((v, f"{path}[{k!r}]"))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(obj):
                stack.append((v, f"{path}[{i}]"))
        else:
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                for k, v in d.items():
                    if k in ("_parameters", "_buffers"):
                        continue
                    stack.append((v, f"{path}.{k}"))
            for slot in getattr(type(obj), "__slots__", ()) or ():
                if isinstance(slot, str) and hasattr(obj, slot):
                    stack.append((getattr(obj, slot), f"{path}.{slot}"))
    if mesh is not None:
        for m in (mesh, mesh._get_root_mesh()):
            for dim, name in enumerate(tc.mesh_dim_group_names(m)):
                if name == old.group_name:
                    found.append(f"mesh._dim_group_names[{dim}] = {name!r}")
    return found
