"""No /dev/shm staging left behind on Slurm after kill -9 of a job's ranks and daemons (sbatch_templates/hsdp.sbatch).

The dev cluster's nodes are this host, so the test reads the daemons' and ranks' pids from the job's output and
event log and kills them itself, as the OOM killer or an operator would.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from accelpact_slurm.core.events import read_events
from ckpt_service.layout import node_dir, staging_root
from tests.e2e.test_l2_slurm import JOB_DEADLINE_S, job_file, sbatch
from tests.slurm_cluster import Cluster, rerun_after_a_crash, wait_job

pytestmark = pytest.mark.slurm


@rerun_after_a_crash
def test_kill_9_of_ranks_and_daemons_leaves_no_staging_on_the_nodes(slurm_cluster: Cluster, tmp_path: Path):
    """Once both nodes hold staged slots, every rank and daemon is killed with SIGKILL; the daemon task's shell
    outlives its daemon and drops that node's staging (``accelpact-ckptd --drop-staging``, under the node
    directory's lock).  ``--no-requeue``: the job ends there instead of a next start whose daemons would drop the
    slots anyway.

    Negative control: with the template's daemon task running the daemon alone (no ``--drop-staging`` after it),
    both staging roots stayed after the job ended."""
    small = {"layers: 4": "layers: 1", "width: 64": "width: 32", "log_every: 50": "log_every: 500"}
    config = job_file(tmp_path, "job", steps=2000, every=2, **small)
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config, "--no-requeue")
    roots = [staging_root(node_dir(str(run_dir), n)) for n in ("node1", "node2")]
    out = tmp_path / f"accelpact-hsdp-{job_id}.out"
    deadline = time.monotonic() + JOB_DEADLINE_S
    while not all(os.path.isdir(r) and any(".slot-" in n for n in os.listdir(r)) for r in roots):
        assert time.monotonic() < deadline, "no rank staged a snapshot on both nodes"
        time.sleep(0.2)  # polling for the slots against a deadline, not synchronisation
    daemons = [int(p) for p in re.findall(r"accelpact-ckptd: serving .* \(pid (\d+)[;)]", out.read_text())]
    ranks = [e["pid"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "membership"]
    assert len(daemons) == 2 and len(ranks) == 4
    for pid in daemons + ranks:
        os.kill(pid, signal.SIGKILL)
    state = wait_job(job_id, deadline_s=JOB_DEADLINE_S, env=env)
    assert state == "FAILED", state
    assert [r for r in roots if os.path.exists(r)] == [], out.read_text()[-4000:]
