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

import torch.distributed as dist


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
