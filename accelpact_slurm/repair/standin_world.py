"""A stand-in default group for a spare process: its rank number and the world size, connected to nobody.

A spare that takes a lost node's place has no real world: the survivors' default group was built with the dead
ranks in it, and ``init_process_group`` over the whole world would need every member to enter.  Yet c10d's
members-only group builder (:func:`accelpact_slurm.repair.torch_compat.build_group`), ``DeviceMesh`` and
``dist.get_rank()`` all read the default group for the process's global rank.  torch's *fake* backend gives
exactly that: a default group that answers ``rank()`` and ``size()`` and never communicates (its collectives
return at once, untouched; nothing here ever issues one).  The spare then builds, through the store, only the
groups it is a member of.

The backend is registered by ``torch.testing._internal.distributed.fake_pg`` (torch's own tests use it) on top of
the C++ ``FakeProcessGroup``; both are private, hence this module, re-exported by the one shim
(:mod:`accelpact_slurm.repair.torch_compat`), checked by ``tests/repair/test_heal_units.py`` on every release.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def _fake_backend() -> None:
    """Register torch's fake backend (once per process)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend on import


def init_standin_world(rank: int, world_size: int) -> None:
    """Make the calling process's default group a stand-in of ``world_size`` ranks in which it is ``rank``.

    Called once, by a spare process, before it builds any group.  Raises ``RuntimeError`` when the process
    already has a default group (a survivor keeps its own).
    """
    if dist.is_initialized():
        raise RuntimeError("this process already has a default group: only a spare takes a stand-in world")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    _fake_backend()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def is_standin_world() -> bool:
    """True when the default group is a stand-in (:func:`init_standin_world`)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def adopt_world(store: dist.Store, name: str, timeout_s: float) -> dist.ProcessGroup:
    """After a heal, a real default group over the whole world again: every rank of the job (survivors and the
    spares in the dead ranks' places) calls this with the same ``store`` (a fresh prefix) and ``name``.  The new
    Gloo group (every global rank, in order) becomes the default group in place of the old one: a survivor's,
    which held the dead ranks, or a spare's stand-in.  FSDP1's optimizer state dict gathers over the default
    group (``FSDP.optim_state_dict`` with no group).  Returns the group it replaced (the caller retires it)."""
    world, me = dist.get_world_size(), dist.get_rank()
    members = list(range(world))
    pg, _ = c10d._new_process_group_helper(world, me, members, "gloo", store, group_name=name,
                                           timeout=timedelta(seconds=timeout_s), group_desc=name)
    c10d._world.pg_group_ranks[pg] = {r: r for r in members}
    old = c10d._world.default_pg
    c10d._world.default_pg = pg
    return old
