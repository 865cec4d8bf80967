"""One rank's part of a heal, in order: a survivor's (:func:`heal_survivor`) and a spare's (:func:`heal_spare`).

A heal replaces a lost node by a spare without a requeue (:mod:`accelpact_slurm.repair.heal` has the picture).
Every survivor and every spare process of the heal calls one of these two with the same
:class:`~accelpact_slurm.repair.heal.HealPlan` (the dead node, the generation, the committed frontier), once the
detector named the node and a spare was assigned to it, at the committed boundary (no update in flight).

- A survivor builds its new replication group, rebinds its model to it and retires the old one.  When it is the
  source of a spare (rank i of the dead node's buddy node), it then sends its shard (:mod:`heal_transfer
  <accelpact_slurm.repair.heal_transfer>`), then the dead rank's per-rank packet its buddy copies hold
  (:class:`~accelpact_slurm.runtime.state.rank_packet.BuddyCopies`), then takes part in the certificate.
- A spare takes a stand-in world as the dead rank (if it has none yet), builds the heal's groups and its mesh,
  builds its model on that mesh through the caller's ``build(mesh)``, receives the shard in place, applies the
  packet, packs its per-rank state again and takes part in the certificate.

Both return a :class:`HealOutcome`: the certificate (its mismatches named), the bytes and seconds of each part,
the fields of the ``heal`` event.  The caller fails stop when ``outcome.certificate`` is not ok
(:meth:`~accelpact_slurm.repair.heal.Certificate.raise_if_failed`) and otherwise runs the next update; the spare's
caller puts ``outcome.data_state`` (the dead rank's data position) into its loader first.

A test's :class:`~accelpact_slurm.core.faults.TestFaults` may leave one part out or break it (``heal_fault``,
through :func:`heal_parts`): the negative controls of ``tests/repair/test_heal.py``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from accelpact_slurm.core.errors import HealError
from accelpact_slurm.core.faults import TestFaults
from accelpact_slurm.repair import heal, heal_transfer as ht, heal_wire as wire
from accelpact_slurm.repair.heal import Certificate, HealGroups, HealPlan
from accelpact_slurm.runtime.state.rank_packet import BuddyCopies, apply_rank_state, pack_rank_state

log = logging.getLogger(__name__)

_NO_FAULTS = TestFaults()


@dataclass
class HealOutcome:
    """What one rank's part of a heal did.  ``role``: ``source`` (a survivor that sent a spare its shard),
    ``survivor`` (one that only rebuilt its group: a job of more than two nodes), ``spare``."""

    plan: HealPlan
    rank: int
    role: str
    groups: HealGroups
    certificate: Certificate | None = None
    transfer: ht.TransferStats | None = None
    rebound: dict[str, int] = field(default_factory=dict)
    packet_bytes: int = 0
    data_state: dict[str, Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def event(self) -> dict[str, Any]:
        """The fields of this rank's ``heal`` event: every part's seconds, the bytes moved, the certificate."""
        out: dict[str, Any] = {"rank": self.rank, "role": self.role, "dead_node": self.plan.dead_node,
                               "generation": self.plan.generation, "frontier": self.plan.frontier,
                               "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
                               "packet_bytes": self.packet_bytes}
        if self.transfer is not None:
            out["transfer"] = self.transfer.as_dict()
        if self.rebound:
            out["rebound"] = self.rebound
        if self.certificate is not None:
            out["certified"] = self.certificate.ok
            out["mismatches"] = self.certificate.mismatches[:20]
        return out


class HealParts:
    """The parts of a heal that a test's negative control may leave out or break (:func:`heal_parts` picks the
    broken one where it is built; the heal's functions only call these)."""

    def send_shards(self, pg: dist.ProcessGroup, peer: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, **kw: Any) -> ht.TransferStats | None:
        return ht.send_shards(pg, peer, model, optimizer, **kw)

    def recv_shards(self, pg: dist.ProcessGroup, peer: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, **kw: Any) -> ht.TransferStats | None:
        return ht.recv_shards(pg, peer, model, optimizer, **kw)

    def apply_packet(self, model: torch.nn.Module, blob: bytes, **kw: Any) -> dict[str, Any] | None:
        return apply_rank_state(model, blob, **kw)


class _SkipTransfer(HealParts):
    """Test-only (``skip_transfer``): no shard moves; the spare keeps the weights it was built with."""

    def send_shards(self, *args: Any, **kw: Any) -> ht.TransferStats | None:
        return None

    def recv_shards(self, *args: Any, **kw: Any) -> ht.TransferStats | None:
        return None


class _SkipPacket(HealParts):
    """Test-only (``skip_packet``): the spare never applies the dead rank's per-rank packet."""

    def apply_packet(self, model: torch.nn.Module, blob: bytes, **kw: Any) -> dict[str, Any] | None:
        return None


class _TamperManifest(HealParts):
    """Test-only (``tamper_manifest``): the source changes its manifest after signing it (its MAC then fails)."""

    def send_shards(self, pg: dist.ProcessGroup, peer: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, **kw: Any) -> ht.TransferStats | None:
        manifest = ht.signed_manifest(model, optimizer, key=kw["key"], frontier=kw["frontier"],
                                      generation=kw["generation"], source_rank=kw["source_rank"],
                                      target_rank=kw["target_rank"])
        manifest["tensors"][0]["shape"] = [1]
        return ht.send_shards(pg, peer, model, optimizer, **kw, manifest=manifest)


def heal_parts(faults: TestFaults | None = None) -> HealParts:
    """The heal's parts; a test's ``heal_fault`` picks a broken one (here, and nowhere in the heal itself)."""
    fault = (faults or _NO_FAULTS).heal_fault
    broken: dict[str | None, type[HealParts]] = {"skip_transfer": _SkipTransfer, "skip_packet": _SkipPacket,
                                                 "tamper_manifest": _TamperManifest}
    return broken.get(fault, HealParts)()


def _spare_of(plan: HealPlan, rank: int) -> int:
    return plan.dead_node * plan.ranks_per_node + plan.local_of(rank)


def heal_survivor(plan: HealPlan, rank: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  fsdp: str, mesh: Any, replicate_group: dist.ProcessGroup, base_store: dist.Store, key: bytes,
                  buddies: BuddyCopies, timeout_s: float, parts: HealParts | None = None) -> HealOutcome:
    """A survivor's part of the heal (see the module docstring).  ``fsdp`` is ``fsdp1`` or ``fsdp2``; ``mesh`` the
    rank's mesh (None for FSDP1 on a group pair); ``replicate_group`` its replication group now (which held a
    dead rank); ``parts`` the heal's parts (:func:`heal_parts`; a test's picks a broken one).  Raises
    :class:`~accelpact_slurm.core.errors.HealError` (a group not built, a reference left) or
    :class:`~accelpact_slurm.core.errors.HealRefused` (the spare refused the manifest)."""
    parts = parts or HealParts()
    t0 = time.monotonic()
    groups = heal.build_heal_groups(plan, rank, base_store, timeout_s)
    adopted = heal.adopt_replication(model, fsdp, mesh, replicate_group, groups.replicate)
    spare = _spare_of(plan, rank)
    out = HealOutcome(plan, rank, "survivor", groups, rebound=adopted["rebound"],
                      seconds={"groups": groups.seconds, "adopt": adopted["seconds"]})
    if plan.source_of(spare) != rank:
        out.seconds["total"] = time.monotonic() - t0
        return out
    out.role = "source"
    pg, me, peer = groups.replicate, plan.node_of(rank), plan.dead_node
    out.transfer = parts.send_shards(pg, peer, model, optimizer, key=key, frontier=plan.frontier,
                                     generation=plan.generation, source_rank=rank, target_rank=spare)
    out.seconds["transfer"] = out.transfer.seconds if out.transfer is not None else 0.0
    t1 = time.monotonic()
    packet = buddies.latest(spare)
    if packet is not None and packet.frontier != plan.frontier:
        log.warning("the buddy copy of rank %d is of update %d, the heal resumes from %d", spare, packet.frontier,
                    plan.frontier)
        packet = None  # the certificate names it: "the buddy recorded no per-rank state for this rank"
    wire.send_json(pg, peer, {"digest": packet.digest if packet else None})
    wire.send_frame(pg, peer, packet.blob if packet else b"")
    out.packet_bytes = len(packet.blob) if packet else 0
    out.seconds["packet"] = time.monotonic() - t1
    out.certificate = heal.certify(pg, me, peer, model, optimizer, role="source", frontier=plan.frontier,
                                   generation=plan.generation, packet_digest=packet.digest if packet else None)
    out.seconds["certificate"] = out.certificate.seconds
    out.seconds["total"] = time.monotonic() - t0
    return out


def heal_spare(plan: HealPlan, rank: int, *, build: Callable[[Any], tuple[torch.nn.Module, torch.optim.Optimizer]],
               base_store: dist.Store, key: bytes, timeout_s: float, device_type: str = "cpu",
               parts: HealParts | None = None,
               groups: HealGroups | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer, HealOutcome]:
    """A spare's part of the heal, taking dead ``rank``'s place (see the module docstring).

    ``build(mesh)`` builds and wraps the model on the spare's mesh (as the job's script does on ``job.mesh``) and
    returns it with its optimizer; their tensors are what the shard is received into.  Returns the model, the
    optimizer and the outcome; ``outcome.data_state`` is the dead rank's data position (None when no packet was
    applied).  ``groups``: the heal's groups when the caller built them already (a spare that hands its mesh to
    the job's script before the script builds its model); the spare's mesh is then built over them.  Raises
    :class:`~accelpact_slurm.core.errors.HealRefused` when the manifest is refused (no tensor
    of this rank written) and :class:`~accelpact_slurm.core.errors.HealError` when a group or the packet fails.
    """
    parts = parts or HealParts()
    t0 = time.monotonic()
    if not dist.is_initialized():
        heal.init_spare_world(rank, plan.world_size)
    elif (dist.get_rank(), dist.get_world_size()) != (rank, plan.world_size):
        # c10d, DeviceMesh and FSDP read the global rank from the default group: a spare parked on a world of
        # its own would wrap its model as another rank's shard
        raise HealError(f"this spare's default group makes it rank {dist.get_rank()} of {dist.get_world_size()}, "
                        f"not rank {rank} of {plan.world_size}: take a stand-in world at the assignment")
    groups = groups or heal.build_heal_groups(plan, rank, base_store, timeout_s)
    mesh = heal.spare_mesh(plan, groups, device_type)
    t1 = time.monotonic()
    model, optimizer = build(mesh)
    out = HealOutcome(plan, rank, "spare", groups, seconds={"groups": groups.seconds, "build": time.monotonic() - t1})
    pg, me, peer = groups.replicate, plan.node_of(rank), plan.node_of(plan.source_of(rank))
    out.transfer = parts.recv_shards(pg, peer, model, optimizer, key=key, frontier=plan.frontier,
                                     generation=plan.generation, rank=rank)
    out.seconds["transfer"] = out.transfer.seconds if out.transfer is not None else 0.0
    t2 = time.monotonic()
    meta = wire.recv_json(pg, peer, 1 << 16)
    blob = wire.recv_frame(pg, peer)
    out.packet_bytes = len(blob)
    recorded = meta.get("digest") if isinstance(meta, dict) else None
    if recorded is not None:  # none recorded: the certificate names it
        out.data_state = parts.apply_packet(model, blob, rank=rank, frontier=plan.frontier, expect_digest=recorded)
    out.seconds["packet"] = time.monotonic() - t2
    now = pack_rank_state(model, rank=rank, frontier=plan.frontier, data_state=out.data_state or {})
    out.certificate = heal.certify(pg, me, peer, model, optimizer, role="spare", frontier=plan.frontier,
                                   generation=plan.generation, packet_digest=now.digest)
    out.seconds["certificate"] = out.certificate.seconds
    out.seconds["total"] = time.monotonic() - t0
    return model, optimizer, out
