"""Reference rebinding: point every cached reference to the retired group at its replacement.

One rebinder per framework wrapping; each returns how many references it changed. :func:`find_references` then scans
the framework's object graph for anything still naming the retired group (by object or by registered name); the engine
fails stop when it finds one.  The scan is a bounded walk of plain Python containers and object ``__dict__``s,
skipping tensors, so it is cheap enough to run on every repair.
"""

from __future__ import annotations

import enum
import logging
import time
import types
import weakref
from collections import OrderedDict, deque
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from accelpact_slurm.repair import torch_compat as tc

log = logging.getLogger(__name__)

MAX_SCAN_NODES = 200_000
_MISSING = object()


def _rebind_slots(slots: Any, old: dist.ProcessGroup, new: dist.ProcessGroup) -> int:
    """Point each ``(object, attribute)`` slot that holds ``old`` at ``new``; how many did."""
    count = 0
    for obj, attr in slots:
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
        counts["fsdp2"] = _rebind_slots((s for i in tc.fsdp2_mesh_infos(model) for s in tc.fsdp2_slots(i)), old, new)
    else:
        counts["fsdp1"] = _rebind_slots((s for u in tc.fsdp1_units(model) for s in tc.fsdp1_slots(u)), old, new)
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
#: (``torch.Size`` holds integers only; a weak reference is not followed: it keeps nothing alive.)
#: (An enumeration's members are made with its class, before any group exists; a stream or an event holds
#: a device's handle only.)
_LEAF_TYPES = (str, int, float, bool, bytes, type(None), torch.Tensor, torch.device, torch.dtype, type,
               types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodType,
               dist.ProcessGroup, torch.Size, weakref.ReferenceType, enum.Enum, torch.Stream, torch.Event)
#: The built-in containers without attributes of their own: they hold their items only (empty: nothing).
_PLAIN = frozenset((dict, list, tuple, set, frozenset, deque))
_LEAF, _MAPPING, _ITEMS, _OBJECT = 0, 1, 2, 3
#: Per type: (how its instances are walked, the slot names along its MRO, whether to read its attributes too,
#: whether an empty instance can hold nothing: 1 always, 2 when it has no attributes either, 0 never known).
_kinds: dict[type, tuple[int, tuple[str, ...], bool, int]] = {}


def _own_slots(cls: type) -> list[str]:
    """The attribute names of ``cls``'s own ``__slots__`` (private ones mangled as Python stores them)."""
    declared = cls.__dict__.get("__slots__", ())
    names = [declared] if isinstance(declared, str) else [x for x in declared if isinstance(x, str)]
    out = []
    for name in names:
        if name in ("__dict__", "__weakref__"):
            continue
        if name.startswith("__") and not name.endswith("__"):
            name = f"_{cls.__name__.lstrip('_')}{name}"
        out.append(name)
    return out


def _kind(t: type) -> tuple[int, tuple[str, ...], bool, int]:
    """How the scan walks an instance of ``t`` (computed once per type)."""
    kind = _kinds.get(t)
    if kind is None:
        if issubclass(t, _LEAF_TYPES):
            kind = (_LEAF, (), False, 0)
        else:
            slots = tuple(dict.fromkeys(n for c in t.__mro__ for n in _own_slots(c)))
            walk = (_MAPPING if issubclass(t, dict) else
                    _ITEMS if issubclass(t, (list, tuple, set, frozenset, deque)) else _OBJECT)
            # A subclass of a container may carry attributes as well as items: both are read.
            attrs = walk == _OBJECT or t not in _PLAIN
            empty = 1 if t in _PLAIN else 2 if t is OrderedDict else 0  # nn.Module's hook tables: OrderedDict
            # An object with neither a __dict__ nor slots (a C extension's, e.g. a pybind11 enum such as
            # DebugLevel) has nothing the walk could follow: a leaf.
            kind = (_LEAF, (), False, 0) if walk == _OBJECT and not slots and not t.__dictoffset__ else (
                walk, slots, attrs, empty)
        _kinds[t] = kind
    return kind


_SPELL = {"[]": "[{!r}]", "key": "[key]", ".": ".{}", "root": "root{}"}


def _path(parents: list[int], hows: list[str], keys: list[Any], at: int, how: str, key: Any) -> str:
    """Spell the path to a find from the parent links (only ever done for a find)."""
    parts: list[str] = []
    while True:
        parts.append(_SPELL[how].format(key))
        if at < 0:
            return "".join(reversed(parts))
        at, how, key = parents[at], hows[at], keys[at]


def find_references(roots: Iterable[Any], old: Any, mesh: Any = None) -> list[str]:
    """Paths from ``roots`` to any reference to ``old``, plus any mesh dimension still resolving to it by name.

    (Group names are short strings such as ``"3"``; only the mesh's own name slots are compared, since the same string
    is a legitimate module key elsewhere.) :func:`find_references_to` does the same for several groups in one walk.
    """
    return find_references_to(roots, {"old": old}, mesh)["old"]


def find_references_to(roots: Iterable[Any], olds: dict[str, Any], mesh: Any = None,
                       locations: list[tuple[Any, str, Any]] | None = None) -> dict[str, list[str]]:
    """:func:`find_references` for every group in ``olds`` (by label) in one walk; the paths per label.

    Every object reachable from ``roots`` is entered once, except those that cannot hold anything: a value whose type
    is a leaf (tensors, strings, numbers, functions, types, process groups: one dictionary lookup per type decides)
    and an empty built-in container.  A mapping's keys and values, a collection's items, an object's ``__dict__`` (a
    module's parameters and buffers excepted: tensors) and every slot along its class's MRO are followed.  The path is
    spelt only for a find, from parent links kept per entered object.  ``locations``, if given, gets each find's
    place: ``(the object holding it (None: a root), how it is held there, the key)``, as :func:`holds` reads it back.
    """
    targets = {id(pg): label for label, pg in olds.items()}
    target_types = {type(pg) for pg in olds.values()}
    # Leaf types already known (and not a target's type): filtered out before anything else is done with them.
    skip = {t for t, k in _kinds.items() if k[0] == _LEAF} - target_types
    found: dict[str, list[str]] = {label: [] for label in olds}
    seen: set[int] = set()
    # The stack (every value still to look at, with its parent's index in the trail, how it was reached and the
    # key) and the trail (the same per entered object) are kept as parallel lists: nothing is allocated per value
    # looked at, so the walk does not set off the collector; a value is pushed without a call (most are leaves,
    # filtered by type before the push) and decided on when popped.
    objs: list[Any] = []
    parents: list[int] = []
    hows: list[str] = []
    keys: list[Any] = []
    push_o, push_p, push_h, push_k = objs.append, parents.append, hows.append, keys.append
    pop_o, pop_p, pop_h, pop_k = objs.pop, parents.pop, hows.pop, keys.pop
    t_parents: list[int] = []
    t_hows: list[str] = []
    t_keys: list[Any] = []
    t_objs: list[Any] = []  # the entered objects themselves (a find's holder, for ``locations``)
    kinds = _kinds

    for i, r in enumerate(roots):
        push_o(r)
        push_p(-1)
        push_h("root")
        push_k(i)
    visited = 0
    while objs:
        obj = pop_o()
        parent = pop_p()
        how = pop_h()
        key = pop_k()
        t = type(obj)
        if t in target_types and id(obj) in targets:
            found[targets[id(obj)]].append(_path(t_parents, t_hows, t_keys, parent, how, key))
            if locations is not None:
                locations.append((t_objs[parent] if parent >= 0 else None, how, key))
            continue
        walk, slots, attrs, empty = kinds.get(t) or _kind(t)
        if walk == _LEAF:
            if t not in target_types:  # another group of a target's type: its type must stay looked at
                skip.add(t)
            continue
        if id(obj) in seen:
            continue
        if empty and not obj and (empty == 1 or not obj.__dict__):  # an empty container holds nothing
            continue
        seen.add(id(obj))
        visited += 1
        if visited > MAX_SCAN_NODES:
            log.warning("reference scan stopped after %d objects", visited)
            break
        me = len(t_parents)
        t_parents.append(parent)
        t_hows.append(how)
        t_keys.append(key)
        t_objs.append(obj)
        if walk == _MAPPING:
            for k, v in obj.items():
                if type(k) not in skip:
                    push_o(k)
                    push_p(me)
                    push_h("key")
                    push_k(None)
                if type(v) not in skip:
                    push_o(v)
                    push_p(me)
                    push_h("[]")
                    push_k(k)
        elif walk == _ITEMS:
            for i, v in enumerate(obj):
                if type(v) not in skip:
                    push_o(v)
                    push_p(me)
                    push_h("[]")
                    push_k(i)
        if attrs:
            d = getattr(obj, "__dict__", None)
            if type(d) is dict:
                for k, v in d.items():
                    if type(v) not in skip and k != "_parameters" and k != "_buffers":
                        push_o(v)
                        push_p(me)
                        push_h(".")
                        push_k(k)
            for slot in slots:
                v = getattr(obj, slot, _MISSING)
                if v is not _MISSING and type(v) not in skip:
                    push_o(v)
                    push_p(me)
                    push_h(".")
                    push_k(slot)
    _mesh_names(mesh, olds, found)
    return found


def _mesh_names(mesh: Any, olds: dict[str, Any], found: dict[str, list[str]]) -> None:
    """Add to ``found`` every dimension of ``mesh`` (and its root) still naming one of ``olds``."""
    if mesh is not None:
        for m in (mesh, mesh._get_root_mesh()):
            for dim, name in enumerate(tc.mesh_dim_group_names(m)):
                for label, pg in olds.items():
                    if name == pg.group_name:
                        found[label].append(f"mesh._dim_group_names[{dim}] = {name!r}")


def holds(holder: Any, how: str, key: Any, target: Any) -> bool:
    """Whether ``target`` is still where a walk found it (``locations`` of :func:`find_references_to`)."""
    if holder is None:  # a root itself
        return True
    if how == ".":
        d = getattr(holder, "__dict__", None)
        if type(d) is dict and key in d:
            return d[key] is target
        return getattr(holder, key, _MISSING) is target
    if how == "key":
        return any(k is target for k in holder)
    if isinstance(holder, dict):
        return holder.get(key, _MISSING) is target
    if isinstance(holder, (set, frozenset)):  # walked in iteration order: the index says nothing
        return any(x is target for x in holder)
    try:
        return holder[key] is target
    except (IndexError, KeyError, TypeError):
        return False


class WalkAhead:
    """The invariant's walk of the framework's objects, taken before a repair (while its vote is in flight).

    It records where each reference to ``old`` is held.  After the rebinding, :meth:`left` reads those places
    back: none may hold ``old`` any more.  Sound because nothing between the walk and the rebinding adds a
    reference to ``old`` to the framework's objects: the rank is inside the guard's vote and the engine (no
    training code, no FSDP hook runs), and the rebinding writes only the new group.  Where a place still holds
    it (the rebinding replaced its holder instead, say), the full walk decides as it would without this one.
    """

    def __init__(self, roots: Iterable[Any], old: Any) -> None:
        t0 = time.monotonic()
        self.old = old
        self.idle: tuple[bool, str] | None = None  # the caller's look at the FSDP units, taken with the walk
        self.locations: list[tuple[Any, str, Any]] = []
        self.found = len(find_references_to(roots, {"old": old}, None, self.locations)["old"])
        self.seconds = time.monotonic() - t0

    def left(self, roots: Callable[[], Iterable[Any]], mesh: Any) -> list[str]:
        """The references to ``old`` left after the rebinding (paths, as :func:`find_references` gives them)."""
        if any(holds(h, how, key, self.old) for h, how, key in self.locations):
            return find_references(roots(), self.old, mesh)
        found: dict[str, list[str]] = {"old": []}
        _mesh_names(mesh, {"old": self.old}, found)
        return found["old"]
