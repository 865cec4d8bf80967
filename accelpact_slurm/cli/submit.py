"""``accelpact-submit CONFIG`` or ``accelpact-submit [flags] SCRIPT.py [args]``: submit the job through submitit, on Slurm or on submitit's local executor.

One submitit task per rank (``nodes x ranks_per_node``, defaults from the job file's topology, else 2 x 2); each
task joins as its rank exactly as the sbatch template's ranks do (the launch core), with ``accelpact-run``'s job
flags.  Both of ``accelpact-run``'s forms: a job file, or a training script with its own arguments after its path
(the torchrun form: every rank runs it as __main__ with them as sys.argv; no job file needed, the effective one
is written to RUN_DIR/script-job.yaml).  Slurm is used when ``sbatch`` is on the PATH, else submitit's local
executor with an emulated Slurm environment; ``--slurm`` or ``--local`` forces one.
``--gpus-per-node`` equal to the ranks per node makes it a GPU job, one GPU per rank.  With
``--wait`` the command waits (with a deadline) and prints the summary's ``final_state_digest``.  The mapping of
submitit's Checkpointable requeue onto the snapshot-then-requeue path is in :mod:`accelpact_slurm.launch.submission`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from typing import Callable, Sequence

from accelpact_slurm.cli.run import default_run_dir
from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig, with_overrides
from accelpact_slurm.launch.core import add_job_flags, check_same_training, job_config, worker_args
from accelpact_slurm.core.errors import EXIT_CODES, EXIT_OK, EXIT_USAGE, AccelpactError, ConfigError, LaunchError
from accelpact_slurm.core.events import SUMMARY_FILE, parse_json, read_file
from accelpact_slurm.core.script import ScriptSpec
from accelpact_slurm.core.spares import check_spares_started
from accelpact_slurm.launch import script as script_form
from accelpact_slurm.launch.local import free_port_pair

log = logging.getLogger("accelpact_slurm.cli.submit")

PROG = "accelpact-submit"
#: Exit code when the job failed, ended without completing, or the wait's deadline passed.
EXIT_NOT_COMPLETED = 1
EPILOG = ("exit codes:\n  " + f"{EXIT_OK:>3}  submitted (with --wait: completed)\n  "
          f"{EXIT_NOT_COMPLETED:>3}  with --wait: failed, stopped without completing, or still running at the "
          f"deadline\n  {EXIT_USAGE:>3}  {EXIT_CODES[EXIT_USAGE]}\n\n"
          "documentation: docs/launch.md#which-command-does-what, docs/launch.md#what-an-exit-means")


class SubmitUsageError(AccelpactError, ValueError):
    """A submission that cannot be made as asked (e.g. --slurm without Slurm)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=" ".join(__doc__.split("\n\n")[1].split()),
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_flags(p)  # the same job-level flags as accelpact-run
    p.add_argument("--nodes", type=_positive, metavar="N", help="nodes (default: the file's topology.nodes)")
    p.add_argument("--ranks-per-node", type=_positive, metavar="R",
                   help="ranks (tasks) per node (default: the file's topology.ranks_per_node)")
    return _where_flags(p)


def build_script_parser() -> argparse.ArgumentParser:
    """The torchrun form's parser: ``accelpact-run``'s (:mod:`accelpact_slurm.launch.script`), where to submit."""
    p = script_form.build_parser(
        prog=PROG, description=" ".join(__doc__.split("\n\n")[1].split()),
        epilog=f"the job-file form: {PROG} JOB.yaml [job flags] ({PROG} JOB.yaml --help); both forms: "
               f"docs/launch.md#two-ways-to-start-a-job\n\n" + EPILOG,
        nodes="nodes (Slurm's, or emulated ones on the local executor)")
    p.add_argument("--nodes", dest="nnodes", metavar="N", help="the same as --nnodes")
    p.add_argument("--ranks-per-node", dest="nproc_per_node", metavar="R", help="the same as --nproc-per-node")
    return _where_flags(p)


def _where_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Where and how to submit: the same in both forms."""
    p.add_argument("--gpus-per-node", type=_non_negative, default=0, metavar="G",
                   help="GPUs per node (default: %(default)s, a CPU job). One GPU per rank: G must equal the ranks "
                        "per node; every rank sees its node's G GPUs and takes cuda:LOCAL_RANK (topology.device "
                        "auto or cuda). On the local executor every emulated node is this machine: it gives "
                        "nodes x G GPUs, one per rank")
    p.add_argument("--cpus-per-task", type=_positive, metavar="C",
                   help="CPUs per rank, each rank bound to its cores (Slurm only; default: the cluster's); set "
                        "topology.threads_per_rank to match")
    p.add_argument("--partition", metavar="P", help="Slurm partition (default: the cluster's)")
    p.add_argument("--time-min", type=_positive, default=60, metavar="M",
                   help="time limit in minutes (default: %(default)s); USR2 comes before it and the job "
                        "snapshots and requeues")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", dest="backend", action="store_const", const="local",
                       help="submitit's local executor on this machine, emulated Slurm environment")
    where.add_argument("--slurm", dest="backend", action="store_const", const="slurm",
                       help="Slurm (an error when sbatch is not on the PATH)")
    p.add_argument("--folder", metavar="DIR",
                   help="submitit's folder for pickles and task logs (default: RUN_DIR/submitit, or "
                        "RUNS_ROOT/submitit/<job id>)")
    p.add_argument("--wait", action="store_true", help="wait until the job ends and print its final_state_digest")
    p.add_argument("--wait-timeout", type=_positive, metavar="S",
                   help="with --wait: give up waiting after S seconds (default: time limit + 600)")
    return p


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be at least {low}")
        return value
    return parse


_positive, _non_negative = _at_least(1), _at_least(0)


def check_gpus(gpus_per_node: int, cfg: JobConfig) -> None:
    """One GPU per rank: ``--gpus-per-node`` is 0 (a CPU job) or the job's ranks per node.

    Raises:
        SubmitUsageError: Any other count, with the fix.
    """
    rpn = cfg.topology.ranks_per_node
    if gpus_per_node and gpus_per_node != rpn:
        raise SubmitUsageError(
            f"--gpus-per-node {gpus_per_node}: the job runs {rpn} ranks per node (--ranks-per-node, else the file's "
            f"topology.ranks_per_node) and each rank drives one GPU: give --gpus-per-node {rpn}, or "
            f"--ranks-per-node {gpus_per_node} to use every GPU")


def detect_backend(forced: str | None, which: Callable[[str], str | None] = shutil.which) -> tuple[str, str]:
    """``(backend, why)``: Slurm when ``sbatch`` is on the PATH, else the local executor; ``forced`` wins.

    Raises:
        SubmitUsageError: ``--slurm`` forced but no ``sbatch`` (nor ``srun``) on the PATH.
    """
    if forced == "local":
        return "local", "--local"
    found = which("sbatch")
    if forced == "slurm":
        if not found or not which("srun"):
            raise SubmitUsageError("--slurm: sbatch/srun not found on the PATH: run on a Slurm login node, or "
                                   "use --local for submitit's local executor")
        return "slurm", "--slurm"
    if found and which("srun"):
        return "slurm", f"sbatch found at {found}"
    return "local", "no sbatch on the PATH: submitit's local executor"


def effective_config(args: argparse.Namespace) -> JobConfig:
    cfg = job_config(args)
    overrides = {}
    if args.nodes is not None:
        overrides["topology.nodes"] = args.nodes
    if args.ranks_per_node is not None:
        overrides["topology.ranks_per_node"] = args.ranks_per_node
    cfg = with_overrides(cfg, overrides) if overrides else cfg
    check_spares_started(cfg.topology.spare_nodes, "accelpact-submit")  # refused before submitting
    return cfg


def make_executor(backend: str, folder: str, cfg: JobConfig, args: argparse.Namespace):
    import submitit

    ex = submitit.AutoExecutor(folder=folder, cluster=backend)
    nodes, rpn = cfg.topology.nodes, cfg.topology.ranks_per_node
    params = {"name": f"accelpact-{cfg.name}", "timeout_min": args.time_min}
    if backend == "slurm":
        params.update(nodes=nodes, tasks_per_node=rpn,
                      # --requeue: our rank 0's scontrol requeue (fail-stop 75, USR2) must be allowed
                      slurm_additional_parameters={"requeue": True})
        if args.partition:
            params["slurm_partition"] = args.partition
        # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): the step asks for it again.  Every
        # rank sees all of its node's GPUs (no per-task binding, whatever the site's default) and takes
        # cuda:LOCAL_RANK: NCCL keeps its direct GPU-to-GPU path between the ranks of a node.
        srun_args = ["--label"]  # every line of rank R starts "R: ", as under the sbatch template
        if args.cpus_per_task:
            params["cpus_per_task"] = args.cpus_per_task
            srun_args += [f"--cpus-per-task={args.cpus_per_task}", "--cpu-bind=cores"]
        if args.gpus_per_node:
            params["gpus_per_node"] = args.gpus_per_node
            srun_args.append("--gpu-bind=none")
        params["slurm_srun_args"] = srun_args
    else:  # submitit's local executor knows one node: every emulated node's ranks run here
        params.update(nodes=1, tasks_per_node=nodes * rpn)
        # CUDA_VISIBLE_DEVICES lists nodes x G GPUs (none when G is 0); the emulated rank r takes cuda:r.
        params["gpus_per_node"] = nodes * args.gpus_per_node
    ex.update_parameters(**params)
    return ex


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        script = script_form.script_mode(argv, build_parser(), build_script_parser())
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    args = None if script else build_parser().parse_args(argv)
    logging.basicConfig(level=settings.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec: ScriptSpec | None = None
        if args is None:  # the torchrun form: the effective job, as accelpact-run makes it (launch.script)
            args = script_form.parse(build_script_parser(), argv)
            cfg, spec = script_form.script_job(args)
            check_spares_started(cfg.topology.spare_nodes, PROG)  # refused before submitting
        else:
            cfg = effective_config(args)
        check_gpus(args.gpus_per_node, cfg)
        backend, why = detect_backend(args.backend)
        return submit_and_report(args, cfg, backend, why, script=spec)
    except AccelpactError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, (ConfigError, ValueError)) else EXIT_NOT_COMPLETED


def submit_and_report(args: argparse.Namespace, cfg: JobConfig, backend: str, why: str,
                      script: ScriptSpec | None = None) -> int:
    """Submit and, with ``--wait``, report.  ``script``: the torchrun form (its spec for the ranks): the effective
    job file is written into the run directory -- ``--run-dir``, else ``RUNS_ROOT/<script name>-<time>-<pid>``, as
    ``accelpact-run``'s -- before anything is submitted, and every task reads it (a requeue too)."""
    from accelpact_slurm.launch.submission import TaskSpec, submit_until_settled

    if args.partition and backend == "local":
        print(f"{PROG}: note: --partition applies to Slurm only; ignored on the local executor", file=sys.stderr)
    if args.cpus_per_task and backend == "local":
        print(f"{PROG}: note: --cpus-per-task applies to Slurm only; ignored on the local executor", file=sys.stderr)
    if getattr(args, "max_restarts", None) is not None and backend == "slurm":
        print(f"{PROG}: note: --max-restarts bounds the local executor's relaunches; on Slurm the cluster requeues "
              f"the job (bounded by recovery.max_stalled_restarts, the no-progress rule)", file=sys.stderr)
    for note in gpu_notes(args.gpus_per_node, cfg, backend):
        print(f"{PROG}: note: {note}", file=sys.stderr)
    runs_root = os.path.abspath(settings.runs_root())
    run_dir = os.path.abspath(args.run_dir) if args.run_dir else None
    if script is not None and run_dir is None:
        run_dir = os.path.abspath(default_run_dir(cfg, None))
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        check_same_training(cfg, run_dir, args.allow_config_change)  # refused before submitting, as by accelpact-run
    if script is not None and run_dir is not None:  # the file the tasks, the daemons and a requeue read
        config_path, task_args = script_form.write_job_file(cfg, run_dir), script_form.worker_args(args, script)
    else:
        config_path, task_args = os.path.abspath(args.config), worker_args(args)
    folder = os.path.abspath(args.folder) if args.folder else (
        os.path.join(run_dir, "submitit") if run_dir else os.path.join(runs_root, "submitit", "%j"))
    spec = TaskSpec(backend=backend, config_path=config_path, runs_root=runs_root,
                    run_dir=run_dir, nodes=cfg.topology.nodes, ranks_per_node=cfg.topology.ranks_per_node,
                    worker_args=tuple(task_args))
    executor = make_executor(backend, folder, cfg, args)
    deadline_s = args.wait_timeout or args.time_min * 60 + 600
    outcome, spec, job = submit_until_settled(lambda s: _submit(executor, s), spec, backend=backend, why=why,
                                              wait=args.wait, deadline_s=deadline_s,
                                              max_restarts=cfg.recovery.max_restarts)
    if outcome is None:
        return EXIT_OK
    if outcome.state == "completed":
        return report_completed(spec.run_dir, job.job_id)
    print(f"{PROG}: job {job.job_id} {outcome.state}: {outcome.detail} (accelpact-status {spec.run_dir}; "
          f"logs {job.paths.folder})", file=sys.stderr)
    return EXIT_NOT_COMPLETED


def gpu_notes(gpus_per_node: int, cfg: JobConfig, backend: str) -> list[str]:
    """What the job file's ``topology.device`` makes of the GPUs asked for, when it is not what was meant (pure)."""
    device, rpn = cfg.topology.device, cfg.topology.ranks_per_node
    if gpus_per_node and device == "cpu":
        return [f"--gpus-per-node {gpus_per_node} with topology.device: cpu: the ranks train on the CPU and the GPUs "
                f"stay idle (set topology.device: auto or cuda)"]
    if not gpus_per_node and device == "cuda":
        what = ("the local executor hides every GPU, so the ranks stop" if backend == "local"
                else "unless the cluster gives GPUs by default, the ranks see none and stop")
        return [f"topology.device: cuda without --gpus-per-node: {what} with a configuration error; pass "
                f"--gpus-per-node {rpn}"]
    return []


def _submit(executor, spec):
    """``executor.submit`` with submitit's and sbatch's failures as one-line errors."""
    from submitit.core.utils import FailedSubmissionError

    try:
        return executor.submit(_task(spec))
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.output or b"")
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
        raise LaunchError(f"submission failed ({' '.join(map(str, exc.cmd))} exited {exc.returncode}): "
                          f"{' '.join(detail.split()) or 'no output'}") from exc
    except (FailedSubmissionError, OSError) as exc:
        raise LaunchError(f"submission failed: {' '.join(str(exc).split())}") from exc


def _task(spec):
    """The task for one launch; fresh rendezvous ports on the local executor (the last ones may linger)."""
    from accelpact_slurm.launch.submission import RankTask

    if spec.backend == "local":
        data_port, control_port = free_port_pair()
        spec = dataclasses.replace(spec, master_port=data_port, control_port=control_port)
    return RankTask(spec)


def report_completed(run_dir: str, job_id: str) -> int:

    path = os.path.join(run_dir, SUMMARY_FILE)
    try:  # bounded, a regular file only, never through a link (core.safeopen)
        summary = parse_json(read_file(path))
    except (OSError, ValueError) as exc:
        print(f"{PROG}: job {job_id}: every task finished but {path} is unreadable ({exc})", file=sys.stderr)
        return EXIT_NOT_COMPLETED
    print(f"[accelpact] job {job_id} completed: {summary.get('final_step')} updates, final loss "
          f"{summary.get('final_loss')}\n"
          f"[accelpact] final_state_digest {summary.get('final_state_digest')}\n"
          f"[accelpact] summary: {path}", flush=True)
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
