"""The reference job through sbatch_templates/hsdp.sbatch on the real dev cluster (2 nodes x 2 tasks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from accelpact_slurm.core.events import read_events
from tests.conftest import DECODER_JOB, REPO, VISION_JOB, job_text, run_cli
from tests.slurm_cluster import Cluster, rerun_after_a_crash, submit, wait_job

pytestmark = pytest.mark.slurm

TEMPLATE = Path(REPO) / "sbatch_templates" / "hsdp.sbatch"


def _job(tmp_path: Path, example: str) -> Path:
    """The example's job file, shortened, snapshots every 4 updates, 3 s collective timeout."""
    text = job_text(VISION_JOB if example == "vision" else DECODER_JOB)
    lines = []
    for line in text.splitlines():
        if line.startswith("steps:"):
            line = "steps: 8"
        elif line.strip().startswith("every_steps:"):
            line = "  every_steps: 4"
        elif line.strip().startswith("collective_s:"):
            line = "  collective_s: 3"
        lines.append(line)
    path = tmp_path / f"{example}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("example", ["decoder", "vision"])
@rerun_after_a_crash
def test_example_through_the_template_repairs_a_fault_and_matches_the_embedded_default(
        slurm_cluster: Cluster, tmp_path: Path, example: str):
    """Each example, through sbatch on 2 nodes x 2 tasks, with an L1 boundary fault after update 5, ends in the
    state of the same job run uninterrupted on the embedded default (same math: same digest)."""
    config = _job(tmp_path, example)
    local = run_cli(["accelpact_slurm.cli.run", str(config), "--run-dir", str(tmp_path / "local")])
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    run_dir = tmp_path / "run dir"
    env = dict(slurm_cluster.env)
    env["ACCELPACT_PYTHON"] = sys.executable
    env["PYTHONPATH"] = REPO
    config.write_text(config.read_text().replace("faults: []", "faults: [boundary:5:1]"))
    job_id = submit(TEMPLATE, [str(config), str(run_dir)], env, ["--nodes=2", "--ntasks-per-node=2"], cwd=tmp_path)
    state = wait_job(job_id, deadline_s=300, env=env)
    out = (tmp_path / f"accelpact-hsdp-{job_id}.out").read_text()
    assert state == "COMPLETED", out[-4000:]
    events = list(read_events(run_dir / "events.jsonl"))
    members = sorted((e["rank"], e["hostname"]) for e in events if e["event"] == "membership")
    assert members == [(0, "node1"), (1, "node1"), (2, "node2"), (3, "node2")]
    start = next(e for e in events if e["event"] == "job_start")
    assert start["job_id"] == job_id and start["world_size"] == 4 and start["hostnames"] == ["node1", "node2"]
    repairs = [e for e in events if e["event"] == "repair"]
    assert len(repairs) == 1, ([(e["event"], e.get("rank"), e.get("step")) for e in events][-40:], out[-3000:])
    (repair,) = repairs
    assert repair["frontier"] == 5 and repair["decision"] == "preserve"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 8 and summary["world_size"] == 4 and summary["nodes"] == 2
    reference = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert summary["final_state_digest"] == reference["final_state_digest"]
    assert "final_state_digest" in out
    # rank 0's lines carry its label (srun --label), as the embedded default's and submitit's do
    assert f"0: [accelpact] final_state_digest {summary['final_state_digest']}" in out.splitlines()
