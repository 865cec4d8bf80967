"""One spare process: warm, in the job's store, parked until it is handed a dead node's place or the job ends.

A job with ``topology.spare_nodes: K`` has ``K x ranks_per_node`` of these (``docs/launch.md#spare-nodes``;
numbering and store keys: :mod:`accelpact_slurm.core.spares`).  What one does, in order:

1. says it exists: a ``process`` event (role ``spare``, its pid, node and host);
2. warms up: torch and the rank runtime imported (forked from the embedded default's zygote they are already),
   ``torch.set_num_threads`` as a rank's;
3. joins the job's store as a rank does: the run's key, the same binding (job, step, start) and ports, the mutual
   handshake (client number ``world_size + spare``: no rank has it);
4. says it is ready: ``spare/ready/<node>/<local>`` in the store and a ``spare_ready`` event (``warm_s``: from
   its start to here);
5. parks: a blocking store wait on its node's ``spare/assign/<node>`` with a deadline, re-armed (no busy loop: one
   request per :data:`PARK_WAIT_S` while nothing happens), until the key holds an assignment or the job's end,
   the job's store is gone (rank 0 ended), or SIGTERM/SIGINT (the launcher stops its spares at a start's end);
   every one of these ends in exit 0, and no launcher counts a spare's exit as a rank's failure;
6. given an assignment: a ``spare_assigned`` event (:func:`record_assignment`), then
   :func:`~accelpact_slurm.runtime.job.spare_place.take_place`: the spare becomes the dead rank, heals inside the
   user's script's ``job.protect`` and trains on as that rank to the job's end (its exit code is the rank's; the
   launcher supervises it in that rank's place).  ``docs/launch.md#spare-nodes``.

Who calls: :mod:`accelpact_slurm.cli.spare` (the entry the launchers start: the embedded default through
:mod:`accelpact_slurm.launch.spares`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Mapping

from accelpact_slurm.core import settings
from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.errors import EXIT_OK, EXIT_USAGE, CheckpointError
from accelpact_slurm.core.events import EVENTS_FILE, EventLog
from accelpact_slurm.core.spares import STANDBY_KEY, Assignment, assign_key, is_end, ready_key, spare_id
from accelpact_slurm.runtime.job.entry import check_dependencies
from ckpt_service.auth import load_or_create_key

log = logging.getLogger(__name__)

#: How long one blocking wait on the assignment key lasts before it is re-armed (and a stop signal looked at).
PARK_WAIT_S = 1.0
#: How long one try to reach the job's store lasts (they are repeated until ``timeouts.startup_s``).
JOIN_TRY_S = 2.0


def run_spare(cfg: JobConfig, run_dir: str, *, job_id: str, step: str, restart: int, node: int, local_rank: int,
              hostname: str, environ: Mapping[str, str] | None = None, park_wait_s: float = PARK_WAIT_S,
              job_file: str | None = None) -> int:
    """The whole life of one spare process (see the module); returns its exit code (0, or 2 for an unusable run
    directory key).  ``step``: the training step's id ("" when it has none), for the store's binding;
    ``job_file``: the job file (its directory resolves a relative ``entry``)."""
    t0 = time.monotonic()
    environ = os.environ if environ is None else environ
    nodes, rpn = cfg.topology.nodes, cfg.topology.ranks_per_node
    sid = spare_id(node, local_rank, nodes, rpn)
    stop: list[int] = []
    for s in (signal.SIGTERM, signal.SIGINT):  # handlers only set a flag; the park loop looks at it
        signal.signal(s, lambda n, _f: stop.append(n))
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the ranks' pre-timeout warning: nothing for a spare to save
    events = EventLog(os.path.join(run_dir, EVENTS_FILE), job_id=job_id, restart=restart, rank=None, node=node)
    try:
        events.emit("process", role="spare", pid=os.getpid(), hostname=hostname, spare=sid, local_rank=local_rank)
        code, reason = _warm_join_park(cfg, run_dir, events, environ, job_id=job_id, step=step, restart=restart,
                                       node=node, local_rank=local_rank, hostname=hostname, sid=sid, stop=stop,
                                       t0=t0, park_wait_s=park_wait_s, job_file=job_file)
        log.info("spare %d (node %d, local rank %d) ends: %s", sid, node, local_rank, reason)
        events.emit("spare_end", spare=sid, local_rank=local_rank, reason=reason, exit_code=code)
        return code
    finally:
        events.close()


def _warm_join_park(cfg: JobConfig, run_dir: str, events: EventLog, environ: Mapping[str, str], *, job_id: str,
                    step: str, restart: int, node: int, local_rank: int, hostname: str, sid: int, stop: list[int],
                    t0: float, park_wait_s: float, job_file: str | None = None) -> tuple[int, str]:
    check_dependencies()  # what a rank imports first; a no-op when forked from the zygote
    import torch
    import torch.distributed as dist

    import accelpact_slurm.runtime.job.api  # noqa: F401 - warm: what a rank imports to train
    from accelpact_slurm.runtime.job.topology import store_ports
    from accelpact_slurm.runtime.transport.store import JobStore, binding

    torch.set_num_threads(cfg.topology.threads_per_rank)
    try:
        key = load_or_create_key(run_dir)
    except CheckpointError as exc:
        return EXIT_USAGE, f"the run's key: {exc}"
    host = settings.rendezvous(environ)[0]
    if not host:
        return EXIT_USAGE, f"no rendezvous address ({settings.MASTER_ADDR}): the launcher gives it"
    bind_to = binding(f"{job_id}.{step}" if step else job_id, restart)
    world = cfg.topology.nodes * cfg.topology.ranks_per_node
    ports, deadline = store_ports(bind_to, environ, key), time.monotonic() + cfg.timeouts.startup_s
    while True:  # short tries until startup_s: a stop signal is seen between two (rank 0 may not host it yet)
        try:
            store = JobStore(host, ports, key, bind_to, world + sid,
                             timedelta(seconds=max(0.1, min(JOIN_TRY_S, deadline - time.monotonic()))))
            break
        except dist.DistNetworkError as exc:  # not up yet; past startup_s, the job never got its store up
            if stop:
                return EXIT_OK, f"stopped by {signal.Signals(stop[0]).name} before it joined the job's store"
            if time.monotonic() >= deadline:
                return EXIT_OK, f"could not join the job's store: {exc}"
    try:
        store.set(ready_key(node, local_rank), json.dumps({
            "spare": sid, "node": node, "local_rank": local_rank, "pid": os.getpid(), "hostname": hostname,
            "ts": time.time()}))
        warm_s = time.monotonic() - t0
        events.emit("spare_ready", spare=sid, local_rank=local_rank, pid=os.getpid(), warm_s=round(warm_s, 3),
                    hostname=hostname or socket.gethostname())
        def place(assignment: Assignment) -> tuple[int, str]:
            from accelpact_slurm.runtime.job.spare_place import take_place

            # the spare trains on as the dead rank to the job's end, or stops as a rank does
            def connect(timeout_s: float) -> Any:  # the store, or its standby once the store is gone; named as the
                # rank whose place it takes (the store's witness counts that rank's connections)
                return store.sibling(timedelta(seconds=timeout_s), rank=assignment.ranks[local_rank])

            return take_place(assignment, cfg, store=store, connect=connect, key=key, run_dir=run_dir,
                              job_file=job_file, job_id=job_id, restart=restart, local_rank=local_rank, sid=sid,
                              environ=environ)

        return _park(store, events, sid=sid, node=node, local_rank=local_rank, stop=stop, park_wait_s=park_wait_s,
                     place=place)
    except dist.DistNetworkError as exc:
        return EXIT_OK, f"the job's store is gone (rank 0 ended): {exc}"
    finally:
        store.close()


def _park(store: Any, events: EventLog, *, sid: int, node: int, local_rank: int, stop: list[int],
          park_wait_s: float, place: Callable[[Assignment], tuple[int, str]] | None = None) -> tuple[int, str]:
    """Wait on ``spare/assign/<node>`` (blocking, with a deadline, re-armed) until it holds something or a stop
    signal came; DistNetworkError (the store gone) goes to the caller.  ``place``: what takes the assignment's
    place (:func:`~accelpact_slurm.runtime.job.spare_place.take_place`), after the ``spare_assigned`` event."""
    import torch.distributed as dist

    key = assign_key(node)
    while not stop:
        if getattr(store, "standby", True) is None and store.check([STANDBY_KEY]):
            # the store's standby (node 1's first rank says where, once up): the spare parks on through node 0's loss
            doc = json.loads(store.get(STANDBY_KEY))
            store.set_standby(doc["host"], [int(doc["port"])])
        try:
            store.wait([key], timedelta(seconds=park_wait_s))
        except dist.DistStoreError:  # the deadline passed with nothing for us: re-arm
            continue
        value = store.get(key)
        if is_end(value):
            return EXIT_OK, "the job ended"
        try:
            assignment = Assignment.from_json(value)
        except ValueError as exc:
            return EXIT_OK, f"an unreadable assignment ({exc}): {value[:200]!r}"
        code, reason = record_assignment(assignment, events, sid=sid, local_rank=local_rank)
        return place(assignment) if place is not None else (code, reason)
    return EXIT_OK, f"stopped by {signal.Signals(stop[0]).name} (the launcher ends its spares with the start)"


def record_assignment(assignment: Assignment, events: EventLog, *, sid: int, local_rank: int) -> tuple[int, str]:
    """This spare process was handed ``assignment.ranks[local_rank]``: a ``spare_assigned`` event, before it takes
    the place (:func:`~accelpact_slurm.runtime.job.spare_place.take_place`)."""
    takes = assignment.ranks[local_rank] if 0 <= local_rank < len(assignment.ranks) else None
    events.emit("spare_assigned", spare=sid, local_rank=local_rank, generation=assignment.generation,
                dead_node=assignment.dead_node, ranks=list(assignment.ranks), frontier=assignment.frontier,
                takes_rank=takes)
    log.info("spare %d was handed rank %s of dead node %d at frontier %d (generation %d)", sid, takes,
             assignment.dead_node, assignment.frontier, assignment.generation)
    return EXIT_OK, f"assigned rank {takes} of node {assignment.dead_node}"
