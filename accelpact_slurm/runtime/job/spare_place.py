"""A spare process takes a dead rank's place: the identity switch, the heal's groups and mesh, the user's script
up to ``job.protect``, and the spare's part of the heal there.

Who calls: :func:`accelpact_slurm.runtime.job.spare.run_spare`, once the spare's node was handed an
:class:`~accelpact_slurm.core.spares.Assignment` (the spare process of local rank ``l`` takes
``assignment.ranks[l]``).  In order:

1. **Identity switch**: the process becomes rank ``r`` of the dead node: ``RANK``, ``LOCAL_RANK``,
   ``SLURM_PROCID``, ``SLURM_LOCALID`` and ``SLURM_NODEID`` in its environment; its log records labelled
   ``[rank r]``; from here its events carry ``rank`` ``r`` and ``node`` the dead node's.  Its log file stays
   the spare's own (the launcher opened it), and the dead node's checkpoint daemon is not taken over: a healed
   node takes no snapshots (``docs/heal.md``).
2. **Stand-in world and the heal's groups**: a stand-in default group as rank ``r`` of the job's world
   (:func:`~accelpact_slurm.repair.heal.init_spare_world`), then the heal's replication and shard groups of the
   assignment's generation over the job's store, and the spare's (replicate, shard) mesh over them.
3. **The user's script** (the job's entry point) with a :class:`SpareJob`: its ``mesh`` and ``groups`` are the
   heal's, so the script wraps its model exactly as the dead rank did (same shard layout), and its
   :meth:`SpareJob.protect` runs the spare's part of the heal (:func:`~accelpact_slurm.runtime.job.healing.heal_spare`)
   instead of a reload: the shard received in place from the live replica, the dead rank's per-rank packet
   applied (RNG states, buffers), its ``Stateful`` states (data position, scheduler) loaded from the packet's
   ``data_state``, the certificate checked, a ``heal`` event and one console line.

**Not yet**: going on with the user's loop after the heal (a ``Run`` for a spare: the control plane, the guard
and the detector joined as rank ``r``).  :meth:`SpareJob.protect` ends the script there (:class:`TookPlace`), and
the spare process exits 0 with the outcome in its ``spare_end`` reason.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Mapping, MutableMapping, TextIO

import torch

from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.errors import HealError, UsageError
from accelpact_slurm.core.events import EVENTS_FILE, EventLog
from accelpact_slurm.core.faults import TestFaults
from accelpact_slurm.core.spares import Assignment
from accelpact_slurm.repair import heal
from accelpact_slurm.runtime.job.entry import label_log_records, resolve_entry
from accelpact_slurm.runtime.job.healing import HealOutcome, heal_parts, heal_spare
from accelpact_slurm.runtime.state import appstate
from accelpact_slurm.runtime.state.buddy_ring import restore_data_state
from accelpact_slurm.runtime.state.sampler import ShardedSampler

log = logging.getLogger(__name__)


class TookPlace(BaseException):
    """Raised out of :meth:`SpareJob.protect` once the heal is certified: ends the user's script on the spare (a
    ``BaseException``, as the API's ``Redo``: a script's ``except Exception`` must not swallow it)."""

    def __init__(self, outcome: HealOutcome) -> None:
        super().__init__(f"rank {outcome.rank} healed at update {outcome.plan.frontier}")
        self.outcome = outcome


def become(rank: int, plan: heal.HealPlan, environ: MutableMapping[str, str] | None = None) -> None:
    """The identity switch of the process environment and its log records: this process is now ``rank``."""
    env = os.environ if environ is None else environ
    env.update({"RANK": str(rank), "LOCAL_RANK": str(plan.local_of(rank)), "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(plan.local_of(rank)), "SLURM_NODEID": str(plan.dead_node)})
    label_log_records(rank, env)


class SpareJob:
    """The :class:`~accelpact_slurm.runtime.job.api.Job` a spare hands the user's script: the dead rank's place,
    the heal's mesh and groups, and a :meth:`protect` that heals instead of reloading."""

    def __init__(self, cfg: JobConfig, plan: heal.HealPlan, rank: int, groups: heal.HealGroups, mesh: Any, *,
                 run_dir: str, events: EventLog, base_store: Any, key: bytes, faults: TestFaults,
                 out: TextIO, extra_event: Mapping[str, Any]) -> None:
        self.config, self._plan, self._groups = cfg, plan, groups
        self._store, self._key, self._faults, self._out = base_store, key, faults, out
        self._extra_event = dict(extra_event)
        self.rank, self.world_size = rank, plan.world_size
        self.node, self.num_nodes = plan.dead_node, plan.nodes
        self.local_rank, self.ranks_per_node = plan.local_of(rank), plan.ranks_per_node
        self.device = torch.device("cpu")  # the heal builds Gloo groups: NCCL is not covered yet
        self.mesh = mesh
        self.run_dir, self.events = run_dir, events
        self.params: dict[str, Any] = dict(cfg.params)
        self.seed, self.steps = cfg.seed, cfg.steps
        self.run: Any = None
        self.outcome: HealOutcome | None = None

    @property
    def groups(self) -> tuple[Any, Any]:
        return self._groups.shard, self._groups.replicate

    @property
    def is_lead(self) -> bool:
        return False  # rank 0 is never healed (its node hosts the store)

    def log(self, message: str) -> None:
        return None

    def on_stop(self, hook: Callable[[Any], Any]) -> None:
        return None

    def sampler(self, dataset: Any, *, shuffle: bool = True, seed: int | None = None,
                drop_last: bool = True) -> ShardedSampler:
        return ShardedSampler(dataset, rank=self.rank, world_size=self.world_size, shuffle=shuffle,
                              seed=self.seed if seed is None else seed, drop_last=drop_last)

    def protect(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                state: Mapping[str, Any] | None = None, exact: bool = True) -> Any:
        """The spare's part of the heal, into ``model`` and ``optimizer`` as the script built them on the heal's
        mesh; raises :class:`TookPlace` once certified, :class:`HealError` (or ``HealRefused``) otherwise."""
        if self.outcome is not None:
            raise UsageError("job.protect", "a second call", "call job.protect once per job, after wrapping")
        if exact:
            torch.use_deterministic_algorithms(True)
        statefuls = appstate.statefuls(scheduler, dict(state or {}))
        plan, cfg = self._plan, self.config
        _, _, outcome = heal_spare(plan, self.rank, build=lambda _mesh: (model, optimizer), base_store=self._store,
                                   key=self._key, timeout_s=cfg.timeouts.control_s, parts=heal_parts(self._faults),
                                   groups=self._groups)
        self.outcome = outcome
        missing = restore_data_state(outcome.data_state, statefuls) if outcome.data_state is not None else []
        cert = outcome.certificate
        ok = cert is not None and cert.ok
        self.events.emit("heal", **outcome.event(), **self._extra_event, state_missing=missing)
        moved = outcome.transfer.as_dict() if outcome.transfer is not None else {}
        print(f"[accelpact] heal: rank {self.rank} of node {plan.dead_node} taken by spare node "
              f"{self._extra_event.get('spare_node')} at update {plan.frontier} (generation {plan.generation}): "
              f"{'certified' if ok else 'certificate FAILED'}, {moved.get('tensor_bytes', 0):.0f} bytes in "
              f"{outcome.seconds.get('total', 0.0):.3f} s", file=self._out, flush=True)
        if cert is not None:
            cert.raise_if_failed()
        raise TookPlace(outcome)


def take_place(assignment: Assignment, cfg: JobConfig, *, store: Any, key: bytes, run_dir: str,
               job_file: str | None, job_id: str, restart: int, local_rank: int, sid: int,
               out: TextIO | None = None, environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """This spare process takes ``assignment.ranks[local_rank]`` (see the module): ``(True, why)`` once the heal's
    certificate passed, ``(False, why)`` when the heal failed (a group not built, the manifest refused, the
    certificate failed; the survivors fail stop on the same)."""
    nodes, rpn = cfg.topology.nodes, cfg.topology.ranks_per_node
    rank = assignment.ranks[local_rank]
    plan = heal.HealPlan(nodes, rpn, assignment.dead_node, assignment.generation, assignment.frontier)
    become(rank, plan)
    events = EventLog(os.path.join(run_dir, EVENTS_FILE), job_id=job_id, restart=restart, rank=rank,
                      node=plan.dead_node)
    try:
        events.emit("process", role="rank", pid=os.getpid(), spare=sid, spare_node=assignment.spare_node,
                    local_rank=plan.local_of(rank), healed=True)
        try:
            entry = resolve_entry(cfg.entry, job_file)
            heal.init_spare_world(rank, plan.world_size)
            groups = heal.build_heal_groups(plan, rank, store, cfg.timeouts.control_s)
            mesh = heal.spare_mesh(plan, groups)
            job = SpareJob(cfg, plan, rank, groups, mesh, run_dir=run_dir, events=events, base_store=store,
                           key=key, faults=TestFaults.from_environ(environ), out=out or sys.stdout,
                           extra_event={"spare": sid, "spare_node": assignment.spare_node})
            entry(job)
        except TookPlace as done:
            return True, (f"took rank {rank}'s place at update {plan.frontier} (certified in "
                          f"{done.outcome.seconds.get('total', 0.0):.3f} s); going on with the loop after a heal "
                          f"is not wired yet")
        except HealError as exc:
            log.error("rank %d: the heal failed: %s", rank, exc)
            events.emit("heal_failed", dead_node=plan.dead_node, generation=plan.generation,
                        frontier=plan.frontier, error=f"{type(exc).__name__}: {exc}")
            return False, f"the heal of rank {rank} failed: {exc}"
        return False, f"the entry point {cfg.entry} returned without calling job.protect"
    finally:
        events.close()
