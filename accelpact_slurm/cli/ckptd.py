"""``accelpact-ckptd CONFIG --run-dir DIR``: the checkpoint daemon of one node of one job.

Started by ``accelpact-run`` (one per emulated node) and by the sbatch template
(``srun --ntasks-per-node=1``, one per node).  A second daemon for the same node
directory exits at once with code 2 and a message naming the holder.  SIGTERM:
finish in-flight snapshots up to ``--drain-s``, then exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from typing import Sequence

from accelpact_slurm.core.errors import EXIT_OK, EXIT_USAGE, AccelpactError

log = logging.getLogger("accelpact_slurm.cli.ckptd")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accelpact-ckptd", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("config", metavar="CONFIG", help="the job's YAML file (its checkpoint section)")
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the job's run directory")
    p.add_argument("--node", help="this node's name (default: $SLURMD_NODENAME or the hostname)")
    p.add_argument("--node-index", type=int, help="this node's index in the job (for events)")
    p.add_argument("--job-id", help="job id for events (default: $SLURM_JOB_ID)")
    p.add_argument("--restart", type=int, help="the job's restart count, for events (default: $SLURM_RESTART_COUNT or 0)")
    p.add_argument("--drain-s", type=float, default=120.0, help="on SIGTERM, finish queued work for at most S s")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    stop = threading.Event()

    def on_signal(_signum, _frame):  # handlers only set a flag
        stop.set()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    args = build_parser().parse_args(argv)
    from accelpact_slurm.core import settings

    logging.basicConfig(level=settings.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s ckptd %(threadName)s %(name)s: %(message)s")
    from ckpt_service.daemon import AlreadyRunning, Daemon, DaemonOptions
    from ckpt_service.layout import node_dir

    from accelpact_slurm.core.config import load_config
    from accelpact_slurm.core.faults import TestFaults

    try:
        cfg = load_config(args.config)
        node = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        c = cfg.checkpoint
        opts = DaemonOptions(
            node=node, node_dir=node_dir(args.run_dir, node, c.local_dir), run_dir=os.path.abspath(args.run_dir),
            shared_dir=c.shared_dir, node_index=args.node_index, job_id=args.job_id or os.environ.get("SLURM_JOB_ID"),
            restart=args.restart if args.restart is not None else int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            keep_last=c.keep_last, milestone_every=c.milestone_every, compress=c.compress,
            drain_s=args.drain_s, faults=TestFaults.from_environ(),
        )
        if c.daemon_nice:  # background writes and verification yield the CPU to training ranks
            os.nice(c.daemon_nice)
        d = Daemon(opts)
        d.start()
    except AlreadyRunning as exc:
        print(f"accelpact-ckptd: {exc}; exiting", file=sys.stderr)
        return EXIT_USAGE
    except (AccelpactError, OSError) as exc:
        why = str(exc)
        if isinstance(exc, OSError):  # a read-only or missing directory, a file in the way
            why = (f"cannot serve the node directory {opts.node_dir}: {exc.strerror or exc}"
                   f"{f' ({exc.filename})' if exc.filename else ''}; make checkpoint.local_dir a writable "
                   f"directory of this user") if "opts" in locals() else f"{exc}"
        print(f"accelpact-ckptd: error: {why}", file=sys.stderr)
        if "opts" in locals():  # the node's ranks stop waiting for a daemon that will never answer
            _mark_failed(opts.run_dir, opts.node, opts.restart, why)
        return EXIT_USAGE
    print(f"accelpact-ckptd: serving {opts.node_dir} for node {node} (pid {os.getpid()})", flush=True)
    while not stop.wait(1.0):
        pass
    finished = d.drain_and_close()
    print(f"accelpact-ckptd: stopped ({'drained' if finished else 'drain deadline passed'})", flush=True)
    return EXIT_OK


def _mark_failed(run_dir: str, node: str, restart: int, why: str) -> None:
    from ckpt_service.layout import daemon_failed_marker

    from accelpact_slurm.core.atomic import write_json_atomic

    try:
        os.makedirs(os.path.dirname(daemon_failed_marker(run_dir, node)), exist_ok=True)
        write_json_atomic(daemon_failed_marker(run_dir, node), {"node": node, "restart": restart, "reason": why,
                                                               "pid": os.getpid()})
    except OSError:  # the run directory itself is unwritable: the ranks wait out startup_s once instead
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
