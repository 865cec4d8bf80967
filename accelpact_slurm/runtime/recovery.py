"""Wiring of L1 for one rank: the envelope key of this job, the engine and the guard."""

from __future__ import annotations

import os

import torch

from accelpact_slurm.runtime import envelope as env_mod
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.events import EventLog
from accelpact_slurm.runtime.guard import BoundaryGuard
from accelpact_slurm.repair.engine import RepairEngine

#: Path of the envelope file (default: the one shipped in the package).
ENVELOPE_VAR = "ACCELPACT_ENVELOPE"
#: Set by accelpact-qualify for its trials: attempt Preserve on an unqualified key to earn the entry.
QUALIFYING_VAR = "ACCELPACT_QUALIFYING"


def key_factory(cfg: JobConfig, nodes: int, ranks_per_node: int):
    platform = env_mod.platform_key(torch.__version__, "gloo")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    profile = env_mod.profile_key(device, nodes, ranks_per_node, cfg.model.fsdp, cfg.model.mesh)

    def key_for(phase: str) -> env_mod.Key:
        return env_mod.Key(platform, profile, phase)

    return key_for


def build_guard(cfg: JobConfig, trainer, events: EventLog) -> BoundaryGuard:
    rt = trainer.rt
    key_for = key_factory(cfg, rt.layout.num_nodes, rt.layout.ranks_per_node)
    envelope = env_mod.load(os.environ.get(ENVELOPE_VAR) or None)
    if os.environ.get(QUALIFYING_VAR) == "1":
        envelope = env_mod.trial_envelope(key_for("committed"))
    engine = RepairEngine(trainer, events, cfg)
    return BoundaryGuard(cfg, trainer, events, envelope, key_for, engine)
