"""``python -m accelpact_slurm.cli.node {job,gpus,serve,usr2,settle}``: the sbatch template's hooks into the launch core.

Not a user command: ``sbatch_templates/hsdp.sbatch`` spells no protocol itself and calls these instead (Slurm's
variables give the rest):

* ``job ARGS...``: the template's own arguments, in either form -- ``CONFIG [RUN_DIR]`` or the torchrun form
  ``[flags] SCRIPT.py [script args]`` (:func:`accelpact_slurm.launch.script.template_job`: the effective job file
  written into the run directory) -- checked with the GPUs before anything starts; prints ``CONFIG``, ``RUN_DIR``
  and ``WORKER_ARGS`` as bash assignments, every value quoted, for the template to ``eval``; exit 2 with one line
  (a help or a usage message on stderr) otherwise.
* ``gpus [--job-file CONFIG]``: print the allocation's GPUs per node (0: a CPU job); exit 2 with one line when they
  differ from the tasks per node (:func:`accelpact_slurm.launch.core.gpus_per_node`) or the job file is one the
  workers would refuse.  Checked in the batch shell before any step: ``srun --kill-on-bad-exit`` would end the slower
  tasks (status 143, read as a crash) before they could say so with 2.
* ``serve CONFIG --run-dir DIR``: this node's checkpoint daemon, then the staging a killed daemon left
  (:func:`accelpact_slurm.launch.core.serve_node`).
* ``usr2 RUN_DIR [--step-pid PID]``: record the pre-timeout USR2 and forward it to the training step once every task
  is ready (:func:`accelpact_slurm.launch.core.forward_usr2`).
* ``settle RUN_DIR --status RC [--ending]``: exit with the job's exit code, after asking Slurm to requeue a crash
  nobody decided on (:func:`accelpact_slurm.launch.core.settle_step`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Sequence

from accelpact_slurm.core.config import load_config
from accelpact_slurm.core.errors import EXIT_USAGE, AccelpactError
from accelpact_slurm.core.spares import check_spares_started
from accelpact_slurm.launch import core
from accelpact_slurm.launch import script as script_form

PROG = "accelpact_slurm.cli.node"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    sub = p.add_subparsers(dest="what", required=True)
    job = sub.add_parser("job", help="the template's arguments (CONFIG [RUN_DIR], or [flags] SCRIPT.py [args]) as "
                                     "bash assignments of CONFIG, RUN_DIR and WORKER_ARGS; checked first")
    job.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the template's arguments, as given")
    gpus = sub.add_parser("gpus", help="the allocation's GPUs per node, checked against its tasks per node")
    gpus.add_argument("--job-file", metavar="CONFIG", help="also check the job file as the workers will load it")
    serve = sub.add_parser("serve", help="this node's checkpoint daemon, then its leftover staging")
    serve.add_argument("config", metavar="CONFIG")
    serve.add_argument("--run-dir", required=True, metavar="DIR")
    usr2 = sub.add_parser("usr2", help="record the pre-timeout USR2 and forward it once every task is ready")
    usr2.add_argument("run_dir", metavar="RUN_DIR")
    usr2.add_argument("--step-pid", type=int, metavar="PID", help="the training step's srun (none yet: record only)")
    settle = sub.add_parser("settle", help="the job's exit code after the training step ended")
    settle.add_argument("run_dir", metavar="RUN_DIR")
    settle.add_argument("--status", type=int, required=True, metavar="RC", help="the training step's exit status")
    settle.add_argument("--ending", action="store_true", help="Slurm is ending the job (the batch shell's SIGTERM)")
    return p


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return default


def job(argv: Sequence[str]) -> int:
    """The ``job`` hook: one GPU per rank and the template's arguments checked, the effective job file written
    (the script form), and the template's variables printed; nothing else goes to stdout (the template evals it)."""
    cwd = os.getcwd()
    pwd = os.environ.get("PWD")  # the batch shell's $PWD, as the template used to join relative paths to it
    if pwd and os.path.isabs(pwd) and os.path.isdir(pwd) and os.path.samefile(pwd, cwd):
        cwd = pwd
    try:
        with contextlib.redirect_stdout(sys.stderr):  # a --help or argparse's usage: to the job's output, not eval
            core.gpus_per_node(os.environ)
            found = script_form.template_job(argv, os.environ, cwd)
    except (ValueError, AccelpactError) as exc:
        print(f"hsdp.sbatch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit:  # argparse printed a --help or a usage error: nothing runs (2, not worth a requeue)
        return EXIT_USAGE
    sys.stdout.write(found.shell())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["job"]:  # everything after it is the template's, flags included: never parsed as this command's
        return job(argv[1:])
    args = build_parser().parse_args(argv)

    restart = _int_env("SLURM_RESTART_COUNT", 0)
    if args.what == "gpus":
        try:
            if args.job_file:  # spares: not started under the template yet (core.spares)
                check_spares_started(load_config(args.job_file).topology.spare_nodes, "the sbatch template")
            print(core.gpus_per_node(os.environ))
        except (ValueError, AccelpactError) as exc:
            print(f"hsdp.sbatch: error: {exc}", file=sys.stderr)
            return EXIT_USAGE  # a requeue would not help
        return 0
    if args.what == "serve":
        return core.serve_node(os.path.abspath(args.config), os.path.abspath(args.run_dir), os.environ)
    if args.what == "usr2":
        core.forward_usr2(args.run_dir, restart, _int_env("SLURM_NTASKS", 1), args.step_pid)
        return 0
    if args.what == "settle":
        print(f"hsdp.sbatch: training step exited with status {args.status}", flush=True)
        return core.settle_step(args.run_dir, restart, args.status, ending=args.ending,
                                job_id=os.environ.get("SLURM_JOB_ID", ""), environ=os.environ)
    return EXIT_USAGE  # pragma: no cover - argparse refuses other words


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
