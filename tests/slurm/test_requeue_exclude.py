"""A requeue after a node was lost whole keeps the job off that node (``slurm.requeue.requeue_excluding``), on the
real dev cluster: a running job's ``ExcNodeList`` cannot be changed (the negative control: Slurm refuses it), so the
job is requeued held, its excluded hosts widened, and released.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from accelpact_slurm.slurm.requeue import excluded_nodes, request_requeue
from tests.slurm_cluster import Cluster, job_info, submit


def test_the_excluded_hosts_are_read_from_scontrol_s_line():
    assert excluded_nodes("JobId=7 ExcNodeList=node[2-3],gpu1 NodeList=node1") == ["node2", "node3", "gpu1"]
    assert excluded_nodes("JobId=7 ExcNodeList=(null) NodeList=node1") == []
    assert excluded_nodes("JobId=7 NodeList=node1") == []


def _in(state: str, job_id: str, env: dict, deadline_s: float = 60.0) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        info = job_info(job_id, env)
        if info.get("JobState") == state:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.2)


@pytest.mark.slurm
def test_a_requeue_excluding_a_lost_node_keeps_the_job_off_it(slurm_cluster: Cluster, tmp_path):
    script = tmp_path / "sleep.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    env = dict(slurm_cluster.env)
    job_id = submit(script, [], env, ["--requeue", "--nodes=1", "--ntasks=1", "--exclude=node1"], cwd=tmp_path)
    try:
        _in("RUNNING", job_id, env)
        # the negative control: the plain update of a running job is refused, so a requeue alone would not do
        plain = subprocess.run(["scontrol", "update", f"JobId={job_id}", "ExcNodeList=node2"], env=env,
                               capture_output=True, text=True, timeout=30)
        assert plain.returncode != 0 and job_info(job_id, env).get("ExcNodeList") == "node1"
        assert request_requeue(job_id, "node 1 lost (every rank of it gone: 2, 3)", None, env, emulated=False,
                               exclude=["node2"])
        info = _in("PENDING", job_id, env)  # after its COMPLETING
        assert excluded_nodes(f"ExcNodeList={info['ExcNodeList']}") == ["node1", "node2"]  # widened, not replaced
        assert info["Restarts"] == "1" and info["JobState"] == "PENDING", info
        assert "held" not in info.get("Reason", "") and info.get("Priority") != "0", info  # released
    finally:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
