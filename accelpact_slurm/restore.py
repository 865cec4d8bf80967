"""Restart from the newest verified snapshot every rank can reach (the L2 path builds on this).

Selection is pure (:func:`ckpt_service.index.common_step`); the I/O here lists
what this rank can reach (its node's directory, then the shared tier) and loads
it with :func:`accelpact_slurm.workload.appstate.load`.

Who calls: every rank, before the training loop, at the same point (collective).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ckpt_service.index import common_step, newest_verified, scan
from ckpt_service.layout import node_dir, shared_dir

log = logging.getLogger(__name__)

__all__ = ["reachable_verified", "restore_trainer", "newest_verified", "common_step"]


def reachable_verified(ndir: str, sdir: str) -> dict[int, str]:
    """``{step: path}`` of verified snapshots this rank can load; the node's copy wins over the shared tier."""
    out: dict[int, str] = {}
    for d in (sdir, ndir):
        for rec in scan(d):
            if rec.state == "verified":
                out[rec.step] = rec.path
    return out


def restore_trainer(trainer: Any, run_dir: str, events: Any = None) -> tuple[int | None, str]:
    """Collective: load the newest verified step every rank can reach; return ``(step or None, reason)``."""
    from .workload import appstate

    cfg, rt = trainer.cfg, trainer.rt
    ndir = node_dir(run_dir, rt.ctx.hostname, cfg.checkpoint.local_dir)
    sdir = shared_dir(run_dir, cfg.checkpoint.shared_dir)
    mine = reachable_verified(ndir, sdir)
    everyone = rt.control.all_gather("ckpt-restore", sorted(mine))
    step, why = common_step(everyone)
    if step is None:
        if any(everyone):
            log.warning("not resuming: %s", why)
        return None, why
    path = mine[step]
    meta = appstate.load(trainer, path, rt.rank)
    skipped = sorted({s for steps in everyone for s in steps if s > step})
    if rt.rank == 0 and events is not None:
        events.emit("restart_load", step=step, reason=why, skipped=skipped, path=path)
    if meta.get("step") != step:
        log.warning("snapshot %s records step %s", path, meta.get("step"))
    log.info("resumed from %s: %s", path, why)
    return step, why
