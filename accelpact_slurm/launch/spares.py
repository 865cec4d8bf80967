"""The embedded default's spare nodes: start their processes with a start's ranks, stop them at its end.

``topology.spare_nodes: K`` gives a job ``K`` more emulated nodes, each with ``ranks_per_node`` spare processes
(:mod:`accelpact_slurm.runtime.job.spare`: warm, in the job's store, parked).  They are started after the ranks of
every start (forked from the zygote where the ranks are, so torch and the runtime come imported), with the same
rendezvous as the ranks and their own place as arguments (:func:`.ranks.spare_args`); each one's output goes to
``RUN_DIR/logs/spare-<node>-<local>.log``.  Nothing waits on a parked spare while the ranks run, and a parked
spare's exit, however it ends, is no rank's failure.  A spare handed a dead rank's place (:class:`TakenPlaces`)
is supervised in that rank's place from then on: its exit is the rank's.  Once the ranks have ended,
:func:`stop_spares` sends the spares still running SIGTERM (each exits 0 within one park wait) and SIGKILLs any
left after the grace.  With ``spare_nodes: 0`` (the default) nothing here runs.

Who calls: :func:`accelpact_slurm.launch.local.launch_local`.  Under the sbatch template and ``accelpact-submit``
spares are not started yet (:func:`accelpact_slurm.core.spares.check_spares_started` refuses them there).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.events import EVENTS_FILE
from accelpact_slurm.core.safeopen import open_writable
from accelpact_slurm.core.spares import spare_hostname, spare_nodes
from accelpact_slurm.launch.ranks import SPARE_MODULE, spare_args, spare_environ

log = logging.getLogger(__name__)

#: What a spare gets beyond its park wait to exit after SIGTERM, before SIGKILL.
STOP_GRACE_S = 5.0


@dataclass
class SpareProcess:
    node: int
    local_rank: int
    proc: Any  # subprocess.Popen, or a zygote's Forked (the same interface)
    log_path: str
    log_start: int = 0  # the log's size when this start's process began (earlier starts' lines are before it)


def start_local_spares(config_path: str, cfg: JobConfig, run_dir: str, job_args: Sequence[str],
                       environ: Mapping[str, str], *, job_id: str, restart: int, data_port: int, control_port: int,
                       zygote: Any = None, no_port: bool = False) -> list[SpareProcess]:
    """Start every spare process of one start (none when ``topology.spare_nodes`` is 0).

    ``no_port`` (test-only, as for the ranks): no launcher's port, the spare finds the store at derived ports.
    Raises OSError when one cannot be started (the caller stops the rest and the ranks).
    """
    spares: list[SpareProcess] = []
    if cfg.topology.spare_nodes <= 0:
        return spares
    env = spare_environ(environ, data_port=data_port, control_port=control_port)
    if no_port:
        env.pop(settings.MASTER_PORT, None)
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    try:
        for node in spare_nodes(cfg.topology.nodes, cfg.topology.spare_nodes):
            for local in range(cfg.topology.ranks_per_node):
                args = spare_args(config_path, run_dir, job_args, job_id=job_id, step="0", restart=restart,
                                  node=node, local_rank=local, hostname=spare_hostname(node))
                log_path = os.path.join(logs, f"spare-{node}-{local}.log")
                start = os.path.getsize(log_path) if os.path.isfile(log_path) else 0
                spares.append(SpareProcess(node, local, _spawn(args, env, log_path, zygote), log_path, start))
    except OSError:
        stop_spares(spares, 0.0)
        raise
    return spares


def _spawn(args: list[str], env: Mapping[str, str], log_path: str, zygote: Any) -> Any:
    if zygote is not None and zygote.alive:
        return zygote.spawn(args, env, log_path, module=SPARE_MODULE)
    with os.fdopen(open_writable(log_path, append=True, mode=0o644)[0], "ab") as fh:  # never through a link
        return subprocess.Popen([sys.executable, "-m", SPARE_MODULE, *args], env=dict(env), stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


class TakenPlaces:
    """The spare processes of start ``restart`` handed a rank's place so far (their ``spare_assigned`` events), by
    the rank they took: the launcher supervises each in the dead rank's place.  Each call reads only what the event
    log gained since the last one."""

    def __init__(self, run_dir: str, restart: int, spares: Sequence[SpareProcess]) -> None:
        self._path = os.path.join(run_dir, EVENTS_FILE)
        self._restart = restart
        self._by_place = {(sp.node, sp.local_rank): sp for sp in spares}
        self._offset = 0
        self.taken: dict[int, SpareProcess] = {}

    def __call__(self) -> dict[int, SpareProcess]:
        try:
            with open(self._path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except OSError:
            return self.taken
        end = chunk.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        for line in chunk[:end].splitlines():
            if b'"spare_assigned"' not in line:
                continue
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") != "spare_assigned" or int(e.get("restart") or 0) != self._restart:
                continue
            sp = self._by_place.get((e.get("node"), e.get("local_rank")))
            if sp is not None and isinstance(e.get("takes_rank"), int):
                self.taken[e["takes_rank"]] = sp
        return self.taken


def stop_spares(spares: Sequence[SpareProcess], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every spare still running (SIGCONT too: a stopped one would hold it), wait up to ``grace_s``
    for all of them together, then SIGKILL the rest.  Their exit codes are logged, never acted on."""
    for sp in spares:
        if sp.proc.poll() is None:
            sp.proc.send_signal(signal.SIGTERM)
            sp.proc.send_signal(signal.SIGCONT)
    end = time.monotonic() + grace_s
    for sp in spares:
        try:
            sp.proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("spare %d/%d (pid %d) did not stop within %.1f s: killing it", sp.node, sp.local_rank,
                        sp.proc.pid, grace_s)
            sp.proc.kill()
            sp.proc.wait(timeout=10)
        if sp.proc.returncode not in (0, None):
            log.info("spare %d/%d (pid %d) ended with %s (a spare's exit is no rank's failure)", sp.node,
                     sp.local_rank, sp.proc.pid, sp.proc.returncode)

