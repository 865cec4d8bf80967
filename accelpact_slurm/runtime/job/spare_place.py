"""A spare process takes a dead rank's place: the identity switch, the heal's groups and mesh, its runtime, and the
user's script from ``job.protect`` on as that rank.

Who calls: :func:`accelpact_slurm.runtime.job.spare.run_spare`, once the spare's node was handed an
:class:`~accelpact_slurm.core.spares.Assignment` (the spare process of local rank ``l`` takes
``assignment.ranks[l]``).  In order:

1. **Identity switch** (:func:`become`): the process becomes rank ``r`` of the dead node: the emulated task
   environment of rank ``r`` (``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``...,
   the dead node's host name: its node-local snapshot directory and daemon), its log records labelled ``[rank
   r]``, its events carry ``rank`` ``r`` and ``node`` the dead node's.  Its log file stays the spare's own (the launcher opened it).
2. **Stand-in world, runtime and groups**: a stand-in default group as rank ``r`` of the job's world
   (:func:`~accelpact_slurm.repair.heal.init_spare_world`); the heal's replication and shard groups of the
   assignment's generation over the job's store, and the spare's (replicate, shard) mesh over them; the control
   plane at that generation (where the survivors move once healed); its heartbeat and fault detector (before the
   transfer: the survivors see it alive when they next wait on it).
3. **The user's script** (the job's entry point) through the rank's usual path
   (:func:`~accelpact_slurm.runtime.job.entry.train`): its ``mesh`` and ``groups`` are the heal's, so the script
   wraps its model exactly as the dead rank did, and ``job.protect`` heals instead of reloading
   (:class:`~accelpact_slurm.runtime.job.heal_run.SpareResume`: the shard received in place from the live replica,
   the dead rank's per-rank packet applied, the certificate checked); the loop then goes on as rank ``r`` to the
   job's end (the final digest, the job's last rounds) or its stop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any, Callable, Mapping, MutableMapping, TextIO

from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.errors import EXIT_REQUEUE, FailStop, HealError, Stopped
from accelpact_slurm.core.events import EVENTS_FILE, EventLog
from accelpact_slurm.core.faults import TestFaults
from accelpact_slurm.core.script import is_script_entry
from accelpact_slurm.core.spares import Assignment, spare_hostname
from accelpact_slurm.repair import heal
from accelpact_slurm.repair.torch_compat import set_group_timeout
from accelpact_slurm.runtime.detection.wiring import start_detector
from accelpact_slurm.runtime.job import script as script_mode
from accelpact_slurm.runtime.job.entry import label_log_records, resolve_entry, train
from accelpact_slurm.runtime.job.heal_run import SpareResume
from accelpact_slurm.runtime.job.stopping import exit_stopped
from accelpact_slurm.runtime.job.topology import Layout, Runtime
from accelpact_slurm.runtime.transport.control import ControlPlane
from accelpact_slurm.slurm.env import SlurmContext, emulated_environ

log = logging.getLogger(__name__)


def become(rank: int, plan: heal.HealPlan, *, job_id: str, restart: int,
           environ: MutableMapping[str, str] | None = None) -> SlurmContext:
    """The identity switch of the process environment and its log records: this process is now ``rank`` (the
    emulated task environment of that rank, the dead node's host name included); returns its task context."""
    env = os.environ if environ is None else environ
    env.update(emulated_environ(job_id, rank, plan.nodes, plan.ranks_per_node, restart_count=restart))
    env.update({"RANK": str(rank), "LOCAL_RANK": str(plan.local_of(rank)),
                "WORLD_SIZE": str(plan.world_size), "LOCAL_WORLD_SIZE": str(plan.ranks_per_node)})
    label_log_records(rank, env)
    return SlurmContext.from_environ(env)


def take_place(assignment: Assignment, cfg: JobConfig, *, store: Any, connect: Callable[[float], Any], key: bytes,
               run_dir: str, job_file: str | None, job_id: str, restart: int, local_rank: int, sid: int,
               out: TextIO | None = None, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """This spare process takes ``assignment.ranks[local_rank]`` (see the module) and trains as that rank to the
    job's end: ``(0, why)``.  A stop (a failed heal included) ends the process with the stop's exit code, as a
    rank's would (the launcher supervises it in the dead rank's place).  ``store``: this process's client of the
    job's store; ``connect(timeout_s)``: another one (the control plane and the heartbeat each have their own)."""
    nodes, rpn = cfg.topology.nodes, cfg.topology.ranks_per_node
    rank = assignment.ranks[local_rank]
    plan = heal.HealPlan(nodes, rpn, assignment.dead_node, assignment.generation, assignment.frontier)
    # the node's name stays the dead node's: its node-local snapshot directory and daemon (the launcher starts a
    # lost node's daemon again), its place in the snapshot rules (verified on every node, the shared-tier rotation)
    ctx = become(rank, plan, job_id=job_id, restart=restart)
    out = out or sys.stdout
    events = EventLog(os.path.join(run_dir, EVENTS_FILE), job_id=job_id, restart=restart, rank=rank,
                      node=plan.dead_node)
    events.emit("process", role="rank", pid=os.getpid(), hostname=spare_hostname(assignment.spare_node), spare=sid,
                spare_node=assignment.spare_node, local_rank=plan.local_of(rank), healed=True)
    # a test's node kill points up to the update being redone fired on the node this spare replaces, not here
    faults = TestFaults.from_environ(environ)
    faults = dataclasses.replace(faults, kill_node=tuple(k for k in faults.kill_node if k[1] > plan.frontier + 1))
    wall0 = time.monotonic()
    try:
        spec = script_mode.spec_of(job_file)
        entry = script_mode.program(cfg.entry, job_file, spec) if is_script_entry(cfg.entry) else \
            resolve_entry(cfg.entry, job_file)
        heal.init_spare_world(rank, plan.world_size)
        groups = heal.build_heal_groups(plan, rank, store, cfg.timeouts.control_s)
        rt = spare_runtime(cfg, ctx, plan, groups, store=store, connect=connect)
    except (HealError, FailStop) as exc:
        log.error("rank %d: the heal failed: %s", rank, exc)
        events.emit("heal_failed", dead_node=plan.dead_node, generation=plan.generation, frontier=plan.frontier,
                    error=f"{type(exc).__name__}: {exc}")
        events.close()
        return EXIT_REQUEUE, f"the heal of rank {rank} failed: {exc}"
    resume = SpareResume(plan, groups, store=store, key=key, timeout_s=cfg.timeouts.control_s, faults=faults,
                         out=out, extra_event={"spare": sid, "spare_node": assignment.spare_node})
    try:
        code = train(cfg, ctx, rt, run_dir, events, out, os.environ if environ is None else environ, entry, faults,
                     wall0, resume=resume, spec=spec)
    except Stopped as stop:
        exit_stopped(stop)
    return code, f"took rank {rank}'s place at update {plan.frontier} and trained to the job's end"


def spare_runtime(cfg: JobConfig, ctx: SlurmContext, plan: heal.HealPlan, groups: heal.HealGroups, *, store: Any,
                  connect: Callable[[float], Any]) -> Runtime:
    """The runtime of a spare in rank ``ctx.rank``'s place: the heal's groups and mesh, the control plane at the
    heal's generation, its heartbeat and detector (the pid exchange among the spare node's ranks only)."""
    rank = ctx.rank
    layout = Layout(plan.nodes, plan.ranks_per_node)
    control = ControlPlane(connect(max(cfg.timeouts.control_s, 1.0)), rank, layout.world_size,
                           cfg.timeouts.control_s, generation=plan.generation)
    if getattr(store, "standby", None) is not None or getattr(store, "failed_over", False):
        control.standby_rank = plan.ranks_per_node  # node 1's first rank hosts the store's standby
    rt = Runtime(ctx=ctx, layout=layout, rank=rank, node=plan.dead_node, local_rank=plan.local_of(rank),
                 data_store=store, control=control, shard_group=groups.shard, replicate_group=groups.replicate,
                 mesh=heal.spare_mesh(plan, groups), collective_timeout_s=cfg.timeouts.collective_s,
                 store_client=lambda timeout: connect(timeout.total_seconds()))
    for g in (groups.shard, groups.replicate):
        set_group_timeout(g, cfg.timeouts.collective_s)
    rt.detector = start_detector(rt, cfg.timeouts, pid_ranks=plan.dead_ranks())
    return rt
