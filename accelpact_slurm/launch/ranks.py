"""What every launcher gives a rank and a daemon: one place for the emulated task environment and the daemon command.

Who calls: the embedded default (:mod:`.local`), submitit's local executor (:mod:`.submission`) and the
daemons' start (:mod:`.daemons`); the benchmarks reach them through :func:`.local.launch_local`.
"""

from __future__ import annotations

import sys
from typing import Mapping, Sequence

from accelpact_slurm.core import settings
from accelpact_slurm.slurm.env import emulated_environ

#: The worker entry every rank runs (``python -m``): the embedded default's ranks and the sbatch template's.
WORKER_MODULE = "accelpact_slurm.cli.worker"


def rank_environ(base: Mapping[str, str], job_id: str, rank: int, nodes: int, ranks_per_node: int, *,
                 restart: int, data_port: int, control_port: int) -> dict[str, str]:
    """``base`` without an enclosing allocation's ``SLURM_*``, plus the emulated step of ``rank`` (pure).

    The launcher, not Slurm, relaunches such a job (``ACCELPACT_EMULATED``): a fail-stop leaves the
    requeue to it instead of calling ``scontrol``.
    """
    env = spare_environ(base, data_port=data_port, control_port=control_port)
    env.update(emulated_environ(job_id, rank, nodes, ranks_per_node, restart_count=restart))
    return env


def spare_environ(base: Mapping[str, str], *, data_port: int, control_port: int) -> dict[str, str]:
    """``base`` without an enclosing allocation's ``SLURM_*``, plus the emulated job's rendezvous (pure): what a
    spare process of the embedded default sees (no task of the training step: its place comes as arguments,
    :func:`spare_args`), and what :func:`rank_environ` adds a rank's emulated step to."""
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
    env.update({
        settings.EMULATED: "1",
        settings.MASTER_ADDR: "127.0.0.1",
        settings.MASTER_PORT: str(data_port),
        settings.CONTROL_PORT: str(control_port),
        "PYTHONUNBUFFERED": "1",
    })
    return env


#: The entry every spare process runs (``python -m``): :mod:`accelpact_slurm.cli.spare`.
SPARE_MODULE = "accelpact_slurm.cli.spare"


def spare_args(config_path: str, run_dir: str, job_args: Sequence[str], *, job_id: str, step: str, restart: int,
               node: int, local_rank: int, hostname: str) -> list[str]:
    """The arguments of one spare process (after ``python -m`` :data:`SPARE_MODULE`): the job's own flags, and
    where it sits (pure).  ``step``: the training step's id (the job's store is bound to the job, its step and its
    start: :func:`accelpact_slurm.runtime.transport.store.binding`)."""
    return [config_path, "--run-dir", run_dir, *job_args, "--job-id", job_id, "--step", step, "--restart",
            str(restart), "--node", str(node), "--local-rank", str(local_rank), "--hostname", hostname]


def daemon_command(config_path: str, run_dir: str, node: str, node_index: int, job_id: str, *, restart: int,
                   drain_s: float, num_nodes: int | None = None, every_steps: int | None = None,
                   keep_serving_on_sigterm: bool = False) -> list[str]:
    """The command line of one node's ``accelpact-ckptd``, on every path (the template's through
    :func:`.core.serve_node`).

    ``num_nodes`` and ``every_steps`` (with ``node_index``) decide which node uploads which snapshot to the
    shared tier; left out, the daemon takes them from Slurm's environment and the job file.
    ``keep_serving_on_sigterm``: under Slurm, where a preemption's SIGTERM reaches the daemon too.
    """
    cmd = [sys.executable, "-m", "accelpact_slurm.cli.ckptd", config_path, "--run-dir", run_dir, "--node", node,
           "--node-index", str(node_index), "--job-id", job_id, "--drain-s", str(drain_s), "--restart", str(restart)]
    if num_nodes is not None:
        cmd += ["--num-nodes", str(num_nodes)]
    if every_steps is not None:
        cmd += ["--every-steps", str(every_steps)]
    if keep_serving_on_sigterm:
        cmd += ["--keep-serving-on-sigterm"]
    return cmd
