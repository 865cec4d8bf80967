"""The HSDP layout and the process groups of the data plane.

Replicate dimension = nodes, shard dimension = ranks of a node.  Rank ``r`` sits on
node ``r // R`` at local rank ``r % R``; its shard group is the ranks of its node
and its replication group is the ranks with the same local rank on every node.

:func:`init_runtime` builds, for one rank: the data-plane store and Gloo world, the 2-D device mesh or the explicit
(shard, replicate) group pair, and the control plane on its own store.  Library code passes groups explicitly and
never issues a collective on the default group.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.runtime.transport.control import ControlPlane
from accelpact_slurm.runtime.transport.store_dial import handshake
from accelpact_slurm.runtime.transport.store_server import presence_rank
from accelpact_slurm.runtime.transport.store import JobStore, binding as store_binding, host_standby_process, \
    host_store, host_store_process, port_candidates
from accelpact_slurm.runtime.job.hardware import Hardware, nccl_environment, nccl_abort_hangs, select
from accelpact_slurm.core.errors import ConfigError, SlurmEnvError
from accelpact_slurm.core.faults import HEAL_FAULT
from accelpact_slurm.core.spares import STANDBY_KEY
from accelpact_slurm.slurm.env import SlurmContext
from accelpact_slurm.repair.torch_compat import set_group_timeout
from accelpact_slurm.runtime.detection.wiring import start_detector

if TYPE_CHECKING:
    from accelpact_slurm.repair.engine import Replaced

log = logging.getLogger(__name__)

MESH_DIMS = ("replicate", "shard")
CPU = Hardware("cpu", "gloo", "gloo", "the CPU")


@dataclass(frozen=True)
class Layout:
    """Pure arithmetic of the (replicate x shard) layout."""

    num_nodes: int
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def shard_ranks(self, node: int) -> list[int]:
        return [node * self.ranks_per_node + i for i in range(self.ranks_per_node)]

    def replicate_ranks(self, local_rank: int) -> list[int]:
        return [n * self.ranks_per_node + local_rank for n in range(self.num_nodes)]

    def mesh(self) -> list[list[int]]:
        return [self.shard_ranks(n) for n in range(self.num_nodes)]


@dataclass
class Runtime:
    """Everything distributed that one rank holds."""

    ctx: SlurmContext
    layout: Layout
    rank: int
    node: int
    local_rank: int
    data_store: dist.Store
    control: ControlPlane
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup
    mesh: DeviceMesh
    collective_timeout_s: float
    hardware: Hardware = CPU
    #: The fault detector (:mod:`..detection.collectives`): heartbeats, watched collectives and control-plane rounds.
    detector: Any = None
    #: Rank 0: the job's store it hosts (:class:`..transport.store_host.StoreProcess`, or with
    #: ``ACCELPACT_STORE_THREAD=1`` a :class:`..transport.store_server.StoreServer` thread).
    store_server: Any = None
    #: A further client of the job's store, for a thread of its own (``store_client(timeout)``).
    store_client: Any = None
    #: Node 1's first rank, in a job with spare nodes: the store's standby it hosts (:func:`mirror_store`).
    standby_server: Any = None

    @property
    def device(self) -> torch.device:
        """The device this rank trains on (``cpu`` or ``cuda:N``)."""
        return torch.device(self.hardware.device)

    def adopt(self, replaced: Replaced) -> None:
        """Hold the groups an L1 repair put in place of this rank's own (the engine returns them, it does not
        assign them here): the replication group, and the shard group when the repair replaced it too."""
        self.replicate_group = replaced.replicate_group
        if replaced.shard_group is not None:
            self.shard_group = replaced.shard_group

    def describe(self, rank: int) -> str:
        """``rank 3 (node 1)``: a rank in words, for messages."""
        return f"rank {rank} (node {self.layout.node_of(rank)})"

    def close(self) -> None:
        if self.detector is not None:
            self.detector.close()
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("destroy_process_group failed at close", exc_info=True)


def store_ports(bind_to: str, environ: Mapping[str, str], key: bytes) -> list[int]:
    """The job's store ports, in the order every rank tries them: the launcher's ``ACCELPACT_MASTER_PORT`` when
    it gave one, then ports derived from the run's key and ``bind_to`` (the job, its step and its start:
    :func:`..transport.store.port_candidates`)."""
    _addr, explicit, _control = settings.rendezvous(environ)
    first = None
    if explicit:
        try:
            first = int(explicit)
        except ValueError:
            raise ConfigError(settings.MASTER_PORT, explicit, "must be a TCP port number") from None
        if not 0 < first < 65536:
            raise ConfigError(settings.MASTER_PORT, explicit, "must be a TCP port number (1-65535)")
    return port_candidates(key, bind_to, first)


def layout_from(ctx: SlurmContext) -> Layout:
    try:
        rpn = ctx.ranks_per_node
    except SlurmEnvError:
        raise
    return Layout(num_nodes=ctx.num_nodes, ranks_per_node=rpn)


def init_runtime(ctx: SlurmContext, cfg: JobConfig, environ: Mapping[str, str] | None = None, *,
                 key: bytes, detect: bool = True, on_warning: Callable[[str], None] | None = None) -> Runtime:
    """Join the job as ``ctx.rank``: device, the job's store (rank 0 hosts it; only holders of the run's ``key``
    get in), world (Gloo, or Gloo + NCCL on GPUs), HSDP groups, control plane, fault detector (``detect=False``:
    heartbeats only, every wait blind: the detector's negative control).  ``on_warning``: rank 0's report of
    connections its store turned away."""
    environ = os.environ if environ is None else environ
    layout = layout_from(ctx)
    hw = select(cfg.topology.device, rank=ctx.rank, local_rank=layout.local_of(ctx.rank),
                ranks_per_node=layout.ranks_per_node, world_size=layout.world_size,
                emulated=settings.emulated(environ))
    log.info("rank %d trains on %s (%s)", ctx.rank, hw.device, hw.reason)
    if hw.is_cuda:
        torch.cuda.set_device(torch.device(hw.device))
        # Deterministic cuBLAS (job.protect(exact=True) turns on torch's deterministic algorithms, which need it
        # set before the first cuBLAS call); a value the user set wins.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        for warning in nccl_environment():  # read by each NCCL process group as it is created
            log.warning(warning)
        if nccl_abort_hangs(hw.versions.get("nccl", "")):
            log.warning("NCCL %s is known to hang in communicator abort (fixed in 2.26.2): a replaced communicator "
                        "is retired in the background and may never finish; upgrade NCCL", hw.versions["nccl"])
    host = settings.rendezvous(environ)[0] or ctx.rendezvous_host
    # Bound to the job, its Slurm step (two steps of one allocation share the job id and the run's key) and
    # this start: each has its own ports, and no client of one gets into another's store.
    step = environ.get("SLURM_STEP_ID", "")
    job = f"{ctx.job_id}.{step}" if step else ctx.job_id
    bind_to = store_binding(job, ctx.restart_count)
    ports = store_ports(bind_to, environ, key)
    startup = timedelta(seconds=cfg.timeouts.startup_s)
    # Ranks on other hosts: a real allocation of more than one node (the embedded default's nodes share this one).
    others = not settings.emulated(environ) and len(set(ctx.nodelist)) > 1
    serve = host_store if settings.store_thread(environ) else host_store_process
    server = serve(host, ports, key, bind_to, on_warning, reached_from_other_hosts=others) if ctx.rank == 0 else None
    # Two clients of the one store: a control-plane round that waits does not hold up a group's rendezvous.
    data_store = JobStore(host, ports, key, bind_to, ctx.rank, startup)
    control_store = JobStore(host, ports, key, bind_to, ctx.rank, startup)
    log.info("rendezvous at %s:%d (the job's store), world %d", host, data_store.port, layout.world_size)
    standby_server = None
    if cfg.topology.spare_nodes > 0 and layout.num_nodes > 1 and environ.get(HEAL_FAULT) != "no_standby":
        # node 0's loss is healed too: the store has a standby
        here = host if settings.emulated(environ) or len(ctx.nodelist) < 2 else ctx.nodelist[1]
        standby_server = mirror_store(ctx.rank, layout, data_store, [data_store, control_store], server, host=here,
                                      key=key, bind_to=bind_to, timeout=startup, on_warning=on_warning,
                                      reached_from_other_hosts=others)
    # No device_id: a bound world group would turn every members-only group build into a world-wide split.
    # The world's Gloo pairs connect within its timeout: startup_s, not collective_s (on a loaded node the ranks
    # may come up seconds apart); its collectives then get the collective timeout, as the mesh's groups do.
    dist.init_process_group(
        hw.backend, store=dist.PrefixStore("data", data_store), rank=ctx.rank,
        world_size=layout.world_size, timeout=startup,
    )
    control = ControlPlane(control_store, ctx.rank, layout.world_size, cfg.timeouts.control_s)
    if standby_server is not None or control_store.standby is not None:
        control.standby_rank = layout.ranks_per_node
    node, local = layout.node_of(ctx.rank), layout.local_of(ctx.rank)
    # One 2-D mesh; its groups are also the explicit (shard, replicate) pair the job hands out.
    mesh = init_device_mesh("cuda" if hw.is_cuda else "cpu", (layout.num_nodes, layout.ranks_per_node), mesh_dim_names=MESH_DIMS)
    shard_pg, rep_pg = mesh.get_group("shard"), mesh.get_group("replicate")

    for g in (dist.group.WORLD, shard_pg, rep_pg):  # DeviceMesh creates its groups with the default timeout
        set_group_timeout(g, cfg.timeouts.collective_s)
    assert shard_pg is not None and rep_pg is not None
    rt = Runtime(
        ctx=ctx, layout=layout, rank=ctx.rank, node=node, local_rank=local, data_store=data_store,
        control=control, shard_group=shard_pg, replicate_group=rep_pg, mesh=mesh,
        collective_timeout_s=cfg.timeouts.collective_s, hardware=hw, store_server=server,
        store_client=data_store.sibling, standby_server=standby_server,
    )

    rt.detector = start_detector(rt, cfg.timeouts, detect=detect)
    return rt


#: This process's presence connection at the store's standby (:func:`mirror_store`), kept open until it ends.
_PRESENCE: list[Any] = []


def mirror_store(rank: int, layout: Layout, store: JobStore, clients: list[JobStore], server: Any, *, host: str,
                 key: bytes, bind_to: str, timeout: timedelta, on_warning: Callable[[str], None] | None = None,
                 reached_from_other_hosts: bool = False) -> Any:
    """Give the job's store a standby on node 1, so that losing node 0 (and the store beside rank 0) is a node loss
    like any other: node 1's first rank hosts the standby (returned: its handle, None elsewhere) and says where;
    rank 0's store forwards every write to it from then on; every rank's ``clients`` go over to it if the store is
    gone (:mod:`..transport.store_server`); every other rank holds a presence connection to it, so that the ranks
    that end with the store (node 0's) are witnessed there too.  Collective: every rank calls it, within ``timeout``."""
    proc = None
    if rank == layout.ranks_per_node:
        proc, link = host_standby_process(host, key, bind_to, on_warning,
                                          reached_from_other_hosts=reached_from_other_hosts)
        store.set(STANDBY_KEY, json.dumps({"host": host, "port": proc.port, "link": link, "pid": proc.pid}))
    store.wait([STANDBY_KEY], timeout)
    doc = json.loads(store.get(STANDBY_KEY))
    if rank == 0 and server is not None:
        server.mirror_to(doc["host"], [int(doc["link"])], timeout.total_seconds())
    for client in clients:
        client.set_standby(doc["host"], [int(doc["port"])])
    if proc is None:  # this rank's presence at the standby: it sees this rank end even if the store ends with it
        try:
            presence, _sealer = handshake(doc["host"], int(doc["link"]), key, bind_to, presence_rank(rank),
                                          timeout.total_seconds())
            _PRESENCE.append(presence)  # held open for the process's life, never read
        except OSError as exc:
            log.warning("rank %d: no presence at the store's standby (%s): its end is seen by its silence there",
                        rank, exc)
    return proc
