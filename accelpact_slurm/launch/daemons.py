"""Starting and stopping the per-node checkpoint daemons of the embedded default and submitit's local backend.

Who calls: :mod:`accelpact_slurm.launch.local` (one daemon per emulated node, before the ranks) and
:mod:`accelpact_slurm.launch.submission`; the sbatch template's node task runs :func:`.core.serve_node`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from accelpact_slurm.core.safeopen import open_writable
from accelpact_slurm.launch.ranks import daemon_command
from ckpt_service.layout import node_dir, shared_dir
from ckpt_service.staging import FAILED, REMOVED, drop_unserved
from ckpt_service.tiers import drop_dead_copies

log = logging.getLogger(__name__)

@dataclass
class LocalDaemon:
    node: str
    proc: Any  # subprocess.Popen, or a zygote's Forked (the same interface)
    log_path: str


def start_local_daemons(config_path: str, cfg, run_dir: str, job_id: str, environ: Mapping[str, str],
                        drain_s: float = 120.0, restart: int = 0, zygote: Any = None) -> list[LocalDaemon]:
    """Start one daemon per emulated node (none when snapshots are off), forked from ``zygote`` where there is one."""
    if cfg.checkpoint.every_steps <= 0:
        return []
    return [spawn_daemon(config_path, run_dir, f"node{i + 1}", i, job_id, environ, restart=restart, drain_s=drain_s,
                         num_nodes=cfg.topology.nodes, every_steps=cfg.checkpoint.every_steps, zygote=zygote)
            for i in range(cfg.topology.nodes)]


def spawn_daemon(config_path: str, run_dir: str, node: str, node_index: int, job_id: str,
                 environ: Mapping[str, str], *, restart: int, drain_s: float,
                 preexec_fn: Callable[[], None] | None = None, num_nodes: int | None = None,
                 every_steps: int | None = None, keep_serving_on_sigterm: bool = False,
                 zygote: Any = None) -> LocalDaemon:
    """Start one node's ``accelpact-ckptd``, its output appended to ``RUN_DIR/logs/ckptd-<node>.log``.

    ``num_nodes`` and ``every_steps``: the job's, for the shared-tier rotation (:func:`.ranks.daemon_command`).
    ``keep_serving_on_sigterm``: in a real Slurm task, where a preemption's SIGTERM reaches the daemon too
    (:func:`stop_daemons` stops it with SIGINT either way).  ``zygote`` (:class:`.zygote.Zygote`, the embedded
    default's): fork the daemon from it, torch and DCP already imported (its first snapshot, the job's final
    one included, would otherwise wait for those imports); a plain process where it cannot.
    """
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    log_path = os.path.join(logs, f"ckptd-{node}.log")
    cmd = daemon_command(config_path, run_dir, node, node_index, job_id, restart=restart, drain_s=drain_s,
                         num_nodes=num_nodes, every_steps=every_steps, keep_serving_on_sigterm=keep_serving_on_sigterm)
    if zygote is not None and zygote.alive and preexec_fn is None and cmd[1] == "-m":
        try:
            return LocalDaemon(node, zygote.spawn(cmd[3:], environ, log_path, module=cmd[2]), log_path)
        except OSError as exc:
            log.warning("the daemon of %s starts as a plain process: %s", node, exc)
    with os.fdopen(open_writable(log_path, append=True, mode=0o644)[0], "ab") as fh:  # never through a link
        proc = subprocess.Popen(cmd, env=dict(environ), stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=preexec_fn)
    return LocalDaemon(node, proc, log_path)


def stop_daemons(daemons: Sequence[LocalDaemon], drain_s: float = 120.0) -> None:
    """SIGINT (and SIGCONT, for a daemon someone stopped), wait for the drain (bounded), then SIGKILL.

    SIGINT, not SIGTERM: a daemon started with ``keep_serving_on_sigterm`` ignores SIGTERM; every daemon
    stops on SIGINT.
    """
    for d in daemons:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGINT)
            d.proc.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP) daemon would hold its SIGINT until the kill
    for d in daemons:
        try:
            d.proc.wait(timeout=drain_s + 15)
        except subprocess.TimeoutExpired:
            log.warning("daemon of %s did not stop; killing it", d.node)
            d.proc.kill()
            d.proc.wait(timeout=10)


def drop_leftover_staging(daemons: Sequence[LocalDaemon], run_dir: str, local_dir: str | None,
                          shared: str | None = None) -> None:
    """After :func:`stop_daemons`: remove the shared-memory staging of every daemon that did not exit cleanly.

    Who calls: the embedded default's launcher at the end of every start, however it ended.  A daemon
    killed by ``kill -9`` leaves its staging slots in ``/dev/shm`` (RAM); a node directory whose daemon
    still runs is left alone (:func:`ckpt_service.staging.drop_unserved` takes its lock first).  Also the
    half-made copies a daemon killed during an upload left in the shared tier (``shared``:
    ``checkpoint.shared_dir``; :func:`ckpt_service.tiers.drop_dead_copies`).
    """

    for d in daemons:
        what, why = drop_unserved(node_dir(run_dir, d.node, local_dir))
        if what == FAILED:
            log.warning("%s", why)
        elif what == REMOVED:
            log.info("%s", why)
        copies = drop_dead_copies(shared_dir(run_dir, shared), d.node)  # a daemon killed during an upload
        if copies:
            log.info("removed %s in the shared tier, left by %s's daemon", ", ".join(copies), d.node)
