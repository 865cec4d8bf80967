"""What each part reads from a rank: typing protocols of the rank's runtime, one per consumer.

The rank's runtime is :class:`accelpact_slurm.runtime.job.topology.Runtime`; the parts that read it do not import it
(the checkpoint client may import only ``core``; the repair engine sits below the runtime) and see it through the
protocol that names only what they read: :class:`RankContext` (rank, node, layout, Slurm context, the control
plane's rounds: the checkpoint client and the reload), :class:`RepairRank` (the L1 repair engine: layout, control
plane, replication group, mesh, timeout, device, detector), :class:`GuardRank` (the boundary guard's collective and
vote) and :class:`RecoveryRank` (the L1 wiring: the guard's and the engine's, the hardware and the Slurm context).

Every member is read-only (a property): a consumer that assigns to the runtime does not type-check; the one change
a consumer makes goes through ``RecoveryRank.adopt`` (the engine returns the groups it replaced,
``repair.engine.Replaced``, and the runtime adopts them).  No torch and nothing above ``core``: process groups, the
mesh, the device and stores are typed ``Any``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

__all__ = ["JobIdentity", "RankLayout", "ControlRounds", "RepairControl", "GroupDetector", "RankContext",
           "RepairRank", "GuardRank", "RecoveryRank", "protocol_members"]


@runtime_checkable
class JobIdentity(Protocol):
    """The Slurm context as the rank's consumers read it (:class:`accelpact_slurm.slurm.env.SlurmContext`)."""

    @property
    def job_id(self) -> str: ...

    @property
    def hostname(self) -> str: ...

    @property
    def nodelist(self) -> Sequence[str]: ...

    @property
    def restart_count(self) -> int: ...


@runtime_checkable
class RankLayout(Protocol):
    """The (replicate x shard) layout (:class:`accelpact_slurm.runtime.job.topology.Layout`)."""

    @property
    def num_nodes(self) -> int: ...

    @property
    def ranks_per_node(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def node_of(self, rank: int) -> int: ...

    def local_of(self, rank: int) -> int: ...

    def shard_ranks(self, node: int) -> list[int]: ...

    def replicate_ranks(self, local_rank: int) -> list[int]: ...


@runtime_checkable
class ControlRounds(Protocol):
    """The control plane's agreements (:class:`accelpact_slurm.runtime.transport.control.ControlPlane`)."""

    def all_gather(self, name: str, value: Any, ranks: Sequence[int] | None = None,
                   timeout_s: float | None = None) -> list[Any]: ...

    def all_reduce(self, name: str, value: Any, combine: Callable[[list[Any]], Any],
                   ranks: Sequence[int] | None = None, timeout_s: float | None = None,
                   meanwhile: Callable[[], None] | None = None) -> Any: ...

    def barrier(self, name: str, ranks: Sequence[int] | None = None, timeout_s: float | None = None) -> None: ...

    def broadcast(self, name: str, value: Any = None, src: int = 0, timeout_s: float | None = None) -> Any: ...


@runtime_checkable
class RepairControl(ControlRounds, Protocol):
    """The control plane as a repair uses it: its generations, its own store, a failure put into a round."""

    @property
    def generation(self) -> int: ...

    def set_generation(self, generation: int) -> None: ...

    @property
    def base_store(self) -> Any: ...

    def contribute(self, name: str, value: Any, ranks: Sequence[int] | None = None) -> None: ...


@runtime_checkable
class GroupDetector(Protocol):
    """The fault detector on the data plane (:class:`accelpact_slurm.runtime.detection.collectives.Detector`)."""

    def stall_next(self, dim: str = "replicate") -> None: ...

    def take_latched(self) -> tuple[str, str] | None: ...

    def wait_device(self, work: Any, pg: Any, timeout_s: float) -> None: ...

    def renewed(self, pg: Any, generation: int) -> None: ...

    def timed_from_now(self, work: Any) -> None: ...


@runtime_checkable
class RankPlace(Protocol):
    """Where a rank sits: its number and the job's layout (a base of the views below)."""

    @property
    def rank(self) -> int: ...

    @property
    def layout(self) -> RankLayout: ...


@runtime_checkable
class ReplicaLink(Protocol):
    """A rank's replication group and what watches it (a base of the guard's and the engine's views)."""

    @property
    def replicate_group(self) -> Any: ...

    @property
    def collective_timeout_s(self) -> float: ...

    @property
    def device(self) -> Any: ...

    @property
    def detector(self) -> GroupDetector | None: ...


@runtime_checkable
class RankContext(RankPlace, Protocol):
    """Who this rank is in the job, and the control plane's rounds: the checkpoint client's and the reload's view."""

    @property
    def local_rank(self) -> int: ...

    @property
    def node(self) -> int: ...

    @property
    def ctx(self) -> JobIdentity: ...

    @property
    def control(self) -> ControlRounds: ...


@runtime_checkable
class RepairRank(RankPlace, ReplicaLink, Protocol):
    """The repair engine's view of a rank (its phase tests give it a small stand-in with these members)."""

    @property
    def local_rank(self) -> int: ...

    @property
    def control(self) -> RepairControl: ...

    @property
    def mesh(self) -> Any: ...


@runtime_checkable
class GuardRank(RankPlace, ReplicaLink, Protocol):
    """The boundary guard's view of a rank: its collective on the replication group and the vote."""

    @property
    def control(self) -> ControlRounds: ...


@runtime_checkable
class RecoveryRank(GuardRank, RepairRank, Protocol):
    """The L1 wiring's view of a rank: what the guard and the engine read, the hardware and the Slurm context."""

    @property
    def control(self) -> RepairControl: ...

    @property
    def ctx(self) -> JobIdentity: ...

    @property
    def hardware(self) -> Any: ...

    def adopt(self, replaced: Any) -> None:
        """Hold the groups a repair put in place of the rank's own (``repair.engine.Replaced``)."""


def protocol_members(proto: type) -> frozenset[str]:
    """The names a protocol class declares, its bases' included (attributes, properties, methods)."""
    names: set[str] = set()
    for cls in proto.__mro__:
        if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
            continue
        names |= {n for n in (*vars(cls), *getattr(cls, "__annotations__", {}))
                  if not n.startswith("_")}
    return frozenset(names)
