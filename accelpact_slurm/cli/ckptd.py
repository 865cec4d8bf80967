"""``accelpact-ckptd CONFIG --run-dir DIR``: the checkpoint daemon of one node of one job.

Started by ``accelpact-run`` (one per emulated node) and by the sbatch template (``srun --ntasks-per-node=1``, one per
node).  A second daemon for the same node directory exits at once with code 2 and a message naming the holder.  SIGINT
or SIGTERM: finish in-flight snapshots up to ``--drain-s``, then exit 0.  With ``--keep-serving-on-sigterm`` (the
sbatch template, submitit's Slurm tasks) SIGTERM does not stop it: Slurm sends SIGTERM to every task of a preempted
job, and the ranks answer it with a snapshot that needs this daemon; the launcher stops it with SIGINT once the ranks
are gone (Slurm's SIGKILL ends it otherwise).  SIGUSR2 (the pre-timeout warning, meant for the ranks) is ignored.

``--drop-staging``: serve nothing; remove the shared-memory staging a daemon of this node killed by
``kill -9`` left behind, unless a live daemon holds the node directory's lock
(:func:`ckpt_service.staging.drop_unserved`).  The template runs it after the daemon exits.

Which node uploads which snapshot to the shared tier needs the node's index, the node count and the snapshot cadence:
``--node-index`` (else ``$SLURM_NODEID``), ``--num-nodes`` (else ``$SLURM_JOB_NUM_NODES``, else the job file's
``topology.nodes``) and ``--every-steps`` (else the job file's ``checkpoint.every_steps``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import select
import signal
import socket
import sys
from typing import Mapping, Sequence

from accelpact_slurm.core.errors import EXIT_OK, EXIT_USAGE, AccelpactError
from accelpact_slurm.core import settings
from accelpact_slurm.core.atomic import write_json_atomic
from accelpact_slurm.core.config import load_config
from accelpact_slurm.core.faults import TestFaults
from accelpact_slurm.core.torch_warnings import quiet_daemon_writes
from ckpt_service.daemon import AlreadyRunning, Daemon, DaemonOptions
from ckpt_service.layout import daemon_failed_marker, node_dir
from ckpt_service.staging import FAILED, NOTHING, drop_unserved

log = logging.getLogger("accelpact_slurm.cli.ckptd")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accelpact-ckptd", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                epilog="documentation: docs/checkpoints.md#what-runs-where")
    p.add_argument("config", metavar="CONFIG", help="the job's YAML file (its checkpoint section)")
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the job's run directory")
    p.add_argument("--node", help="this node's name (default: $SLURMD_NODENAME or the hostname)")
    p.add_argument("--node-index", type=int, help="this node's index in the job, for events and the shared-tier "
                                                  "rotation (default: $SLURM_NODEID)")
    p.add_argument("--num-nodes", type=int, help="the job's node count, for the shared-tier rotation "
                                                 "(default: $SLURM_JOB_NUM_NODES, else the job file's topology.nodes)")
    p.add_argument("--every-steps", type=int, help="the snapshot cadence the ranks use (default: the job file's "
                                                   "checkpoint.every_steps)")
    p.add_argument("--job-id", help="job id for events (default: $SLURM_JOB_ID)")
    p.add_argument("--restart", type=int, help="the job's restart count, for events (default: $SLURM_RESTART_COUNT or 0)")
    p.add_argument("--drain-s", type=float, default=120.0,
                   help="on SIGINT or SIGTERM, finish queued work for at most S s")
    p.add_argument("--keep-serving-on-sigterm", action="store_true",
                   help="do not stop on SIGTERM (a preemption notice under Slurm: the ranks still need this daemon "
                        "for their last snapshot); stop on SIGINT")
    p.add_argument("--drop-staging", action="store_true",
                   help="instead of serving: remove the /dev/shm staging a killed daemon of this node left behind "
                        "(left alone while a live daemon holds the node directory's lock)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # first: whether SIGTERM stops this daemon depends on it
    stop: list[int] = []
    terms: list[int] = []

    def on_signal(signum, _frame):  # handlers only append to a list: no lock (see _wait_for_stop), no I/O
        if signum == signal.SIGTERM and args.keep_serving_on_sigterm:
            terms.append(signum)
        else:
            stop.append(signum)

    wake = _wakeup_pipe()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # --signal=USR2 without B: reaches every task; it is the ranks'

    logging.basicConfig(level=settings.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s ckptd %(threadName)s %(name)s: %(message)s")
    quiet_daemon_writes()
    if args.drop_staging:
        return _drop_staging(args)
    try:
        cfg = load_config(args.config)
        node = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        c = cfg.checkpoint
        restart = args.restart if args.restart is not None else int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        index, nodes = placement(args.node_index, args.num_nodes, cfg.topology.nodes, os.environ)
        opts = DaemonOptions(
            node=node, node_dir=node_dir(args.run_dir, node, c.local_dir), run_dir=os.path.abspath(args.run_dir),
            shared_dir=c.shared_dir, node_index=index, num_nodes=nodes,
            job_id=args.job_id or os.environ.get("SLURM_JOB_ID"),
            restart=restart,
            every_steps=args.every_steps if args.every_steps is not None else c.every_steps,
            keep_last=c.keep_last, milestone_every=c.milestone_every, shared_every=c.shared_every,
            shared_keep=c.shared_keep, compress=c.compress, drain_s=args.drain_s, faults=_faults(restart),
        )
        imported = preload()  # at the ranks' priority: an idle writer would import torch only once ranks wait
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
    d.events.emit("process", role="daemon", pid=os.getpid(), hostname=node)  # every process of the job, named
    print(f"accelpact-ckptd: serving {opts.node_dir} for node {node} (pid {os.getpid()}; "
          f"{'imported torch and DCP at start' if imported else 'torch and DCP were imported already'})", flush=True)
    told = False
    while not _wait_for_stop(stop, wake, 1.0):
        if terms and not told:  # logged here, not in the handler
            told = True
            print("accelpact-ckptd: SIGTERM (a preemption notice, or the job's end): serving on for the ranks' "
                  "last snapshot until SIGINT (or Slurm's SIGKILL)", flush=True)
    finished = d.drain_and_close()
    print(f"accelpact-ckptd: stopped ({'drained' if finished else 'drain deadline passed'})", flush=True)
    return EXIT_OK


def _wakeup_pipe() -> int:
    """The read end of a pipe the interpreter writes a byte to whenever a signal arrives (``set_wakeup_fd``)."""
    r, w = os.pipe()
    for fd in (r, w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(w)
    return r


def _wait_for_stop(stop: list[int], wake: int, timeout_s: float) -> bool:
    """Whether a stop signal came, waiting up to ``timeout_s`` for one.

    Not a ``threading.Event`` set by the handler: the handler runs in this (the main) thread, between two
    bytecodes, and ``Event.set`` takes the lock that ``Event.wait`` holds around its checks: a signal arriving
    there (a parent's death, SIGINT at the job's end) blocked the daemon forever and left it serving with nobody
    to serve.  The wake-up pipe wakes the wait at once; the handler only appends to a list.
    """
    if not stop:
        select.select([wake], [], [], timeout_s)
        try:
            while os.read(wake, 512):
                pass
        except BlockingIOError:
            pass
    return bool(stop)


def placement(node_index: int | None, num_nodes: int | None, file_nodes: int,
              environ: Mapping[str, str]) -> tuple[int | None, int | None]:
    """``(node index, node count)``: flag > Slurm's environment > the job file (the node count only).  Pure.

    The sbatch template starts the daemons with ``srun --ntasks-per-node=1`` over the whole allocation, so
    ``SLURM_NODEID`` is the node's index in the job and ``SLURM_JOB_NUM_NODES`` the node count.  Unknown
    stays ``None``: then every node copies a due snapshot and the first copy wins.
    """
    def env_int(name: str) -> int | None:
        try:
            return int(environ[name])
        except (KeyError, ValueError):
            return None

    index = node_index if node_index is not None else env_int("SLURM_NODEID")
    nodes = num_nodes if num_nodes is not None else env_int("SLURM_JOB_NUM_NODES") or env_int("SLURM_NNODES")
    if nodes is None and index is not None and "SLURM_JOB_ID" not in environ:
        nodes = file_nodes  # the embedded default: the job file's topology is the job's
    return index, nodes


def _drop_staging(args: argparse.Namespace) -> int:
    """``--drop-staging``: this node's leftovers of a killed daemon, found as the daemon finds its node directory."""
    try:
        local_dir = load_config(args.config).checkpoint.local_dir
    except (AccelpactError, OSError) as exc:
        print(f"accelpact-ckptd: --drop-staging: {exc}", file=sys.stderr)
        return EXIT_USAGE
    node = args.node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    what, why = drop_unserved(node_dir(args.run_dir, node, local_dir))
    if what != NOTHING:  # after a clean exit (the common case) the daemon has dropped it itself: say nothing
        print(f"accelpact-ckptd: --drop-staging on {node}: {why}", file=sys.stderr if what == FAILED else sys.stdout,
              flush=True)
    return 1 if what == FAILED else EXIT_OK


def _faults(restart: int) -> TestFaults:
    """The test's faults; a daemon kill point fires on the job's first start only (the embedded default starts its
    daemons without ``SLURM_RESTART_COUNT``: the restart comes as ``--restart``)."""
    faults = TestFaults.from_environ()
    return dataclasses.replace(faults, ckptd_kill_at=None) if restart else faults


def _mark_failed(run_dir: str, node: str, restart: int, why: str) -> None:


    try:
        os.makedirs(os.path.dirname(daemon_failed_marker(run_dir, node)), exist_ok=True)
        write_json_atomic(daemon_failed_marker(run_dir, node), {"node": node, "restart": restart, "reason": why,
                                                               "pid": os.getpid()})
    except OSError:  # the run directory itself is unwritable: the ranks wait out startup_s once instead
        pass


#: What a snapshot's write and verification import on first use (torch, DCP's planner, reader and writer).
WRITE_MODULES = ("torch", "torch.distributed.checkpoint", "ckpt_service.dcp_write", "ckpt_service.verify")


def preload() -> list[str]:
    """Import what the first snapshot needs now, before the daemon lowers its priority; returns the modules that
    were not imported yet (none in a daemon forked from the embedded default's zygote).

    The writer threads run at ``SCHED_IDLE`` (or niced): importing torch there takes seconds of CPU that a busy
    node gives them only once its ranks wait -- for the job's final snapshot, the last thing a job waits for.
    """
    missing = [name for name in WRITE_MODULES if name not in sys.modules]
    for name in missing:
        importlib.import_module(name)
    return missing


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
