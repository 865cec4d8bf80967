"""Every private torch attribute the repair engine touches, in one place.

FSDP and DeviceMesh cache the replication process group in attributes that
are not public API.  When torch moves one of them, the probe functions here
fail loudly (``tests/test_torch_compat.py`` runs them against a live model), and
this is the only module to change.

Slots rebound (torch 2.13):

* FSDP1 (``FullyShardedDataParallel``), per FSDP unit: ``_inter_node_pg`` and
  ``_inter_node_state.process_group`` (the default comm hook's state): 2 per unit.
* DeviceMesh: ``_dim_group_names[dim]`` (groups are resolved by name through
  c10d's registry) and ``_pg_registry[name]``.
* FSDP2 (``fully_shard``): ``mesh_info.replicate_process_group`` on every
  ``FSDPParamGroup`` and every ``FSDPParam`` (they may share one object).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterator

import torch.distributed as dist
from torch import nn

# ------------------------------------------------------------------ process groups


def build_gloo_group(members: list[int], store: dist.Store, name: str, timeout_s: float) -> dist.ProcessGroup:
    """Create a Gloo group over ``members`` from ``store`` (a fresh prefix), registered under ``name``.

    Only the members call this (unlike ``new_group``, which needs the whole world
    and reuses a store prefix derived from the membership, where stale keys of the
    retired group live).
    """
    from torch.distributed import distributed_c10d as c10d

    me = dist.get_rank()
    pg, _ = c10d._new_process_group_helper(
        len(members), members.index(me), members, "gloo", store, group_name=name,
        timeout=timedelta(seconds=timeout_s), group_desc=name,
    )
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(members)}
    return pg


def group_name(pg: dist.ProcessGroup) -> str:
    return pg.group_name


def retire_group(pg: dist.ProcessGroup) -> None:
    """Unregister a dead group from c10d (so it can be freed).  On Gloo this does not touch peers."""
    from torch.distributed import distributed_c10d as c10d

    if pg in c10d._world.pg_map:
        dist.destroy_process_group(pg)


def registered_groups() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


# ------------------------------------------------------------------ FSDP1


def fsdp1_units(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.fsdp_modules(model)


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
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

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

    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # older torch: one group or None
                groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            out.extend(groups)
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
    from torch.distributed import distributed_c10d as c10d

    c10d._set_pg_timeout(timedelta(seconds=timeout_s), pg)


def wrapping(model: nn.Module) -> tuple[str, str]:
    """``(fsdp1 | fsdp2, device_mesh | group_pair)``: how ``model`` is wrapped for HSDP.

    Raises ``ValueError`` naming the fix when it is not wrapped for HSDP (no FSDP at all, FSDP1 with
    another sharding strategy, FSDP2 on a 1-D mesh).
    """
    from torch.distributed.fsdp import ShardingStrategy

    units = fsdp1_units(model)
    if units:
        bad = [u for u in units if u.sharding_strategy not in (ShardingStrategy.HYBRID_SHARD,
                                                                  ShardingStrategy._HYBRID_SHARD_ZERO2)]
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
