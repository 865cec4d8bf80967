"""A spare process against a real job's store: it joins with the run's key, says it is ready, parks, and ends on an
assignment (taking the place fails: no survivor heals with it here), on the job's end, on SIGTERM and when the
store goes, each with exit 0.

The store is served here as rank 0 serves it (the same key, binding and ports); the spares are real processes of
``python -m accelpact_slurm.cli.spare``, as the launcher starts them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest

from accelpact_slurm.core.errors import EXIT_REQUEUE

from accelpact_slurm.core.events import read_events
from accelpact_slurm.core.spares import (Assignment, announce_end, assign_spare, free_spare_nodes, ready_key,
                                         spare_pool)
from accelpact_slurm.launch.ranks import SPARE_MODULE, spare_args, spare_environ
from accelpact_slurm.runtime.transport.store import JobStore, binding, host_store, port_candidates
from ckpt_service.auth import load_or_create_key
from tests.conftest import REPO, job_text, wait_for
from tests.node_procs import alive, node_pids

pytestmark = pytest.mark.multiproc

HOST = "127.0.0.1"
JOB = "spare-t"
NODES, RPN, SPARES = 2, 2, 2
DEADLINE_S = 120.0  # a spare imports torch on 2 shared cores


@pytest.fixture
def job(tmp_path):
    """A job's store (as rank 0 hosts it) and a client of it, with two spare nodes' processes started."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = tmp_path / "job.yaml"
    # control_s: how long an assigned spare waits for the heal's survivors (none here) before it gives up
    cfg.write_text(job_text().replace("topology:", f"topology:\n  spare_nodes: {SPARES}", 1)
                   .replace("control_s: 30", "control_s: 8"))
    key = load_or_create_key(str(run_dir))
    bind_to = binding(f"{JOB}.0", 0)
    ports = port_candidates(key, bind_to)
    server = host_store(HOST, ports, key, bind_to)
    client = JobStore(HOST, ports, key, bind_to, 0, timedelta(seconds=30))
    env = spare_environ({**os.environ, "PYTHONPATH": REPO}, data_port=server.port, control_port=server.port)
    procs = {}
    for node in (2, 3):
        for local in range(RPN):
            args = spare_args(str(cfg), str(run_dir), [], job_id=JOB, step="0", restart=0, node=node,
                              local_rank=local, hostname=f"node{node + 1}")
            log = open(run_dir / f"spare-{node}-{local}.log", "wb")
            procs[(node, local)] = subprocess.Popen([sys.executable, "-m", SPARE_MODULE, *args], env=env,
                                                    stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            log.close()
    yield {"run_dir": str(run_dir), "client": client, "server": server, "procs": procs}
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    client.close()
    server.close()


def _events(run_dir):
    return list(read_events(os.path.join(run_dir, "events.jsonl")))


def _ends(run_dir):
    return {(e["node"], e["local_rank"]): e for e in _events(run_dir) if e["event"] == "spare_end"}


def test_spares_park_warm_then_take_an_assignment_or_the_end(job):
    """Negative control: before the assignment and the end are written, no spare has ended (they park; the ready
    keys are all there)."""
    run_dir, client, procs = job["run_dir"], job["client"], job["procs"]
    wait_for(lambda: free_spare_nodes(client, nodes=NODES, ranks_per_node=RPN, spare_count=SPARES) == [2, 3],
             DEADLINE_S, "every spare process ready")
    assert all(client.check([ready_key(n, l)]) for n, l in procs)
    assert all(p.poll() is None for p in procs.values()) and _ends(run_dir) == {}  # the control: parked
    events = _events(run_dir)
    assert set(node_pids(events, 2)) == {procs[(2, 0)].pid, procs[(2, 1)].pid}
    assert set(node_pids(events, 2).values()) == {"spare"}
    ready = [e for e in events if e["event"] == "spare_ready"]
    assert len(ready) == 4 and all(e["warm_s"] > 0 for e in ready)
    assert spare_pool(events)["nodes"] == {"2": "free", "3": "free"}

    a = Assignment(generation=1, dead_node=1, spare_node=2, ranks=(2, 3), frontier=5)
    assert assign_spare(client, a, nodes=NODES, ranks_per_node=RPN, spare_count=SPARES)[0]
    for local in range(RPN):  # handed a rank's place, a spare ends as that rank would: no heal, a requeue
        assert procs[(2, local)].wait(timeout=DEADLINE_S) == EXIT_REQUEUE
    assert procs[(3, 0)].poll() is None  # the other spare node parks on
    announce_end(client, nodes=NODES, spare_count=SPARES)
    for local in range(RPN):
        assert procs[(3, local)].wait(timeout=DEADLINE_S) == 0
    events = _events(run_dir)
    taken = sorted((e["local_rank"], e["takes_rank"], e["dead_node"], e["frontier"]) for e in events
                   if e["event"] == "spare_assigned")
    assert taken == [(0, 2, 1, 5), (1, 3, 1, 5)]
    ends = _ends(run_dir)
    # no survivor builds the heal's groups here: the spare gives up after control_s (the survivors' side and a
    # certified heal: tests/e2e/test_heal_local.py)
    assert "the heal of rank 2 failed" in ends[(2, 0)]["reason"] and "heal's groups" in ends[(2, 0)]["reason"]
    assert ends[(3, 0)]["reason"] == ends[(3, 1)]["reason"] == "the job ended"
    assert spare_pool(events)["nodes"] == {"2": "used", "3": "ended"}
    assert not any(alive(p.pid) for p in procs.values())


def test_a_parked_spare_exits_0_on_sigterm_and_when_the_store_goes(job):
    run_dir, client, procs = job["run_dir"], job["client"], job["procs"]
    wait_for(lambda: free_spare_nodes(client, nodes=NODES, ranks_per_node=RPN, spare_count=SPARES) == [2, 3],
             DEADLINE_S, "every spare process ready")
    procs[(2, 0)].send_signal(signal.SIGTERM)
    assert procs[(2, 0)].wait(timeout=30) == 0
    assert _ends(run_dir)[(2, 0)]["reason"].startswith("stopped by SIGTERM")
    job["server"].close()  # rank 0 ended without announcing the end: its store is gone
    for key in [(2, 1), (3, 0), (3, 1)]:
        assert procs[key].wait(timeout=60) == 0
    assert all(e["reason"].startswith("the job's store is gone") for k, e in _ends(run_dir).items() if k != (2, 0))
