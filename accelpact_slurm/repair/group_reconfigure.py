"""A failed Gloo group given a new transport in place: torch 2.14.1+'s process-group reconfigure.

torch 2.14.1 and 2.15.0 let a ``ProcessGroup`` rebuild its communicator over a list of peer handles
(``torch.distributed._get_reconfigure_handle``, ``_reconfigure``), on Gloo without the group having been created
for it.  The Python object stays the same, so every reference FSDP, DeviceMesh and the runtime cached to it stays
valid: nothing is rebound, nothing is retired.  L1 gives a failed group the same members in the same order (its
group ranks do not move), so none of c10d's rank bookkeeping goes stale either.  Where it is not available
(torch 2.13, a group with an NCCL communicator: torch refuses groups of several backends, or the rebuild
setting :data:`accelpact_slurm.core.settings.REPAIR_REBUILD` turned on)
the repair builds a new group and rebinds every reference (:func:`torch_compat.build_group`, :mod:`rebind`).

The call is private and documented as experimental in both releases; this module is the one place that makes it
(re-exported by :mod:`accelpact_slurm.repair.torch_compat`), and ``tests/repair/test_group_reconfigure.py`` runs it
against a real failed group on every release that has it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

from accelpact_slurm.core import settings


def can_reconfigure(pg: dist.ProcessGroup, environ: Mapping[str, str] | None = None) -> bool:
    """True when ``pg`` can take a new transport in place: torch has the call, the group is Gloo only."""
    if settings.repair_rebuild(environ):
        return False
    supports = getattr(dist, "_supports_reconfigure", None)
    if supports is None or getattr(dist, "_reconfigure", None) is None:
        return False
    try:
        if dist.get_backend(pg) != "gloo":  # "cpu:gloo,cuda:nccl": torch refuses groups of several backends
            return False
        return bool(supports(pg))
    except (RuntimeError, ValueError):
        return False


def reconfigure_group(pg: dist.ProcessGroup, store: dist.Store, key: str, uuid: int, timeout_s: float) -> None:
    """Every member of ``pg`` calls this with the same ``key`` (fresh per repair) and ``uuid`` (never reused on this
    group): the members swap their handles through ``store`` under ``key`` and rebuild the group's transport over
    them, in their group-rank order.  Raises ``RuntimeError`` when the new transport is not the one asked for."""
    members = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    store.set(f"{key}/{me}", dist._get_reconfigure_handle(pg))
    keys = [f"{key}/{r}" for r in members]
    store.wait(keys, timeout)
    handles = [store.get(k).decode() for k in keys]
    dist._reconfigure(uuid=uuid, handles=handles, group=pg, timeout=timeout).wait()
    now = reconfigured_uuid(pg)
    if now != uuid:
        raise RuntimeError(f"group {pg.group_name}: reconfigure {uuid} left its transport at {now}")


def reconfigured_uuid(pg: dist.ProcessGroup) -> int | None:
    """The uuid of the last reconfigure of ``pg`` (None before any; Gloo's handle ``gloo:RANK:UUID:...``)."""
    parts = dist._get_reconfigure_handle(pg).split(":")
    try:
        value = int(parts[2])
    except (IndexError, ValueError):
        return None
    return None if value < 0 else value
