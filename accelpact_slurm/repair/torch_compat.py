"""Every private torch attribute the repair engine touches, in one place.

FSDP and DeviceMesh cache the replication process group in attributes that are not public API.  When torch moves one
of them, the probe functions here fail loudly (``tests/repair/test_torch_compat.py`` runs them against a live model),
and this is the only module to change.

Slots rebound (torch 2.13):

* FSDP1 (``FullyShardedDataParallel``), per FSDP unit: ``_inter_node_pg`` and
  ``_inter_node_state.process_group`` (the default comm hook's state): 2 per unit.
* DeviceMesh: ``_dim_group_names[dim]`` (groups are resolved by name through
  c10d's registry) and ``_pg_registry[name]``.
* FSDP2 (``fully_shard``): ``mesh_info.replicate_process_group`` on every
  ``FSDPParamGroup`` and every ``FSDPParam`` (they may share one object).

When the shard groups are replaced too (:func:`fsdp1_group_slots`, :func:`fsdp2_group_slots`): FSDP1's
state and handle ``process_group`` per unit and the execution-order data's ``process_group`` (one per
tree); FSDP2's ``mesh_info.shard_process_group`` (and ``reduce_scatter_process_group`` where set).

Discarding a failed iteration (:func:`fsdp1_discard_iteration`, :func:`fsdp2_discard_iteration`) and
the fault injection's patch point (:func:`replication_all_reduce_sites`) live here for the same reason.
On torch 2.14.1+ a Gloo group is given a new transport in place instead (:func:`can_reconfigure`,
:func:`reconfigure_group`, from :mod:`accelpact_slurm.repair.group_reconfigure`): then no slot is rebound.
A spare's stand-in default group (:func:`init_standin_world`) comes from :mod:`accelpact_slurm.repair.standin_world`.
"""

from __future__ import annotations

import inspect
import logging
import threading
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from accelpact_slurm.repair.collective_tap import (  # noqa: F401 - re-exported: the one shim
    TAPPED_METHODS, install_collective_tap, remove_collective_tap)
from accelpact_slurm.repair.group_reconfigure import (  # noqa: F401 - re-exported: the one shim
    can_reconfigure, reconfigure_group, reconfigured_uuid)
from accelpact_slurm.repair.standin_world import (  # noqa: F401 - re-exported: the one shim
    adopt_world, init_standin_world, is_standin_world)
from torch.distributed import distributed_c10d as c10d
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, _runtime_utils

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ process groups


def build_group(members: list[int], store: dist.Store, name: str, timeout_s: float,
                device: torch.device | None = None) -> dist.ProcessGroup:
    """Create a group over ``members`` from ``store`` (a fresh prefix), registered under ``name``.

    Only the members call this (unlike ``new_group``, which needs the whole world and reuses a store
    prefix derived from the membership, where stale keys of the retired group live).  On the CPU
    (``device`` None or ``cpu``) the group is Gloo; on a GPU it is Gloo for CPU tensors and NCCL for
    ``device``'s, the NCCL communicator created eagerly here, bound to ``device`` (the job's world group
    is never bound to a device, so this is a members-only build, not a split of the world).
    """
    me = dist.get_rank()
    cuda = device is not None and device.type == "cuda"
    extra = {"device_id": device} if cuda else {}
    pg, _ = c10d._new_process_group_helper(
        len(members), members.index(me), members, "cpu:gloo,cuda:nccl" if cuda else "gloo", store,
        group_name=name, timeout=timedelta(seconds=timeout_s), group_desc=name, **extra,
    )
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(members)}
    return pg


def build_gloo_group(members: list[int], store: dist.Store, name: str, timeout_s: float) -> dist.ProcessGroup:
    """:func:`build_group` on the CPU."""
    return build_group(members, store, name, timeout_s)


def group_name(pg: dist.ProcessGroup) -> str:
    return pg.group_name


#: The class names of an NCCL backend object: the legacy one, and torch 2.14.1+'s nccl2 (2.15's default for "nccl").
NCCL_BACKEND_CLASSES = ("ProcessGroupNCCL", "ProcessGroupNCCL2")


def nccl_backend(pg: dist.ProcessGroup) -> object | None:
    """The group's NCCL backend, or None for a group without one (Gloo only)."""
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except RuntimeError:
        return None
    # torch 2.15's "nccl" is ProcessGroupNCCL2 unless TORCH_DIST_USE_NCCL2=0 (not a subclass of the legacy one):
    # either way the group has a communicator to abort, never Gloo's destroy (runtime/job/hardware.py refuses nccl2).
    return backend if type(backend).__name__ in NCCL_BACKEND_CLASSES else None


def _unregister(pg: dist.ProcessGroup) -> None:
    """Remove ``pg`` from every registry of c10d without touching its backends (what an abort leaves to do)."""
    w = c10d._world
    tables = [w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_coalesce_state]
    hooks = getattr(w, "pg_flight_recorder_hooks", None)  # torch 2.15: one more table keyed by the group
    if isinstance(hooks, dict):
        tables.append(hooks)
    for table in tables:
        table.pop(pg, None)
    tag = w.pg_to_tag.pop(pg, None)
    for t in (tag, ""):
        if t is not None and pg in w.tags_to_pg.get(t, []):
            w.tags_to_pg[t].remove(pg)
    if tag and not w.tags_to_pg.get(tag, [None]):
        del w.tags_to_pg[tag]
    c10d._unregister_process_group(pg.group_name)


def retire_group(pg: dist.ProcessGroup) -> threading.Thread | None:
    """Unregister a dead group from c10d (so it can be freed).

    A Gloo group is destroyed at once (that does not touch peers).  A group with an NCCL communicator is
    unregistered at once and its communicator aborted on a background thread, which this returns: an
    abort takes about a second and must not hold up training, and ``destroy_process_group`` would wait
    for the failed communicator's kernels, which may never end.
    """
    if pg not in c10d._world.pg_map:
        return None
    if pg is c10d._world.default_pg:
        # DeviceMesh hands out the default group for a dimension spanning the whole world (the replication
        # dimension of N nodes x 1 rank, the shard dimension of one node).  Destroying it destroys every group
        # of the process, the replacements included; the library issues no collective on it, so it stays.
        return None
    backend = nccl_backend(pg)
    if backend is None:
        tag = c10d._world.pg_to_tag.get(pg)
        dist.destroy_process_group(pg)
        if tag and not c10d._world.tags_to_pg.get(tag, [None]):  # it leaves the group's own tag, listing nothing
            del c10d._world.tags_to_pg[tag]
        return None
    _unregister(pg)

    def abort() -> None:
        try:
            backend.abort()
        except Exception:  # pragma: no cover - GPU only; an abort that fails leaves a communicator to the exit
            log.warning("aborting the retired communicator %s failed", pg.group_name, exc_info=True)

    thread = threading.Thread(target=abort, name=f"accelpact-retire-{pg.group_name}", daemon=True)
    thread.start()
    return thread


def registered_groups() -> int:

    return len(c10d._world.pg_map)


# ------------------------------------------------------------------ FSDP1


def fsdp1_units(model: nn.Module) -> list[nn.Module]:
    """Every ``FullyShardedDataParallel`` unit under ``model`` (``model`` included), in ``modules()`` order.

    What ``FSDP.fsdp_modules(model)`` returns for the wrapper API, from one pass over ``model.modules()``:
    that one resolves each module's state through the composable API's registry, about five times slower,
    and the repair reads the units several times.
    """
    return [m for m in model.modules() if isinstance(m, FSDP)]


def fsdp1_slots(unit: nn.Module) -> list[tuple[object, str]]:
    """The (object, attribute) slots of one FSDP1 unit that hold its replication group."""
    return [(unit, "_inter_node_pg"), (unit._inter_node_state, "process_group")]


# ------------------------------------------------------------------ DeviceMesh


def mesh_dim_group_names(mesh) -> list[str]:
    return mesh._dim_group_names


def mesh_set_dim_group(mesh, dim: int, pg: dist.ProcessGroup) -> int:
    """Point mesh dimension ``dim`` at ``pg``; returns the number of slots changed."""
    root = mesh._get_root_mesh()
    changed = 0
    for m in {id(mesh): mesh, id(root): root}.values():
        names = list(m._dim_group_names)
        if names[dim] != pg.group_name:
            old = names[dim]
            names[dim] = pg.group_name
            m._dim_group_names = names
            registry = getattr(m, "_pg_registry", None)
            if registry is not None:
                registry.pop(old, None)
                registry[pg.group_name] = pg
            changed += 1
    return changed


# ------------------------------------------------------------------ FSDP2


def fsdp2_mesh_infos(model: nn.Module) -> Iterator[object]:
    """Every distinct mesh-info object of every ``fully_shard`` state under ``model``."""
    seen: set[int] = set()
    for group in fsdp2_param_groups(model):
        for info in [group.mesh_info, group.post_forward_mesh_info,
                     *(p.mesh_info for p in group.fsdp_params)]:
            if info is not None and id(info) not in seen:
                seen.add(id(info))
                yield info


def fsdp2_param_groups(model: nn.Module) -> list[object]:
    """Every parameter group of every ``fully_shard`` state under ``model`` (a state may hold several, or none)."""
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    out: list[object] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # older torch: one group or None
                groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            out.extend(groups)
    return out


def fsdp2_separate_reduce_scatter_groups(model: nn.Module) -> list[dist.ProcessGroup]:
    """The distinct groups ``set_separate_reduce_scatter_group`` gave FSDP2's reduce-scatter (in
    ``mesh_info.reduce_scatter_process_group``; none by default, when it runs on the shard group)."""
    out: list[dist.ProcessGroup] = []
    for info in fsdp2_mesh_infos(model):
        pg = getattr(info, "reduce_scatter_process_group", None)
        if pg is not None and pg is not getattr(info, "shard_process_group", None) and all(pg is not x for x in out):
            out.append(pg)
    return out


def fsdp2_slots(info: object) -> list[tuple[object, str]]:
    return [(info, "replicate_process_group")] if hasattr(info, "replicate_process_group") else []


def framework_roots(model: nn.Module, mesh: object | None) -> list[object]:
    """Objects from which every framework reference to a process group is reachable."""
    roots: list[object] = [model]
    if mesh is not None:
        roots += [mesh, mesh._get_root_mesh()]
    try:
        from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

        roots += [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    except ImportError:  # pragma: no cover - FSDP2 absent
        pass
    return roots


def fsdp_idle(model: nn.Module, fsdp: str) -> tuple[bool, str]:
    """Every FSDP unit idle (no forward/backward in flight)."""
    if fsdp == "fsdp2":
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                st = m._get_fsdp_state()
                if st._training_state != TrainingState.IDLE:
                    return False, f"FSDP2 unit {type(m).__name__} is {st._training_state.name}"
        return True, "all FSDP2 units idle"
    from torch.distributed.fsdp._common_utils import TrainingState

    for unit in fsdp1_units(model):
        if unit.training_state != TrainingState.IDLE:
            return False, f"FSDP unit is {unit.training_state.name}"
    return True, "all FSDP units idle"


def set_group_timeout(pg: dist.ProcessGroup, timeout_s: float) -> None:
    """Give a group created by DeviceMesh (default 30 min on Gloo) the job's collective timeout."""

    # torch 2.14.1 added the public set_timeout; its _set_pg_timeout forwards there with a FutureWarning.
    setter = getattr(c10d, "set_timeout", None) or c10d._set_pg_timeout
    setter(timedelta(seconds=timeout_s), pg)


def wrapping(model: nn.Module) -> tuple[str, str]:
    """``(fsdp1 | fsdp2, device_mesh | group_pair)``: how ``model`` is wrapped for HSDP.

    Raises ``ValueError`` naming the fix when it is not wrapped for HSDP (no FSDP at all, FSDP1 with
    another sharding strategy, FSDP2 on a 1-D mesh).
    """
    units = fsdp1_units(model)
    if units:
        bad = [u for u in units if u.sharding_strategy not in (ShardingStrategy.HYBRID_SHARD,
                                                                  ShardingStrategy._HYBRID_SHARD_ZERO2)]
        if bad and bad[0].sharding_strategy == ShardingStrategy.NO_SHARD and getattr(bad[0], "world_size", 0) == 1:
            raise ValueError("FSDP1 sharding_strategy is NO_SHARD: with one rank per node FSDP1 turns HYBRID_SHARD "
                             "into NO_SHARD, which never averages gradients across nodes; use FSDP2 (fully_shard on "
                             "job.mesh) for one rank per node, or two or more ranks per node")
        if bad:
            raise ValueError(f"FSDP1 sharding_strategy is {bad[0].sharding_strategy.name}; wrap with "
                             f"sharding_strategy=ShardingStrategy.HYBRID_SHARD on job.mesh or job.groups")
        mesh = getattr(units[0], "_device_mesh", None)
        return "fsdp1", "device_mesh" if mesh is not None else "group_pair"
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        groups = fsdp2_param_groups(model)
        if not groups:
            raise ValueError("fully_shard holds no parameters: shard the modules that own them, with "
                             "fully_shard(module, mesh=job.mesh)")
        for group in groups:
            mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
            if mesh is None or mesh.ndim != 2:
                raise ValueError("FSDP2 fully_shard must run on the 2-D (replicate, shard) mesh: "
                                 "fully_shard(module, mesh=job.mesh)")
        return "fsdp2", "device_mesh"
    raise ValueError("the model is not wrapped for HSDP: wrap it with FullyShardedDataParallel(model, "
                     "sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=job.mesh) or with "
                     "fully_shard(module, mesh=job.mesh) before job.protect")


# ------------------------------------------------------------------ both HSDP groups (shard and replicate)


def fsdp1_group_slots(unit: nn.Module) -> list[tuple[object, str]]:
    """Every (object, attribute) slot of one FSDP1 unit that holds its shard or its replication group.

    Shard group: the state's ``process_group``, its handle's ``process_group`` and the execution-order data's
    ``process_group`` (one object shared by every unit of the tree).  Replication group: :func:`fsdp1_slots`.
    """
    slots: list[tuple[object, str]] = [(unit, "process_group")]
    handle = getattr(unit, "_handle", None)
    if handle is not None and hasattr(handle, "process_group"):
        slots.append((handle, "process_group"))
    exec_order = getattr(unit, "_exec_order_data", None)
    if exec_order is not None and hasattr(exec_order, "process_group"):
        slots.append((exec_order, "process_group"))
    return slots + fsdp1_slots(unit)


def fsdp2_group_slots(info: object) -> list[tuple[object, str]]:
    """Every slot of one FSDP2 mesh-info object that holds a process group (shard, replicate, and a
    dedicated reduce-scatter group where ``set_separate_reduce_scatter_group`` set one)."""
    return [(info, attr) for attr in ("shard_process_group", "replicate_process_group",
                                      "reduce_scatter_process_group")
            if getattr(info, attr, None) is not None]


def hsdp_groups(model: nn.Module, fsdp: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(shard group, replication group)`` as the wrapped model itself uses them (its first unit)."""
    if fsdp == "fsdp2":
        groups = fsdp2_param_groups(model)
        if not groups:
            raise ValueError("fully_shard holds no parameters")
        info = groups[0].mesh_info
        return info.shard_process_group, info.replicate_process_group
    units = fsdp1_units(model)
    if not units:
        raise ValueError("the model has no FSDP1 unit")
    return units[0].process_group, units[0]._inter_node_pg


def replication_all_reduce_sites() -> list[tuple[object, str]]:
    """The ``(module, attribute)`` pairs through which FSDP's backward resolves ``dist.all_reduce``.

    FSDP1 (``torch/distributed/fsdp/_runtime_utils.py``, ``_reduce_grad``) calls
    ``dist.all_reduce(new_sharded_grad, group=state._inter_node_pg)``; FSDP2
    (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``) calls
    ``dist.all_reduce(reduce_output, group=all_reduce_group, ...)``.  Both look ``dist`` up in their own
    module's globals at call time, so replacing that one global intercepts exactly these calls.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    sites = []
    for module in (_runtime_utils, _fsdp_collectives):
        if getattr(module, "dist", None) is not dist:
            raise RuntimeError(f"{module.__name__} no longer resolves all_reduce through its 'dist' global")
        sites.append((module, "dist"))
    return sites


# ------------------------------------------------------------------ discarding a failed iteration


def fsdp1_discard_iteration(model: nn.Module) -> dict[str, int]:
    """Put every FSDP1 unit back where its post-backward callback would have left it, gradients dropped.

    What ``_post_backward_final_callback`` (``torch/distributed/fsdp/_runtime_utils.py``) does at the
    end of a backward, for an iteration that never reached it, on every unit: each line below names
    the failure it prevents on the redo.
    """
    from torch.distributed.fsdp._common_utils import TrainingState
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    counts = {"units": 0, "resharded": 0, "saved_grad_shards": 0, "flat_grads": 0, "post_backward_hooks": 0}
    exec_orders: dict[int, object] = {}
    for unit in fsdp1_units(model):
        counts["units"] += 1
        unit.training_state = TrainingState.IDLE
        if getattr(unit, "_is_root", False):
            unit._post_backward_callback_queued = False
        exec_order = getattr(unit, "_exec_order_data", None)
        if exec_order is not None:
            exec_orders[id(exec_order)] = exec_order
        handle = unit._handle
        if handle is None:
            continue
        # Idle first: a handle still in FORWARD would keep the unsharded views on reshard, and one not
        # IDLE skips its forward setup on the redo ("mat2 must be a matrix, got 1-D tensor").
        handle._training_state = HandleTrainingState.IDLE
        flat_param = handle.flat_param
        # A half-reduced sharded gradient would be added to the redo's (silently wrong update).
        if hasattr(flat_param, "_saved_grad_shard"):
            del flat_param._saved_grad_shard
            counts["saved_grad_shards"] += 1
        if flat_param.grad is not None:
            flat_param.grad = None
            counts["flat_grads"] += 1
        # An unsharded flat parameter left allocated makes the redo skip its all-gather while the
        # peers run theirs: mismatched collectives.
        if handle.uses_sharded_strategy:
            allocated = handle._get_padded_unsharded_flat_param()._typed_storage()._size() > 0
            unsharded = flat_param.data_ptr() != flat_param._local_shard.data_ptr()
            handle.reshard(True)
            handle.post_reshard()
            counts["resharded"] += int(allocated or unsharded)
            if handle._use_orig_params:  # the original parameters' .grad views follow the (now absent) shard grad
                handle._use_sharded_grad_views()
        # The post-backward hook of the failed iteration (the redo's forward registers its own).
        state = getattr(flat_param, "_post_backward_hook_state", None)
        if state is not None:
            state[-1].remove()
            delattr(flat_param, "_post_backward_hook_state")
            counts["post_backward_hooks"] += 1
        hook = getattr(flat_param, "_post_backward_hook_handle", None)
        if hook is not None:
            hook.remove()
            delattr(flat_param, "_post_backward_hook_handle")
            counts["post_backward_hooks"] += 1
        if hasattr(flat_param, "_post_backward_called"):
            flat_param._post_backward_called = False
        handle._prefetched = False
        handle._ran_pre_backward_hook = False
        handle._needs_pre_backward_unshard = False
        handle._needs_pre_forward_unshard = False
        handle._post_forward_index = None
    for exec_order in exec_orders.values():
        # Not ``next_iter()``: the failed iteration does not count as one (the first-iteration order
        # checks keyed on ``_iter`` stay as the uninterrupted run has them).
        exec_order.handles_post_forward_order.clear()
        exec_order.current_order_index = 0
    return counts


def fsdp2_root(model: nn.Module) -> nn.Module | None:
    """The outermost ``fully_shard`` module under ``model`` (the one ``reset_iter_state`` must be called on)."""
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    return next((m for m in model.modules() if isinstance(m, FSDPModule)), None)


def _fsdp2_reset_iter_state(root: nn.Module) -> None:
    """What ``FSDPModule.reset_iter_state`` does (torch 2.12+), for a torch without it: wait on every in-flight
    collective's event, drop the per-iteration communication state, set every state and group IDLE and
    reshard.  Every attribute is read with a default, since they moved between releases."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = root._get_fsdp_state()
    handle = getattr(state, "_device_handle", None)
    stream = handle.current_stream() if handle is not None and hasattr(handle, "current_stream") else None

    def wait(event: object) -> None:
        if event is not None and stream is not None:
            stream.wait_event(event)

    ctx = state._comm_ctx
    ag = getattr(ctx, "all_gather_state", None)
    if ag is not None:
        wait(getattr(ag, "event", None))
        ctx.all_gather_state = None
    for rs in getattr(ctx, "reduce_scatter_states", ()):
        wait(getattr(rs, "event", None))
    if hasattr(ctx, "reduce_scatter_states"):
        ctx.reduce_scatter_states.clear()
    for event in getattr(ctx, "_last_post_reduce_events", {}).values():
        wait(event)
    for name in ("_last_post_reduce_events", "post_forward_order"):
        if hasattr(ctx, name):
            getattr(ctx, name).clear()
    for st in state._state_ctx.all_states:
        if hasattr(st, "_modules_to_run_forward"):
            st._modules_to_run_forward.clear()
        st._training_state = TrainingState.IDLE
        groups = getattr(st, "_fsdp_param_groups", None)
        if groups is None:  # older torch: one group or None
            groups = [st._fsdp_param_group] if getattr(st, "_fsdp_param_group", None) is not None else []
        for group in groups:
            result = getattr(group, "_all_gather_result", None)
            if result is not None:
                wait(getattr(result, "all_gather_event", None))
                work = getattr(result, "all_gather_work", None)
                if isinstance(work, dist.Work):
                    try:
                        work.wait()
                    except RuntimeError:  # a dead group's all-gather: its output is of no use now
                        pass
                group._all_gather_result = None
            for name in ("_post_reduce_event", "_all_reduce_state"):
                value = getattr(group, name, None)
                wait(value if name == "_post_reduce_event" else getattr(value, "event", None))
                if hasattr(group, name):
                    setattr(group, name, None)
            event = getattr(group, "_reshard_after_forward_event", None)
            if event is not None:
                if hasattr(group, "_wait_all_gather_streams_on_event"):
                    group._wait_all_gather_streams_on_event(event)
                group._reshard_after_forward_event = None
            if hasattr(group, "_partial_reduce_output"):
                group._partial_reduce_output = None
            if hasattr(group, "_post_forward_indices"):
                group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def fsdp2_discard_iteration(model: nn.Module) -> dict[str, int]:
    """``reset_iter_state()`` on the root, then drop every gradient it leaves behind.

    ``FSDPModule.reset_iter_state`` (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``) resets the
    per-iteration trackers and reshards, but the unsharded parameters of a unit whose reduction never
    ran keep their ``.grad`` (the root's, typically): added into the redo's gradient, a silently wrong
    update.  The sharded gradients go too (a reduction that completed before the fault left one).
    """
    root = fsdp2_root(model)
    counts = {"param_groups": 0, "unsharded_grads": 0, "accumulated_grads": 0, "sharded_grads": 0}
    if root is None:
        return counts
    for group in fsdp2_param_groups(model):
        # A dead group's all-gather work raises again when ``reset_iter_state`` waits on it; its
        # output is of no use to anyone now.
        result = getattr(group, "_all_gather_result", None)
        work = getattr(result, "all_gather_work", None)
        if isinstance(work, dist.Work):
            try:
                work.wait()
            except RuntimeError:
                group._all_gather_result = None
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
    else:  # torch before 2.12 has no reset_iter_state: the same steps, on the attributes it has
        _fsdp2_reset_iter_state(root)
    for group in fsdp2_param_groups(model):
        counts["param_groups"] += 1
        for fp in group.fsdp_params:
            for what in fsdp2_drop_param_grads(fp):
                counts[what] += 1
    return counts


def fsdp2_drop_param_grads(fp: object) -> list[str]:
    """Drop every gradient one ``FSDPParam`` holds; returns the kinds dropped (``counts`` keys).

    ``unsharded_accumulated_grad`` is an attribute of its own up to torch 2.14 (the gradient accumulated in the
    reduce dtype) and a read-only property in 2.15 that reads ``_unsharded_param.grad``, dropped just before:
    assigning it there would raise.
    """
    dropped = []
    unsharded = getattr(fp, "_unsharded_param", None)
    if unsharded is not None and unsharded.grad is not None:
        unsharded.grad = None
        dropped.append("unsharded_grads")
    alias = inspect.getattr_static(type(fp), "unsharded_accumulated_grad", None)
    if not (isinstance(alias, property) and alias.fset is None):
        if getattr(fp, "unsharded_accumulated_grad", None) is not None:
            fp.unsharded_accumulated_grad = None
            dropped.append("accumulated_grads")
    sharded = getattr(fp, "sharded_param", None)
    if sharded is not None and sharded.grad is not None:
        sharded.grad = None
        dropped.append("sharded_grads")
    return dropped
