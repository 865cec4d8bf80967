"""``accelpact-run CONFIG``: run a training job on the embedded default or as one Slurm task.

Every rank calls the job file's ``entry: module:function`` with its Job (the public API,
docs/api.md).  Outside Slurm the command launches the job itself: ``topology.nodes x
topology.ranks_per_node`` local processes with an emulated Slurm environment.  Inside an
allocation (one task per rank via ``srun``) it joins as that task's rank; the allocation's
sizes win over the job file's topology.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from typing import Sequence

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig, load_config, with_overrides
from accelpact_slurm.core.errors import EXIT_CODES, EXIT_USAGE, AccelpactError, ConfigError
from accelpact_slurm.launch.run_lock import claim
from accelpact_slurm.runtime.rundir import check_run_dir

log = logging.getLogger("accelpact_slurm.cli.run")

#: The training-relevant part of the configuration of a run directory's first start.
TRAINING_FILE = "job-training.json"

EPILOG = "exit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in sorted(EXIT_CODES.items()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="accelpact-run",
        description=__doc__.split("\n\n")[0] + ". " + " ".join(__doc__.split("\n\n")[1].split()),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", metavar="CONFIG", help="YAML job file (see examples/decoder/job.yaml)")
    p.add_argument("--entry", metavar="MODULE:FUNCTION",
                   help="the training function to call on every rank (overrides the file's entry)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="where events.jsonl, summary.json and logs go "
                        f"(default: ${settings.RUNS_ROOT} or ./runs, then the job id or name and time)")
    p.add_argument("--steps", type=int, metavar="N", help="number of optimizer updates (overrides the file)")
    p.add_argument("--seed", type=int, metavar="N", help="random seed (overrides the file)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="run in a run directory whose first start had another entry, seed, steps or params "
                        "(its snapshots then continue a deliberately changed training)")
    p.add_argument("--inject-fault", action="append", default=[], metavar="PHASE:STEP:RANK",
                   help="make RANK withhold its part of the replication collective: PHASE boundary (at the "
                        "committed boundary after update STEP), forward or backward (of update STEP); "
                        "repeatable, added to the file's faults")
    return p


def effective_config(args: argparse.Namespace) -> JobConfig:
    cfg = load_config(args.config)
    overrides = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.entry is not None:
        overrides["entry"] = args.entry
    cfg = with_overrides(cfg, overrides) if overrides else cfg
    if args.inject_fault:
        cfg = with_overrides(cfg, {"faults": list(dict.fromkeys([*map(str, cfg.faults), *args.inject_fault]))})
    return cfg


def default_run_dir(cfg: JobConfig, job_id: str | None) -> str:
    leaf = job_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return os.path.join(settings.runs_root(), leaf)


def check_same_training(cfg: JobConfig, run_dir: str, allow: bool) -> None:
    """Refuse a run directory whose first start trained something else (its snapshots would all fail the
    replay check); record the training part at the first start.  ``allow``: a deliberate change."""
    from accelpact_slurm.core.atomic import write_json_atomic
    from accelpact_slurm.core.config import training_diff, training_part

    path = os.path.join(run_dir, TRAINING_FILE)
    mine = training_part(cfg)
    try:
        with open(path, encoding="utf-8") as fh:
            first = json.load(fh)
    except FileNotFoundError:
        first = None
    except (OSError, ValueError) as exc:
        raise ConfigError("run dir", path, f"cannot read it ({exc}); remove it or use another --run-dir") from None
    if first is not None and not allow:
        changed = training_diff(first, mine)
        if changed:
            raise ConfigError("run dir", run_dir, f"its first start trained with other values of {', '.join(changed)}: "
                                                  f"use another --run-dir, or pass --allow-config-change to continue "
                                                  f"its snapshots with the changed training")
    if first != mine:
        write_json_atomic(path, mine)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=settings.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from accelpact_slurm.slurm.env import SlurmContext, in_slurm

    env = os.environ
    try:
        cfg = effective_config(args)
        if in_slurm(env):
            from accelpact_slurm.slurm import signals

            # First thing: an unhandled USR2 would kill the task.  In a real Slurm task SIGTERM (a preemption's
            # notice) asks for the same snapshot-then-requeue; on the embedded default it still stops the rank.
            signals.install(signals.stop_signals(settings.emulated(env)))
            ctx = SlurmContext.from_environ(env)
            cfg = with_overrides(cfg, {"topology.nodes": ctx.num_nodes,
                                       "topology.ranks_per_node": ctx.ranks_per_node})
            run_dir = args.run_dir or default_run_dir(cfg, ctx.job_id)
            os.makedirs(run_dir, exist_ok=True)
            # one job per run directory: global rank 0 holds the lock while it runs, the others only check it
            lock = claim(run_dir, ctx.job_id, hold=ctx.rank == 0)  # noqa: F841 - held until this task ends
            check_same_training(cfg, run_dir, args.allow_config_change)
            check_run_dir(run_dir, cfg, ctx.hostname)  # before the rank joins: an unsafe run dir is exit 2
            signals.mark_ready(run_dir, ctx.restart_count, ctx.rank)  # the batch script may forward USR2 from now on
            from accelpact_slurm.runtime.job import run_rank

            return run_rank(cfg, ctx, run_dir, job_file=args.config)
        if env.get("SLURM_JOB_ID"):
            raise ConfigError("SLURM_PROCID", None,
                              "inside an allocation but not in a task: start one task per rank with "
                              "srun (see sbatch_templates/hsdp.sbatch)")
        run_dir = args.run_dir or default_run_dir(cfg, None)
        os.makedirs(run_dir, exist_ok=True)
        from accelpact_slurm.launch.local import job_id_for, run_local

        # one job per run directory: the launcher holds the lock across every relaunch, before any rank starts
        lock = claim(os.path.abspath(run_dir), job_id_for(env), hold=True)  # noqa: F841 - held until main returns
        check_same_training(cfg, run_dir, args.allow_config_change)
        check_run_dir(run_dir, cfg, socket.gethostname())  # before any rank or daemon starts

        passthrough: list[str] = []
        if args.steps is not None:
            passthrough += ["--steps", str(args.steps)]
        if args.seed is not None:
            passthrough += ["--seed", str(args.seed)]
        if args.entry is not None:
            passthrough += ["--entry", args.entry]
        for f in args.inject_fault:
            passthrough += ["--inject-fault", f]
        if args.allow_config_change:
            passthrough += ["--allow-config-change"]
        print(f"[accelpact] embedded default: {cfg.topology.nodes} emulated nodes x "
              f"{cfg.topology.ranks_per_node} ranks on this machine; run dir {run_dir}", flush=True)
        return run_local(os.path.abspath(args.config), cfg, os.path.abspath(run_dir), passthrough)
    except AccelpactError as exc:
        print(f"accelpact-run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, (ConfigError, ValueError)) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
