"""``python -m accelpact_slurm.cli.worker CONFIG --run-dir DIR``: one rank of a job, as one Slurm task (or emulated).

Not a user command: the launchers start it -- the sbatch template (``srun --label``, one task per rank) and the
embedded default (``accelpact-run``, one process per rank with an emulated Slurm environment).  It takes the
job-level flags of ``accelpact-run`` (:func:`accelpact_slurm.launch.core.add_job_flags`), runs the start-up
checks of :func:`accelpact_slurm.launch.core.start_rank` and calls the job file's ``entry`` with its Job; the
step's sizes win over the job file's topology.  Its exit code is the rank's decision (75 requeue me, 76 do not
requeue, 2 usage); what the launcher makes of it is :func:`accelpact_slurm.launch.core.exit_verdict`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from accelpact_slurm.core import settings
from accelpact_slurm.core.errors import EXIT_CODES, EXIT_USAGE, AccelpactError, ConfigError
from accelpact_slurm.launch import core
from accelpact_slurm.slurm.env import in_slurm

PROG = "accelpact_slurm.cli.worker"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        epilog="exit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in sorted(EXIT_CODES.items())),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return core.add_job_flags(p)


def main(argv: Sequence[str] | None = None) -> int:

    env = os.environ
    # First thing (before the slow imports): an unhandled USR2 would kill the task.
    if in_slurm(env):
        core.install_signals(settings.emulated(env))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=settings.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if not in_slurm(env):
            raise ConfigError("SLURM_PROCID", None,
                              "the worker runs as one task of a job: start the job with accelpact-run, "
                              "accelpact-submit or sbatch sbatch_templates/hsdp.sbatch")
        cfg = core.job_config(args)
        code, _ = core.run_task(cfg, args.config, args.run_dir, env, allow_config_change=args.allow_config_change,
                                script=core.script_spec(args))
        return code
    except AccelpactError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, (ConfigError, ValueError)) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
