"""Starting and stopping the per-node checkpoint daemons of the embedded default and submitit's local backend.

Who calls: :mod:`accelpact_slurm.launch.local` (one daemon per emulated node, before the ranks) and
:mod:`accelpact_slurm.launch.submission`; on Slurm the sbatch template starts ``accelpact-ckptd`` itself.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from accelpact_slurm.launch.ranks import daemon_command

log = logging.getLogger(__name__)

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
    return [spawn_daemon(config_path, run_dir, f"node{i + 1}", i, job_id, environ, restart=restart, drain_s=drain_s)
            for i in range(cfg.topology.nodes)]


def spawn_daemon(config_path: str, run_dir: str, node: str, node_index: int, job_id: str,
                 environ: Mapping[str, str], *, restart: int, drain_s: float,
                 preexec_fn: Callable[[], None] | None = None) -> LocalDaemon:
    """Start one node's ``accelpact-ckptd``, its output appended to ``RUN_DIR/logs/ckptd-<node>.log``."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    log_path = os.path.join(logs, f"ckptd-{node}.log")
    cmd = daemon_command(config_path, run_dir, node, node_index, job_id, restart=restart, drain_s=drain_s)
    with open(log_path, "ab") as fh:
        proc = subprocess.Popen(cmd, env=dict(environ), stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=preexec_fn)
    return LocalDaemon(node, proc, log_path)


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
