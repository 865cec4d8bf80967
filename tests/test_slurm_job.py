"""The reference job through sbatch_templates/hsdp.sbatch on the real dev cluster (2 nodes x 2 tasks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from accelpact_slurm.core.events import read_events
from tests.conftest import REPO
from tests.slurm_cluster import Cluster, submit, wait_job

pytestmark = pytest.mark.slurm

TEMPLATE = Path(REPO) / "sbatch_templates" / "hsdp.sbatch"


def test_reference_job_completes_with_four_ranks_on_two_nodes(slurm_cluster: Cluster, tmp_path: Path):
    config = tmp_path / "job.yaml"
    config.write_text(Path(REPO, "examples", "tiny.yaml").read_text().replace("steps: 25", "steps: 6"))
    run_dir = tmp_path / "run dir"
    env = dict(slurm_cluster.env)
    env["ACCELPACT_PYTHON"] = sys.executable
    env["PYTHONPATH"] = REPO
    job_id = submit(TEMPLATE, [str(config), str(run_dir)], env, ["--nodes=2", "--ntasks-per-node=2"], cwd=tmp_path)
    state = wait_job(job_id, deadline_s=300, env=env)
    out = (tmp_path / f"accelpact-hsdp-{job_id}.out").read_text()
    assert state == "COMPLETED", out[-4000:]
    events = list(read_events(run_dir / "events.jsonl"))
    members = sorted((e["rank"], e["hostname"]) for e in events if e["event"] == "membership")
    assert members == [(0, "node1"), (1, "node1"), (2, "node2"), (3, "node2")]
    start = next(e for e in events if e["event"] == "job_start")
    assert start["job_id"] == job_id and start["world_size"] == 4 and start["hostnames"] == ["node1", "node2"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 6 and summary["world_size"] == 4 and summary["nodes"] == 2
    assert "final_state_digest" in out
