"""Heal a lost node from the live replica: the groups of the new generation, and the certificate.

With HSDP (nodes replicate, the ranks of a node shard), when a whole node dies, rank i of every surviving node
holds exactly the shard rank i of the dead node held.  A spare node's processes take the dead node's global ranks
(same numbers, same shard index); survivors keep their processes, model and optimizer objects.  What a heal does,
in order (every step on every rank of the heal, survivors and spares, at the same generation):

1. **Groups** (:func:`build_heal_groups`).  The groups that contained a dead rank are built again at a new
   generation under a fresh store prefix, members only: for each local rank i, the replication group (rank i of
   every node), and the dead node's shard group (the spare's ranks only; a survivor's shard group never held a
   dead rank).  A spare first takes a stand-in default group (:func:`init_spare_world`): its rank number and the
   world size, connected to nobody, which c10d's group builder and ``DeviceMesh`` read.  The spare then wraps
   its model on :func:`spare_mesh` (``DeviceMesh.from_group`` over its two groups); a survivor points every
   reference FSDP and its mesh cached to its old replication group at the new one (:func:`adopt_replication`,
   the L1 rebinding of :mod:`accelpact_slurm.repair.rebind`), checks none is left, and retires the old group.
2. **Transfer** (:mod:`accelpact_slurm.repair.heal_transfer`): rank i of one surviving node (the *source*,
   :meth:`HealPlan.source_of`) sends its shard to the spare's rank i over the new replication group, in place.
3. **Per-rank state**: the dead rank's RNG states, buffers and data position, from the copy its buddy kept
   (:mod:`accelpact_slurm.runtime.state.rank_packet`; the runtime side, since it reads the runtime's state).
4. **Certificate** (:func:`certify`), before the first update after the heal: every tensor's digest on the spare
   against its source's, the per-rank state's digest against the one the buddy recorded, frontier and generation
   equal.  The caller fails stop on any mismatch (:meth:`Certificate.raise_if_failed`).

Who calls: the launcher side, once the detector named a dead node and a spare was assigned to it; every
survivor and every spare process of the heal, with the same :class:`HealPlan`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from accelpact_slurm.core.errors import HealError
from accelpact_slurm.repair import heal_wire as wire, rebind as rb, torch_compat as tc
from accelpact_slurm.repair.heal_transfer import shard_digests

log = logging.getLogger(__name__)

MESH_DIM_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class HealPlan:
    """One heal, the same on every rank taking part: the job's layout, the dead node, the generation and the
    committed frontier the heal resumes from."""

    nodes: int
    ranks_per_node: int
    dead_node: int
    generation: int
    frontier: int

    def __post_init__(self) -> None:
        if not 0 <= self.dead_node < self.nodes or self.nodes < 2 or self.ranks_per_node < 1:
            raise ValueError(f"no heal of node {self.dead_node} in a job of {self.nodes} x {self.ranks_per_node}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def dead_ranks(self) -> list[int]:
        return [self.dead_node * self.ranks_per_node + i for i in range(self.ranks_per_node)]

    def replicate_members(self, local_rank: int) -> list[int]:
        """Rank ``local_rank`` of every node (the dead node's included: its spare takes that rank)."""
        return [n * self.ranks_per_node + local_rank for n in range(self.nodes)]

    def shard_members(self, node: int) -> list[int]:
        return [node * self.ranks_per_node + i for i in range(self.ranks_per_node)]

    def source_of(self, rank: int) -> int:
        """The survivor that sends dead ``rank`` its shard: the same local rank on the first surviving node
        after the dead one (round the ring: the dead node's buddy node keeps its per-rank state too)."""
        node = (self.dead_node + 1) % self.nodes
        return node * self.ranks_per_node + self.local_of(rank)

    def mesh_tensor(self) -> torch.Tensor:
        """The global ranks as the 2-D (replicate, shard) mesh."""
        return torch.arange(self.world_size, dtype=torch.int).reshape(self.nodes, self.ranks_per_node)

    def store_prefix(self) -> str:
        return f"accelpact/heal/g{self.generation}"


@dataclass
class HealGroups:
    """The groups one rank built for the heal: its new replication group, and the dead node's new shard group on
    a spare (None on a survivor, whose shard group stays)."""

    replicate: dist.ProcessGroup
    shard: dist.ProcessGroup | None
    seconds: float


def init_spare_world(rank: int, world_size: int) -> None:
    """A spare process's stand-in default group: ``rank`` of ``world_size``, connected to nobody.  Once, first."""
    tc.init_standin_world(rank, world_size)


def build_heal_groups(plan: HealPlan, rank: int, base_store: dist.Store, timeout_s: float,
                      device: torch.device | None = None) -> HealGroups:
    """Build, at ``plan.generation`` under a fresh prefix of ``base_store``, the groups of ``rank`` that held a
    dead rank: its replication group always; the shard group too when ``rank`` is one of the dead node's (the
    spare's).  Only members call; each blocks until its group's members joined or ``timeout_s`` passed.

    A replication group is never the default group, and it is built by name ``heal-g<generation>-r<local>``, the
    shard group ``heal-g<generation>-s<node>``: names no other group of the job uses.
    """
    t0 = time.monotonic()
    store = dist.PrefixStore(plan.store_prefix(), base_store)
    local = plan.local_of(rank)
    rep_name = f"heal-g{plan.generation}-r{local}"
    try:
        replicate = tc.build_group(plan.replicate_members(local), dist.PrefixStore(f"r{local}", store), rep_name,
                                   timeout_s, device)
        shard = None
        if plan.node_of(rank) == plan.dead_node:
            node = plan.dead_node
            shard = tc.build_group(plan.shard_members(node), dist.PrefixStore(f"s{node}", store),
                                   f"heal-g{plan.generation}-s{node}", timeout_s, device)
    except (RuntimeError, ValueError) as exc:  # a member that never came: the store's wait timed out
        raise HealError(f"rank {rank} could not build the heal's groups of generation {plan.generation}: "
                        f"{exc}") from exc
    return HealGroups(replicate, shard, time.monotonic() - t0)


def spare_mesh(plan: HealPlan, groups: HealGroups, device_type: str = "cpu",
               mesh_dim_names: tuple[str, str] = MESH_DIM_NAMES) -> Any:
    """The spare's 2-D (replicate, shard) ``DeviceMesh`` over its heal groups, the job's global ranks as its
    layout: what it wraps its model on (``fully_shard(module, mesh=...)``)."""
    if groups.shard is None:
        raise HealError("only a spare builds its mesh from the heal's groups (a survivor keeps its own)")
    return DeviceMesh.from_group([groups.replicate, groups.shard], device_type, mesh=plan.mesh_tensor(),
                                 mesh_dim_names=mesh_dim_names)


def adopt_replication(model: torch.nn.Module, fsdp: str, mesh: Any, old: dist.ProcessGroup,
                      new: dist.ProcessGroup) -> dict[str, Any]:
    """A survivor's side of step 1: every cached reference to ``old`` (its replication group, which held a dead
    rank) pointed at ``new``; none may be left (:class:`HealError` naming them); ``old`` retired.

    Returns the counts of slots rebound per kind and the seconds taken.
    """
    t0 = time.monotonic()
    counts = rb.rebind_groups(model, fsdp, mesh, {old: new})
    left = rb.find_references(tc.framework_roots(model, mesh), old, mesh)
    if left:
        raise HealError(f"references to the retired replication group are left after rebinding: {left[:5]}")
    tc.retire_group(old)
    return {"rebound": counts, "seconds": time.monotonic() - t0}


@dataclass
class Certificate:
    """The certificate of one heal pair (source and spare): ``ok`` when every part matched; ``mismatches``
    names each that did not (a tensor by its name, ``packet``, ``frontier``, ``generation``)."""

    ok: bool
    mismatches: list[str] = field(default_factory=list)
    tensors: int = 0
    seconds: float = 0.0

    def raise_if_failed(self) -> None:
        if not self.ok:
            shown = "; ".join(self.mismatches[:10])
            more = f"; and {len(self.mismatches) - 10} more" if len(self.mismatches) > 10 else ""
            raise HealError(f"the heal's certificate failed: {shown}{more}")


def compare_certificates(source: dict[str, Any], spare: dict[str, Any]) -> list[str]:
    """Every mismatch between the source's and the spare's certificate documents (pure; both sides call it with
    the same two documents, so both get the same list)."""
    out = []
    for what in ("frontier", "generation"):
        if source.get(what) != spare.get(what):
            out.append(f"{what}: the source's is {source.get(what)!r}, the spare's {spare.get(what)!r}")
    ds, dp = source.get("digests", {}), spare.get("digests", {})
    for name in sorted(set(ds) | set(dp)):
        if name not in dp:
            out.append(f"{name}: only on the source")
        elif name not in ds:
            out.append(f"{name}: only on the spare")
        elif ds[name] != dp[name]:
            out.append(f"{name}: the spare's bytes differ from the source's")
    ps, pp = source.get("packet"), spare.get("packet")
    if ps is None:
        out.append("packet: the buddy recorded no per-rank state for this rank")
    elif pp != ps:
        out.append(f"packet: the spare's per-rank state has digest {pp}, the buddy recorded {ps}")
    return out


def certify(pg: dist.ProcessGroup, me: int, peer: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            *, role: str, frontier: int, generation: int, packet_digest: str | None) -> Certificate:
    """The certificate of one heal pair, on both sides, before the first update after the heal.

    ``pg`` is the heal's replication group, ``me`` and ``peer`` the two sides' group ranks.  ``role`` is
    ``"source"`` (the survivor that sent the shard; ``packet_digest`` is the digest the buddy recorded for the
    dead rank's per-rank state) or ``"spare"`` (``packet_digest`` is the digest of its per-rank state as it is
    now, packed again after applying the packet).  Both sides exchange their documents (digests of every tensor
    of their shard, frontier, generation, the packet digest) and compare them the same way.
    """
    if role not in ("source", "spare"):
        raise ValueError(f"role is 'source' or 'spare', not {role!r}")
    t0 = time.monotonic()
    digests = shard_digests(model, optimizer)
    doc = {"role": role, "frontier": frontier, "generation": generation, "packet": packet_digest,
           "digests": digests}
    theirs = wire.exchange_json(pg, me, peer, doc)
    if not isinstance(theirs, dict) or theirs.get("role") == role:
        raise HealError(f"the certificate's peer sent {type(theirs).__name__} with the same role {role!r}")
    mismatches = compare_certificates(*((doc, theirs) if role == "source" else (theirs, doc)))
    return Certificate(not mismatches, mismatches, len(digests), time.monotonic() - t0)
