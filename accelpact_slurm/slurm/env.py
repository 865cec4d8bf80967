"""What Slurm tells one task about its job step, parsed and cross-checked.

Called once per rank at start-up, by the training entry point and by the local launcher (which builds the same
variables with :func:`emulated_environ`).  Every function takes the environment as an argument and never reads
``os.environ``, so tests can feed recorded task environments and the launcher can emulate one.

Step-level variables win over job-level ones, because a step may use only part of the allocation:
``SLURM_STEP_NODELIST`` over ``SLURM_JOB_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE`` over ``SLURM_TASKS_PER_NODE`` and
so on.  The values are then checked against each other; a mismatch raises
:class:`~accelpact_slurm.core.errors.SlurmEnvError` naming the variables, their values and the fix, instead of hanging
later in a rendezvous that never fills.

This module must not import torch: login-node tools use it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

from accelpact_slurm.core.errors import SlurmEnvError
from accelpact_slurm.slurm.hostlist import (
    compress_hostlist,
    expand_hostlist,
    format_tasks_per_node,
    parse_tasks_per_node,
)

log = logging.getLogger(__name__)

# Candidate variables for each value, most specific first.
JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_JOBID")
NUM_NODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
WORLD_SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")

_IN_STEP_FIX = "run one task per rank with srun"
_NOT_IN_JOB_FIX = "run inside a Slurm allocation (sbatch or salloc), or use the local launcher"

_UINT = re.compile(r"\d+")


def in_slurm(environ: Mapping[str, str]) -> bool:
    """Tells whether ``environ`` is that of a task inside a Slurm job step.

    True only when ``SLURM_JOB_ID``, ``SLURM_PROCID`` and a step id (``SLURM_STEP_ID`` or ``SLURM_STEPID``) are all
    set and not empty.  The batch shell of an ``sbatch`` job has ``SLURM_PROCID=0`` too (recorded on Slurm 22.05) but
    no step id: it must launch the ranks with ``srun`` rather than train itself.

    Args:
        environ: The environment to inspect, e.g. ``os.environ``.
    """
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    return bool(environ.get("SLURM_JOB_ID")) and bool(environ.get("SLURM_PROCID")) and bool(step)


@dataclass(frozen=True, kw_only=True)
class SlurmContext:
    """One task's place in its Slurm job step.

    Built by :meth:`from_environ` on every rank at start-up; immutable, and checked for consistency when built.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        rank: Global rank, ``SLURM_PROCID``.
        local_rank: Rank on this node, ``SLURM_LOCALID``.
        node_index: Index of this node in the step, ``SLURM_NODEID``.
        num_nodes: Nodes in the step (``SLURM_STEP_NUM_NODES``, ``SLURM_JOB_NUM_NODES`` or ``SLURM_NNODES``).
        world_size: Tasks in the step (``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``).
        tasks_per_node: Task count of each node, in node order.
        nodelist: Expanded hostnames of the step, in node order.
        hostname: This node's Slurm name, ``SLURMD_NODENAME`` (falls back to ``nodelist[node_index]``).
        restart_count: ``SLURM_RESTART_COUNT``; 0 before the first requeue.
        step_id: ``SLURM_STEP_ID``, if set.
        job_name: ``SLURM_JOB_NAME``, if set.
        array_job_id: ``SLURM_ARRAY_JOB_ID``, for array jobs.
        array_task_id: ``SLURM_ARRAY_TASK_ID``, for array jobs.
    """

    job_id: str
    rank: int
    local_rank: int
    node_index: int
    num_nodes: int
    world_size: int
    tasks_per_node: tuple[int, ...]
    nodelist: tuple[str, ...]
    hostname: str
    restart_count: int = 0
    step_id: str | None = None
    job_name: str | None = None
    array_job_id: str | None = None
    array_task_id: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks_per_node", tuple(self.tasks_per_node))
        object.__setattr__(self, "nodelist", tuple(self.nodelist))
        _check_consistency(self, _DEFAULT_SOURCES)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SlurmContext:
        """Parses and cross-checks the environment of one srun task.

        Args:
            environ: The task's environment (``os.environ`` in production, a
                recorded or emulated dict in tests and the local launcher).

        Raises:
            SlurmEnvError: If a required variable is missing or malformed, or
                the values disagree; the message names variable, value and fix.
        """
        sources: dict[str, str] = {}
        job_id_var, job_id = _require(environ, JOB_ID_VARS)
        rank = _require_int(environ, ("SLURM_PROCID",))[1]
        _require(environ, ("SLURM_STEP_ID", "SLURM_STEPID"))  # the batch shell has a PROCID but no step
        local_rank = _require_int(environ, ("SLURM_LOCALID",))[1]
        node_index = _require_int(environ, ("SLURM_NODEID",))[1]
        sources["num_nodes"], num_nodes = _require_int(environ, NUM_NODES_VARS)
        sources["world_size"], world_size = _require_int(environ, WORLD_SIZE_VARS)
        tpn_var, tpn_value = _require(environ, TASKS_PER_NODE_VARS)
        sources["tasks_per_node"] = tpn_var
        tasks_per_node = parse_tasks_per_node(tpn_value, tpn_var)
        sources["nodelist"], nodelist_value = _require(environ, NODELIST_VARS)
        nodelist = tuple(expand_hostlist(nodelist_value))
        restart_count = _optional_int(environ, "SLURM_RESTART_COUNT") or 0
        array_task_id = _optional_int(environ, "SLURM_ARRAY_TASK_ID")
        values: dict[str, Any] = dict(
            job_id=job_id, rank=rank, local_rank=local_rank, node_index=node_index,
            num_nodes=num_nodes, world_size=world_size, tasks_per_node=tasks_per_node,
            nodelist=nodelist, restart_count=restart_count,
            step_id=environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or None,
            job_name=environ.get("SLURM_JOB_NAME") or None,
            array_job_id=environ.get("SLURM_ARRAY_JOB_ID") or None,
            array_task_id=array_task_id,
        )
        # Check with the variables actually read, so the message names them.
        _check_consistency(SimpleNamespace(**values), {**_DEFAULT_SOURCES, **sources})
        hostname = environ.get("SLURMD_NODENAME") or nodelist[node_index]
        if hostname != nodelist[node_index]:
            # Front-end or multi-homed nodes may name themselves differently;
            # the node list stays the authority for rendezvous.
            log.warning(
                "SLURMD_NODENAME=%r differs from %s[%d]=%r",
                hostname, sources["nodelist"], node_index, nodelist[node_index],
            )
        log.debug("Slurm context from %s=%s: %s", job_id_var, job_id, values)
        return cls(hostname=hostname, **values)

    @property
    def rendezvous_host(self) -> str:
        """The first node of the step: where rank 0 runs the rendezvous store."""
        return self.nodelist[0]

    @property
    def ranks_per_node(self) -> int:
        """The task count shared by every node.

        Raises:
            SlurmEnvError: If nodes run different numbers of tasks; HSDP needs shard groups of equal size.
        """
        counts = set(self.tasks_per_node)
        if len(counts) != 1:
            raise SlurmEnvError(
                f"SLURM_TASKS_PER_NODE={format_tasks_per_node(self.tasks_per_node)!r} "
                "is uneven: HSDP needs the same number of ranks on every node; "
                "launch with --ntasks-per-node=R and --nodes=N"
            )
        return counts.pop()


def emulated_environ(
    job_id: str,
    rank: int,
    nodes: int,
    ranks_per_node: int,
    restart_count: int = 0,
    hostnames: Sequence[str] | None = None,
) -> dict[str, str]:
    """The Slurm variables ``rank`` would see under ``srun --nodes=N --ntasks-per-node=R`` (to merge over the
    launcher's environment): how the local launchers emulate Slurm on one machine.

    Tasks are placed in blocks, as srun's default distribution does: rank ``r`` runs on node ``r // ranks_per_node``
    with local rank ``r % ranks_per_node``; ``hostnames`` default to ``node1`` .. ``nodeN``.  ``SLURM_RESTART_COUNT``
    is set only when ``restart_count > 0``, as Slurm sets it only after a requeue.  Raises ``SlurmEnvError`` when the
    arguments cannot describe a step.
    """
    if nodes < 1 or ranks_per_node < 1:
        raise SlurmEnvError(
            f"emulated step needs nodes >= 1 and ranks_per_node >= 1, got "
            f"nodes={nodes}, ranks_per_node={ranks_per_node}"
        )
    world_size = nodes * ranks_per_node
    if not 0 <= rank < world_size:
        raise SlurmEnvError(f"emulated rank {rank} is outside 0..{world_size - 1}")
    if restart_count < 0:
        raise SlurmEnvError(f"emulated restart_count {restart_count} is negative")
    names = [f"node{i}" for i in range(1, nodes + 1)] if hostnames is None else list(hostnames)
    if len(names) != nodes or len(set(names)) != nodes:
        raise SlurmEnvError(
            f"emulated hostnames {names!r} must be {nodes} distinct names, one per node"
        )
    node_index, local_rank = divmod(rank, ranks_per_node)
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_rank),
           "SLURM_NODEID": str(node_index), "SLURMD_NODENAME": names[node_index],
           "SLURM_NTASKS_PER_NODE": str(ranks_per_node)}
    # Job, legacy and step spellings agree: a step over the whole allocation.
    for keys, value in (
        (JOB_ID_VARS, str(job_id)),
        (NUM_NODES_VARS, str(nodes)),
        (WORLD_SIZE_VARS, str(world_size)),
        (TASKS_PER_NODE_VARS, format_tasks_per_node([ranks_per_node] * nodes)),
        (NODELIST_VARS, compress_hostlist(names)),
    ):
        env.update(dict.fromkeys(keys, value))
    if restart_count > 0:
        env["SLURM_RESTART_COUNT"] = str(restart_count)
    return env


# --------------------------------------------------------------------------- helpers

_DEFAULT_SOURCES = {
    "num_nodes": "SLURM_JOB_NUM_NODES",
    "world_size": "SLURM_NTASKS",
    "tasks_per_node": "SLURM_TASKS_PER_NODE",
    "nodelist": "SLURM_JOB_NODELIST",
}


def _check_consistency(ctx, sources: Mapping[str, str]) -> None:
    """Raises SlurmEnvError on the first disagreement between the values.

    ``sources`` maps a value to the variable it was read from, for the message.
    """
    nn, ws = sources["num_nodes"], sources["world_size"]
    tpn, nl = sources["tasks_per_node"], sources["nodelist"]
    tpn_text = format_tasks_per_node(ctx.tasks_per_node)
    same_step = "launch the step with srun so both describe the same step"
    if ctx.num_nodes < 1:
        raise SlurmEnvError(f"{nn}={ctx.num_nodes} must be at least 1: request --nodes=N")
    if ctx.world_size < 1:
        raise SlurmEnvError(f"{ws}={ctx.world_size} must be at least 1: request --ntasks-per-node=R")
    if len(ctx.tasks_per_node) != ctx.num_nodes:
        raise SlurmEnvError(
            f"{tpn}={tpn_text!r} describes {len(ctx.tasks_per_node)} nodes but "
            f"{nn}={ctx.num_nodes}: {same_step}"
        )
    if sum(ctx.tasks_per_node) != ctx.world_size:
        raise SlurmEnvError(
            f"{tpn}={tpn_text!r} sums to {sum(ctx.tasks_per_node)} tasks but "
            f"{ws}={ctx.world_size}: {same_step}"
        )
    if len(ctx.nodelist) != ctx.num_nodes:
        raise SlurmEnvError(
            f"{nl}={_shown_hostlist(ctx.nodelist)!r} names {len(ctx.nodelist)} nodes but "
            f"{nn}={ctx.num_nodes}: {same_step}"
        )
    if not 0 <= ctx.rank < ctx.world_size:
        raise SlurmEnvError(
            f"SLURM_PROCID={ctx.rank} is not below {ws}={ctx.world_size}: "
            "run one task per rank with srun"
        )
    if not 0 <= ctx.node_index < ctx.num_nodes:
        raise SlurmEnvError(
            f"SLURM_NODEID={ctx.node_index} is not below {nn}={ctx.num_nodes}: "
            "run one task per rank with srun"
        )
    if not 0 <= ctx.local_rank < ctx.tasks_per_node[ctx.node_index]:
        raise SlurmEnvError(
            f"SLURM_LOCALID={ctx.local_rank} is not below the "
            f"{ctx.tasks_per_node[ctx.node_index]} tasks of node {ctx.node_index} in "
            f"{tpn}={tpn_text!r}: run one task per rank with srun"
        )
    if ctx.restart_count < 0:
        raise SlurmEnvError(f"SLURM_RESTART_COUNT={ctx.restart_count} must not be negative")


def _shown_hostlist(hosts: Sequence[str]) -> str:
    """Compressed hosts for a message; never raises while reporting another error."""
    try:
        return compress_hostlist(hosts)
    except SlurmEnvError:
        return ",".join(map(str, hosts))


def _require(environ: Mapping[str, str], names: Sequence[str]) -> tuple[str, str]:
    """Returns (name, value) of the first set, non-empty variable of ``names``."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    others = f" (nor {', '.join(names[1:])})" if len(names) > 1 else ""
    fix = _NOT_IN_JOB_FIX if names is JOB_ID_VARS else _IN_STEP_FIX
    raise SlurmEnvError(f"{names[0]} is not set{others}: {fix}")


def _require_int(environ: Mapping[str, str], names: Sequence[str]) -> tuple[str, int]:
    name, value = _require(environ, names)
    return name, _to_int(name, value)


def _optional_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    return _to_int(name, value) if value else None


def _to_int(name: str, value: str) -> int:
    if not _UINT.fullmatch(value):
        raise SlurmEnvError(
            f"{name}={value!r} is not a non-negative integer: "
            "let Slurm set it, do not export it by hand"
        )
    return int(value)
