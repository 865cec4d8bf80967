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
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import EXIT_OK, EXIT_USAGE, AccelpactError

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
    p.add_argument("--no-replay", action="store_true", help="verify by checksums and coverage only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    stop = threading.Event()

    def on_signal(_signum, _frame):  # handlers only set a flag
        stop.set()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    args = build_parser().parse_args(argv)
    from .. import settings

    logging.basicConfig(level=settings.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s ckptd %(threadName)s %(name)s: %(message)s")
    from ckpt_service.daemon import AlreadyRunning, Daemon, DaemonOptions
    from ckpt_service.layout import node_dir

    from ..config import load_config

    try:
        cfg = load_config(args.config)
        node = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        c = cfg.checkpoint
        opts = DaemonOptions(
            node=node, node_dir=node_dir(args.run_dir, node, c.local_dir), run_dir=os.path.abspath(args.run_dir),
            shared_dir=c.shared_dir, node_index=args.node_index, job_id=args.job_id or os.environ.get("SLURM_JOB_ID"),
            restart=args.restart if args.restart is not None else int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            keep_last=c.keep_last, milestone_every=c.milestone_every, compress=c.compress,
            replay=not args.no_replay, drain_s=args.drain_s,
        )
        if c.daemon_nice:  # background writes and verification yield the CPU to training ranks
            os.nice(c.daemon_nice)
        d = Daemon(opts)
        d.start()
    except AlreadyRunning as exc:
        print(f"accelpact-ckptd: {exc}; exiting", file=sys.stderr)
        return EXIT_USAGE
    except AccelpactError as exc:
        print(f"accelpact-ckptd: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"accelpact-ckptd: serving {opts.node_dir} for node {node} (pid {os.getpid()})", flush=True)
    while not stop.wait(1.0):
        pass
    finished = d.drain_and_close()
    print(f"accelpact-ckptd: stopped ({'drained' if finished else 'drain deadline passed'})", flush=True)
    return EXIT_OK


# --------------------------------------------------------------------------- the local launcher's side


@dataclass
class LocalDaemon:
    node: str
    proc: subprocess.Popen
    log_path: str


def start_local_daemons(config_path: str, cfg, run_dir: str, job_id: str, environ: Mapping[str, str],
                        drain_s: float = 120.0, restart: int = 0) -> list[LocalDaemon]:
    """Start one daemon per emulated node (none when snapshots are off)."""
    if cfg.checkpoint.every_steps <= 0:
        return []
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    out = []
    for i in range(cfg.topology.nodes):
        node = f"node{i + 1}"
        log_path = os.path.join(logs, f"ckptd-{node}.log")
        cmd = [sys.executable, "-m", "accelpact_slurm.cli.ckptd", config_path, "--run-dir", run_dir,
               "--node", node, "--node-index", str(i), "--job-id", job_id, "--drain-s", str(drain_s), "--restart", str(restart)]
        with open(log_path, "ab") as fh:
            proc = subprocess.Popen(cmd, env=dict(environ), stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        out.append(LocalDaemon(node, proc, log_path))
    return out


def stop_daemons(daemons: Sequence[LocalDaemon], drain_s: float = 120.0) -> None:
    """SIGTERM, wait for the drain (bounded), then SIGKILL."""
    for d in daemons:
        if d.proc.poll() is None:
            d.proc.terminate()
    for d in daemons:
        try:
            d.proc.wait(timeout=drain_s + 15)
        except subprocess.TimeoutExpired:
            log.warning("daemon of %s did not stop; killing it", d.node)
            d.proc.kill()
            d.proc.wait(timeout=10)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
