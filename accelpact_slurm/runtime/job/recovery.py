"""Wiring of L1 for one rank: the envelope key of this job, the engine and the guard.

The engine returns the groups a repair replaced instead of assigning them to the runtime; the wiring hands them
to the runtime (``on_replaced=rt.adopt``: :meth:`accelpact_slurm.runtime.job.topology.Runtime.adopt`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.faults import NO_FAULTS, TestFaults
from accelpact_slurm.core.rank import RecoveryRank
from accelpact_slurm.repair.engine import RepairEngine
from accelpact_slurm.runtime.job import envelope as env_mod
from accelpact_slurm.runtime.job.guard import BoundaryGuard
from accelpact_slurm.runtime.job.phases import FaultInjector


def key_factory(nodes: int, ranks_per_node: int, fsdp: str, mesh: str, hardware: Any = None):
    """``key_for(phase)``: the envelope key of this job (platform, resource profile) for a fault in ``phase``.

    The platform is torch's version and the data plane's backend, with the NCCL and CUDA versions on a GPU
    (:attr:`accelpact_slurm.runtime.job.hardware.Hardware.platform`): what was qualified on one platform is
    allowed there only.
    """
    if hardware is None:
        platform = env_mod.platform_key(torch.__version__, "gloo")
        device = "cpu"
    else:
        platform = hardware.platform if hardware.is_cuda else env_mod.platform_key(torch.__version__, "gloo")
        device = "cuda" if hardware.is_cuda else "cpu"
    profile = env_mod.profile_key(device, nodes, ranks_per_node, fsdp, mesh)

    def key_for(phase: str) -> env_mod.Key:
        return env_mod.Key(platform, profile, phase)

    return key_for


def build_guard(cfg: JobConfig, rt: RecoveryRank, model: Any, events: Any, wrapping: tuple[str, str], *,
                faults: TestFaults = NO_FAULTS, environ: Mapping[str, str] | None = None, out=None) -> BoundaryGuard:
    """The guard of one rank, with its envelope and engine.

    The envelope: ``ACCELPACT_ENVELOPE`` alone when set, else the user's file (``accelpact-qualify`` writes it)
    layered over the shipped one (:func:`accelpact_slurm.runtime.job.envelope.load`).
    """
    fsdp, mesh = wrapping
    key_for = key_factory(rt.layout.num_nodes, rt.layout.ranks_per_node, fsdp, mesh, getattr(rt, "hardware", None))
    envelope = env_mod.load(settings.envelope_path(environ), environ)
    trial_phase = settings.qualifying(environ)
    if trial_phase:
        envelope = env_mod.trial_envelope(key_for(trial_phase))
    engine = RepairEngine(model, rt, events, fsdp=fsdp, skip_rebind=faults.skip_rebind,
                          skip_discard=faults.skip_discard, out=out, on_replaced=rt.adopt)
    injector = FaultInjector(cfg.faults, rt.rank, rt.ctx.restart_count)
    return BoundaryGuard(rt, events, envelope, key_for, engine, injector, faults)
