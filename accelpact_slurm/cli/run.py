"""``accelpact-run CONFIG`` or ``accelpact-run [flags] SCRIPT.py [args]``: run a training job on this machine (the embedded default).

Two forms.  ``accelpact-run [--nnodes N] [--nproc-per-node P] ... train.py --its --args``, a torchrun drop-in: every
rank runs the script as __main__ with its own arguments and torchrun's variables, and the script gets its Job
from init(steps=..., seed=...) of the package; torchrun's flags mean what they mean there, those this launcher
cannot honour are refused in one line; a job file is optional (--config).  ``accelpact-run JOB.yaml``: every rank
calls the job file's ``entry: module:function`` with its Job (the public API, docs/api.md).  Either way the
command launches the job itself: nodes x ranks per node local processes (``python -m
accelpact_slurm.cli.worker``, the same worker entry the sbatch template's ranks run) with an emulated Slurm
environment, and relaunches it in place where Slurm would requeue it.  On Slurm, submit
sbatch_templates/hsdp.sbatch or use accelpact-submit; both take the torchrun form too
(docs/launch.md#which-command-does-what).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from typing import Callable, Sequence

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.errors import EXIT_CODES, EXIT_USAGE, AccelpactError, ConfigError
from accelpact_slurm.launch import script as script_form
from accelpact_slurm.launch.core import (  # noqa: F401 - TRAINING_FILE, check_same_training: also this module's API
    TRAINING_FILE, add_job_flags, check_same_training, job_config, worker_args)
from accelpact_slurm.launch.local import job_id_for, run_local
from accelpact_slurm.launch.run_lock import claim
from accelpact_slurm.runtime.job.rundir import check_run_dir
from accelpact_slurm.slurm.env import in_slurm

log = logging.getLogger("accelpact_slurm.cli.run")

EPILOG = "exit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in sorted(EXIT_CODES.items()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="accelpact-run",
        description=__doc__.split("\n\n")[0] + ". " + " ".join(__doc__.split("\n\n")[1].split()),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return add_job_flags(p)


def build_script_parser() -> argparse.ArgumentParser:
    """The torchrun form's parser (:mod:`accelpact_slurm.launch.script`); its ``--help`` is the command's."""
    return script_form.build_parser(
        description=" ".join(__doc__.split("\n\n")[1].split()),
        epilog="the job-file form: accelpact-run JOB.yaml [--run-dir DIR] [--entry MODULE:FUNCTION] [--steps N] "
               "[--seed N] [--spare-nodes K] [--inject-fault PHASE:STEP:RANK ...] (accelpact-run JOB.yaml --help); "
               "both forms: docs/launch.md#two-ways-to-start-a-job\n\n" + EPILOG)


def effective_config(args: argparse.Namespace) -> JobConfig:
    return job_config(args)


def default_run_dir(cfg: JobConfig, job_id: str | None) -> str:
    leaf = job_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return os.path.join(settings.runs_root(), leaf)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        script = script_form.script_mode(argv, build_parser(), build_script_parser())
    except ConfigError as exc:
        print(f"accelpact-run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if script:
        return _main_script(argv)
    args = build_parser().parse_args(argv)
    _logging()
    try:
        cfg = effective_config(args)
        return _launch(cfg, lambda _run_dir: os.path.abspath(args.config), args.run_dir, worker_args(args),
                       args.allow_config_change)
    except AccelpactError as exc:
        print(f"accelpact-run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, (ConfigError, ValueError)) else 1


def _main_script(argv: list[str]) -> int:
    """The torchrun form: ``accelpact-run [flags] SCRIPT.py [args]`` (:mod:`accelpact_slurm.launch.script`)."""
    parser = build_script_parser()
    try:
        args = script_form.parse(parser, argv)
        _logging()
        cfg, spec = script_form.script_job(args)
        return _launch(cfg, lambda run_dir: script_form.write_job_file(cfg, run_dir), args.run_dir,
                       script_form.worker_args(args, spec), args.allow_config_change)
    except AccelpactError as exc:
        print(f"accelpact-run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, (ConfigError, ValueError)) else 1


def _logging() -> None:
    logging.basicConfig(level=settings.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _launch(cfg: JobConfig, job_file: Callable[[str], str], run_dir: str | None, passthrough: list[str],
            allow_config_change: bool) -> int:
    """Both forms' launch: the checks, the run directory's lock and checks, then the embedded default's ranks.
    ``job_file(run_dir)``: the job file every rank and daemon reads (the script form writes it there)."""
    env = os.environ
    if in_slurm(env) or env.get("SLURM_JOB_ID"):
        raise ConfigError("SLURM_JOB_ID", env.get("SLURM_JOB_ID"),
                          "accelpact-run launches a job on this machine and is not a task of one: on Slurm, "
                          "submit sbatch_templates/hsdp.sbatch (its ranks run python -m "
                          "accelpact_slurm.cli.worker) or use accelpact-submit; both take the torchrun "
                          "form too: [flags] SCRIPT.py [its args]")
    run_dir = run_dir or default_run_dir(cfg, None)
    os.makedirs(run_dir, exist_ok=True)
    # one job per run directory: the launcher holds the lock across every relaunch, before any rank starts
    lock = claim(os.path.abspath(run_dir), job_id_for(env), hold=True)  # noqa: F841 - held until main returns
    check_same_training(cfg, run_dir, allow_config_change)
    check_run_dir(run_dir, cfg, socket.gethostname())  # before any rank or daemon starts
    config_path = job_file(run_dir)
    print(f"[accelpact] embedded default: {cfg.topology.nodes} emulated nodes x "
          f"{cfg.topology.ranks_per_node} ranks on this machine; run dir {run_dir}", flush=True)
    return run_local(config_path, cfg, os.path.abspath(run_dir), passthrough)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
