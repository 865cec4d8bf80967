"""``python -m accelpact_slurm.cli.spare CONFIG --run-dir DIR --node N --local-rank L ...``: one spare process.

Not a user command: the embedded default's launcher starts ``topology.spare_nodes x ranks_per_node`` of these per
start (:mod:`accelpact_slurm.launch.spares`).  It takes the job-level flags of ``accelpact-run``
(:func:`accelpact_slurm.launch.core.add_job_flags`) and where it sits (the job, its step and start, its node and
local rank), then runs :func:`accelpact_slurm.runtime.job.spare.run_spare`: warm, joined to the job's store,
parked until it is handed a dead node's place or the job ends.  Its exit code is 0 however the job ends (2: a
usage or configuration error); a launcher never counts it as a rank's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from accelpact_slurm.core import settings
from accelpact_slurm.core.errors import EXIT_USAGE, AccelpactError, ConfigError
from accelpact_slurm.launch import core

PROG = "accelpact_slurm.cli.spare"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    core.add_job_flags(p)
    p.add_argument("--job-id", required=True, help="the job's id (as its ranks see SLURM_JOB_ID)")
    p.add_argument("--step", default="", help="the training step's id (its ranks' SLURM_STEP_ID; '' for none)")
    p.add_argument("--restart", type=int, default=0, help="the start (SLURM_RESTART_COUNT of its ranks)")
    p.add_argument("--node", type=int, required=True, help="this spare's node index (after the training nodes)")
    p.add_argument("--local-rank", type=int, required=True, help="this spare's local rank on its node")
    p.add_argument("--hostname", default="", help="its node's name")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=settings.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s spare %(name)s: %(message)s")
    try:
        cfg = core.job_config(args)
        if not args.run_dir:
            raise ConfigError("--run-dir", None, "give the job's run directory (where its ranks write)")
        if not cfg.topology.nodes <= args.node < cfg.topology.nodes + cfg.topology.spare_nodes:
            raise ConfigError("--node", args.node, f"a spare node's index is {cfg.topology.nodes}.."
                                                   f"{cfg.topology.nodes + cfg.topology.spare_nodes - 1}")
        if not 0 <= args.local_rank < cfg.topology.ranks_per_node:
            raise ConfigError("--local-rank", args.local_rank, f"must be 0..{cfg.topology.ranks_per_node - 1}")
        from accelpact_slurm.runtime.job.spare import run_spare

        return run_spare(cfg, args.run_dir, job_id=args.job_id, step=args.step, restart=args.restart,
                         node=args.node, local_rank=args.local_rank, hostname=args.hostname,
                         job_file=args.config)
    except AccelpactError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
