"""L1 repair of a replication-group fault during forward/backward: discard the update, replace the groups.

A fault before ``optimizer.step`` of update F+1 leaves every rank's weights and optimizer state at S_F; only FSDP's
per-iteration bookkeeping is mid-flight (different on each rank) and some HSDP groups are dead (a dead Gloo group
stays dead).  After the vote, on **every** rank: :func:`discard_update` drops the update (FSDP idle and sharded,
every gradient gone); :func:`replace_broken_groups` builds new shard and replication groups (same members, fresh
store prefix), rebinds every cached reference, checks none is left and retires the old ones; the caller restores
the update's RNG states and redoes it on the same batch, bitwise as an uninterrupted run.

:func:`withhold_replication` is the fault injection of tests and ``--inject``: the faulting rank withholds every
replication all-reduce FSDP issues, so its peers time out in their backward.  Every private torch attribute is
reached through :mod:`accelpact_slurm.repair.torch_compat`.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from accelpact_slurm.core.errors import AccelpactError, RepairError
from accelpact_slurm.repair import rebind as rb
from accelpact_slurm.repair import torch_compat as tc

log = logging.getLogger(__name__)

#: The mesh dimension of each HSDP group (replicate = nodes = dim 0, shard = ranks of a node = dim 1).
MESH_DIMS = {"replicate": 0, "shard": 1}


# ------------------------------------------------------------------ discard


def discard_update(model: nn.Module, optimizer: torch.optim.Optimizer | None, fsdp: str) -> dict[str, int]:
    """Drop the failed update's FSDP iteration state and every gradient; weights and optimizer state stay.

    Called on every rank, after the vote decided that the update failed and before the guard's idle and
    no-outstanding-gradient checks (which the mid-flight state would fail), also on ranks whose own backward succeeded:
    their gradients were never averaged across nodes.  Issues no collective.

    FSDP1: every unit resharded with its unsharded flat parameter freed, ``_saved_grad_shard`` and the flat gradient
    deleted, the handle and the state idle, the post-backward hooks removed and their flags reset,
    ``_post_forward_index`` cleared, the root's ``_post_backward_callback_queued`` reset, the execution-order data's
    post-forward order cleared.  FSDP2: ``reset_iter_state()`` on the root, then the unsharded parameters' ``.grad``,
    the accumulated unsharded gradients and the sharded gradients dropped.  Both: ``optimizer.zero_grad(set_to_none=True)``
    and every parameter's ``.grad`` set to ``None``.  Returns what was reset, as counts for the repair event; afterwards
    ``torch_compat.fsdp_idle(model, fsdp)`` holds and no parameter has a gradient.
    """
    if fsdp == "fsdp2":
        counts = tc.fsdp2_discard_iteration(model)
    elif fsdp == "fsdp1":
        counts = tc.fsdp1_discard_iteration(model)
    else:
        raise ValueError(f"fsdp must be 'fsdp1' or 'fsdp2', not {fsdp!r}")
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    counts["param_grads"] = 0
    for p in model.parameters():
        if p.grad is not None:
            p.grad = None
            counts["param_grads"] += 1
    ok, why = tc.fsdp_idle(model, fsdp)
    if not ok:
        raise RepairError(f"discarding the update left FSDP busy: {why}")
    return counts


# ------------------------------------------------------------------ fault injection


class ReplicationWithheld(AccelpactError, RuntimeError):
    """Raised on the injected faulting rank instead of its replication all-reduce (test-only fault)."""


@dataclass
class Withholding:
    """What :func:`withhold_replication` did: how many all-reduces it withheld, on which groups."""

    groups: list[dist.ProcessGroup]
    withheld: int = 0
    passed: int = 0


class _DistWithheld:
    """Stands in for ``torch.distributed`` in FSDP's modules: ``all_reduce`` on a withheld group raises."""

    def __init__(self, real: Any, record: Withholding) -> None:
        self._real = real
        self._record = record
        self._ids = {id(g) for g in record.groups}

    def all_reduce(self, tensor, *args: Any, **kwargs: Any):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)  # all_reduce(tensor, op, group, ...)
        if id(group) in self._ids:
            self._record.withheld += 1
            raise ReplicationWithheld(f"replication all-reduce withheld ({self._record.withheld})")
        self._record.passed += 1
        return self._real.all_reduce(tensor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextmanager
def withhold_replication(model: nn.Module, fsdp: str) -> Iterator[Withholding]:
    """Fault injection: inside the block, every replication all-reduce FSDP issues raises instead.

    Used only on the faulting rank, around the forward/backward of the chosen update.  The first one raises
    :class:`ReplicationWithheld` out of ``backward()``; any later one (a caller that carries on) raises too: skipping
    one all-reduce and joining the next desynchronises the Gloo group and aborts the process, so none of the update's
    is ever joined.  The peers then time out (the collective timeout) in their own backward.  The replication group is
    read from the model when the block starts; the patch is the ``dist`` global of the two FSDP modules that issue the
    all-reduce (:func:`torch_compat.replication_all_reduce_sites`), restored on exit.  Not re-entrant.
    """
    _shard, replicate = tc.hsdp_groups(model, fsdp)
    record = Withholding(groups=[replicate])
    sites = tc.replication_all_reduce_sites()
    saved = [(module, attr, getattr(module, attr)) for module, attr in sites]
    for module, attr, real in saved:
        setattr(module, attr, _DistWithheld(real, record))
    try:
        yield record
    finally:
        for module, attr, real in saved:
            setattr(module, attr, real)


# ------------------------------------------------------------------ replace and rebind


@dataclass
class GroupReplacement:
    """The result of :func:`replace_broken_groups` on one rank."""

    old: dict[str, dist.ProcessGroup]
    new: dict[str, dist.ProcessGroup]
    rebound: dict[str, int] = field(default_factory=dict)
    retired: int = 0
    in_place: tuple[str, ...] = ()  # the dimensions whose group was reconfigured in place (in ``new``, not ``old``)
    seconds: dict[str, float] = field(default_factory=dict)


def replace_broken_groups(model: nn.Module, fsdp: str, *, store: dist.Store, tag: str, timeout_s: float,
                          mesh: Any = None, dims: tuple[str, ...] = ("replicate", "shard"),
                          extra_roots: tuple[Any, ...] = (),
                          on_rebound: Callable[[dict[str, dist.ProcessGroup]], None] | None = None,
                          retire: bool = True, device: Any = None,
                          reconfigure_uuid: int | None = None) -> GroupReplacement:
    """Replace this rank's HSDP groups named in ``dims`` by new ones and rebind every reference to them.

    Called on every rank after :func:`discard_update`, in the same order relative to other group constructions.
    Replacing both dimensions on every rank replaces all the mesh's groups: the simplest rule that is always right,
    since which groups a fault broke depends on timing (a rank stuck in a replication all-reduce leaves its shard peer
    waiting).  Each new group has its old group's members, is built over ``store`` under the fresh prefix
    ``{tag}/{dim}/{lowest member}`` (``tag`` new for each repair) with ``timeout_s``, registered as
    ``accelpact-{dim}-{lowest member}-{tag}``, by the members only (``new_group`` over the world would reuse a prefix
    where the retired group's keys live); the replication group first, then the shard group, so the builds pair up.

    The old groups are read from the model; ``mesh`` (None for an FSDP1 group pair) is rebound too.  ``on_rebound(new)``
    lets the caller point its own holders at the new groups before the reference scan over the framework's objects plus
    ``extra_roots``, which must find no old group left (else :class:`RepairError`, nothing retired).  ``retire``
    unregisters the old groups from c10d (Gloo: no peer touched; NCCL: aborted in the background).  ``device``: on a GPU
    the new groups get an NCCL communicator there (:func:`torch_compat.build_group`).

    ``reconfigure_uuid`` given (never the same twice for one group): a group torch can reconfigure in place (2.14.1+,
    Gloo: :func:`torch_compat.can_reconfigure`) gets a new transport over the same members instead, keyed under
    ``{tag}/reconfigure/{dim}/{lowest member}``; it stays the same object (in ``new``, listed in ``in_place``): nothing
    of it is rebound, scanned for or retired.
    """
    t0 = time.monotonic()
    shard, replicate = tc.hsdp_groups(model, fsdp)
    current = {"replicate": replicate, "shard": shard}
    unknown = set(dims) - set(MESH_DIMS)
    if unknown:
        raise ValueError(f"unknown HSDP dimension(s) {sorted(unknown)}; expected some of {sorted(MESH_DIMS)}")
    if mesh is not None:
        names = tc.mesh_dim_group_names(mesh)
        for dim, pg in current.items():
            if names[MESH_DIMS[dim]] != pg.group_name:
                raise RepairError(f"mesh dimension {MESH_DIMS[dim]} names group {names[MESH_DIMS[dim]]!r} but "
                                  f"the model's {dim} group is {pg.group_name!r}")
    old: dict[str, dist.ProcessGroup] = {}
    new: dict[str, dist.ProcessGroup] = {}
    in_place: list[str] = []
    order: list[str] = [d for d in ("replicate", "shard") if d in dims]  # one fixed order on every rank
    if "shard" in dims and fsdp == "fsdp2":  # FSDP2's own reduce-scatter group(s) over the shard ranks, if set
        for i, pg in enumerate(tc.fsdp2_separate_reduce_scatter_groups(model)):
            current[f"reduce_scatter{i or ''}"] = pg
            order.append(f"reduce_scatter{i or ''}")
    for dim in order:
        members = dist.get_process_group_ranks(current[dim])
        first = min(members)
        prefix = f"{tag}/{dim}/{first}"
        if reconfigure_uuid is not None and tc.can_reconfigure(current[dim]):
            tc.reconfigure_group(current[dim], store, f"{tag}/reconfigure/{dim}/{first}", reconfigure_uuid, timeout_s)
            new[dim] = current[dim]
            in_place.append(dim)
            continue
        old[dim] = current[dim]
        new[dim] = tc.build_group(members, dist.PrefixStore(prefix, store), f"accelpact-{dim}-{first}-{tag}",
                                  timeout_s, device)
    t1 = time.monotonic()
    rebound = rb.rebind_groups(model, fsdp, mesh, {old[d]: new[d] for d in old}) if old else {}
    if on_rebound is not None:
        on_rebound(dict(new))
    t2 = time.monotonic()
    roots = [*tc.framework_roots(model, mesh), *extra_roots]
    left = rb.find_references_to(roots, old, mesh) if old else {}  # one walk for every replaced group
    left = {dim: paths for dim, paths in left.items() if paths}
    t3 = time.monotonic()
    if left:
        detail = "; ".join(f"{dim}: {len(p)} e.g. {p[:3]}" for dim, p in left.items())
        raise RepairError(f"rebinding invariant violated: references to a replaced group remain ({detail})")
    retired = 0
    if retire:
        for pg in old.values():
            tc.retire_group(pg)
            retired += 1
    t4 = time.monotonic()
    result = GroupReplacement(old=old, new=new, rebound=rebound, retired=retired, in_place=tuple(in_place),
                              seconds={"build": t1 - t0, "rebind": t2 - t1, "scan": t3 - t2, "retire": t4 - t3,
                                       "total": t4 - t0})
    log.info("replaced %s groups under %r: rebound %s in %.1f ms", "+".join(old), tag, rebound,
             result.seconds["total"] * 1000)
    return result
