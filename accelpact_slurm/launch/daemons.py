"""Starting, restarting and stopping the per-node checkpoint daemons of the embedded default and submitit's local
backend.

Who calls: :mod:`accelpact_slurm.launch.local` (one daemon per emulated node, before the ranks; a daemon that dies
while the ranks run is started again: :func:`restart_exited`) and :mod:`accelpact_slurm.launch.submission`; the
sbatch template's node task runs :func:`.core.serve_node`, which restarts its daemon the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from accelpact_slurm.core.errors import EXIT_OK, EXIT_USAGE
from accelpact_slurm.core.events import EVENTS_FILE, EventLog
from accelpact_slurm.core.safeopen import open_writable
from accelpact_slurm.launch.ranks import daemon_command
from ckpt_service.layout import node_dir, shared_dir
from ckpt_service.staging import FAILED, REMOVED, drop_unserved
from ckpt_service.tiers import drop_dead_copies

log = logging.getLogger(__name__)

#: How many times one node's daemon is started again within one start of the job.  A daemon killed mid-job
#: (``kill -9``, the OOM killer) would otherwise leave its node without snapshots for the rest of the job; one
#: that keeps dying is given up on (the node carries on without, as when its daemon could not start).
DAEMON_RESTARTS = 3


@dataclass
class LocalDaemon:
    node: str
    proc: Any  # subprocess.Popen, or a zygote's Forked (the same interface)
    log_path: str
    respawn: Callable[[], "LocalDaemon"] | None = None  # starts this node's daemon again, the same way
    restarts: int = 0  # how many times this node's daemon was started again in this start
    given_up: bool = False  # it died once too often: not restarted again (said once)


def worth_restarting(code: int | None) -> bool:
    """Whether a daemon that ended with ``code`` is started again: one killed by a signal (negative) or crashed;
    not one that exited by itself with its own verdict (0: asked to stop; 2: it could not start, and told the
    node's ranks why through its failed marker: a second try would meet the same)."""
    return code is not None and code not in (EXIT_OK, EXIT_USAGE)


def record_restart(run_dir: str, job_id: str, restart: int, node: str, node_index: int | None, old_pid: int,
                   code: int, new_pid: int | None, count: int) -> None:
    """The ``ckptd_restarted`` event of a node's daemon that ended while the ranks ran (``new_pid`` None: it was
    not started again, ``DAEMON_RESTARTS`` spent), and the launcher's log line."""
    status = f"killed by {_signal_name(-code)}" if code < 0 else f"exit {code}"
    if new_pid is None:
        reason = (f"the checkpoint daemon of {node} (pid {old_pid}) ended ({status}) after {count} restart(s) in "
                  f"this start: not started again; training goes on without snapshots on {node}")
        log.warning("%s", reason)
    else:
        reason = (f"the checkpoint daemon of {node} (pid {old_pid}) ended ({status}); started again as pid "
                  f"{new_pid} (restart {count} of {DAEMON_RESTARTS} in this start)")
        log.warning("%s", reason)
    try:
        events = EventLog(os.path.join(run_dir, EVENTS_FILE), job_id=job_id, restart=restart, rank=None,
                          node=node_index)
        try:
            events.emit("ckptd_restarted", hostname=node, old_pid=old_pid, exit_status=code, pid=new_pid,
                        count=count, limit=DAEMON_RESTARTS, reason=reason)
        finally:
            events.close()
    except OSError as exc:  # an unwritable event log must not stop the restarts: the log line above says it
        log.warning("could not record the daemon's restart in %s: %s", run_dir, exc)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def restart_exited(daemons: list[LocalDaemon], run_dir: str, job_id: str, restart: int) -> None:
    """Start again, on the same node directory, every daemon of ``daemons`` that ended while the ranks run.

    Who calls: the embedded default's supervision loop, at every tick while no rank has ended
    (:func:`accelpact_slurm.launch.local.launch_local`).  ``poll`` only (waitpid without blocking): nothing waits
    here.  The new daemon takes the node directory's lock the kernel dropped, removes the killed write's
    ``.tmp-*`` and recovers its state from the node's index (:meth:`ckpt_service.daemon.Daemon.start`); the ranks'
    next request reaches it at the same socket path (the hand-over that met the dead one failed alone, logged).
    Replaces the entries in ``daemons`` (what :func:`stop_daemons` stops at the end).
    """
    for i, d in enumerate(daemons):
        code = d.proc.poll()
        if d.given_up or d.respawn is None or not worth_restarting(code):
            continue
        node_index = _node_index(d.node)
        if d.restarts >= DAEMON_RESTARTS:
            d.given_up = True
            record_restart(run_dir, job_id, restart, d.node, node_index, d.proc.pid, code, None, d.restarts)
            continue
        try:
            new = d.respawn()
        except OSError as exc:  # no process could be made: as when the daemon could not start
            d.given_up = True
            log.warning("the checkpoint daemon of %s could not be started again: %s", d.node, exc)
            record_restart(run_dir, job_id, restart, d.node, node_index, d.proc.pid, code, None, d.restarts)
            continue
        new.respawn, new.restarts = d.respawn, d.restarts + 1
        daemons[i] = new
        record_restart(run_dir, job_id, restart, d.node, node_index, d.proc.pid, code, new.proc.pid, new.restarts)


def _node_index(node: str) -> int | None:
    """The emulated node's index (``node2`` -> 1), as the daemon's own events carry it."""
    return int(node[4:]) - 1 if node.startswith("node") and node[4:].isdigit() else None


def start_local_daemons(config_path: str, cfg, run_dir: str, job_id: str, environ: Mapping[str, str],
                        drain_s: float = 120.0, restart: int = 0, zygote: Any = None) -> list[LocalDaemon]:
    """Start one daemon per emulated node (none when snapshots are off), forked from ``zygote`` where there is one."""
    if cfg.checkpoint.every_steps <= 0:
        return []
    daemons = []
    for i in range(cfg.topology.nodes):
        def respawn(i: int = i) -> LocalDaemon:
            return spawn_daemon(config_path, run_dir, f"node{i + 1}", i, job_id, environ, restart=restart,
                                drain_s=drain_s, num_nodes=cfg.topology.nodes, every_steps=cfg.checkpoint.every_steps,
                                zygote=zygote)
        d = respawn()
        d.respawn = respawn
        daemons.append(d)
    return daemons


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
