"""The torchrun form on Slurm: examples/torchrun/train.py with its own arguments and no job file, under the sbatch
template on the dev cluster (2 nodes x 2 tasks) and through accelpact-submit (submitit's local executor).

The oracle is the same script on the embedded default, ``accelpact-run --nnodes 2 --nproc-per-node 2 train.py
--steps 9``.  Two template jobs run side by side (one module fixture): one uninterrupted, one with an L1 boundary
fault after update 4 (repaired in process) and an L2 forward fault in update 7 (fail-stop: rank 0 asks Slurm for
the requeue, the template's second start runs the same script with the same arguments, and ``job.protect``
reloads snapshot 6).  Each ends after 9 updates with the oracle's ``final_state_digest``: the updates are the
script's own ``--steps 9`` (its default is 20, so arguments that did not reach every rank, on either start, end
after 20 updates with another digest; tests/slurm/test_hsdp_template.py removes the template's hand-over of the
arguments and sees them lost).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelpact_slurm.core.events import read_events
from tests.conftest import REPO, run_cli
from tests.slurm_cluster import HSDP_TEMPLATE, Cluster, again_after_a_crash, submit, wait_job

EXAMPLE = os.path.join(REPO, "examples", "torchrun", "train.py")
STEPS = 9
SIZES = ["--nodes=2", "--ntasks-per-node=2"]
JOB_DEADLINE_S = 300
#: The template's flags of each job (accelpact-run's, before the script); the script's own come after it.
JOBS = {"uninterrupted": (),
        "faults": ("--checkpoint-every", "3", "--inject-fault", "boundary:4:1", "--inject-fault", "forward:7:2")}


def _run(run_dir: Path) -> dict:
    events = run_dir / "events.jsonl"
    summary = run_dir / "summary.json"
    return {"events": list(read_events(events)) if events.exists() else [],
            "summary": json.loads(summary.read_text()) if summary.exists() else None}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run on the embedded default: its summary."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = run_cli(["accelpact_slurm.cli.run", "--nnodes", "2", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                    EXAMPLE, "--steps", str(STEPS)], timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = _run(run_dir)["summary"]
    assert summary is not None and summary["final_step"] == STEPS
    return summary


@pytest.fixture(scope="module")
def template_jobs(slurm_cluster: Cluster, reference, tmp_path_factory) -> dict:
    """Both template jobs (after the reference: one multi-process job at a time on this machine, then the two
    Slurm jobs side by side), each as ``{state, out, events, summary, run_dir}``."""
    env = {**slurm_cluster.env, "ACCELPACT_PYTHON": sys.executable, "PYTHONPATH": REPO}

    def both() -> dict:
        tmp = tmp_path_factory.mktemp("template")
        ids = {name: submit(HSDP_TEMPLATE, [*flags, EXAMPLE, "--steps", str(STEPS)], env, SIZES, cwd=tmp)
               for name, flags in JOBS.items()}
        out = {}
        for name, job_id in ids.items():
            state = wait_job(job_id, deadline_s=JOB_DEADLINE_S, env=env)
            log = tmp / f"accelpact-hsdp-{job_id}.out"
            run_dir = tmp / "runs" / job_id  # the template's default: $SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID
            out[name] = {"state": state, "out": log.read_text() if log.exists() else "", "run_dir": run_dir,
                         **_run(run_dir)}
            assert state == "COMPLETED", f"{name}: {out[name]['out'][-4000:]}"
        return out

    return again_after_a_crash(slurm_cluster, both)


@pytest.mark.slurm
@pytest.mark.parametrize("name", list(JOBS))
def test_the_script_under_the_template_ends_in_the_embedded_defaults_state(template_jobs, reference, name):
    job = template_jobs[name]
    summary, events = job["summary"], job["events"]
    assert summary["final_step"] == STEPS and summary["losses"] == reference["losses"]
    assert summary["final_state_digest"] == reference["final_state_digest"]
    assert sorted((e["rank"], e["hostname"]) for e in events if e["event"] == "membership" and
                  e["restart"] == summary["restart_count"]) == [(0, "node1"), (1, "node1"), (2, "node2"),
                                                                 (3, "node2")]
    entry = [ln for ln in (job["run_dir"] / "script-job.yaml").read_text().splitlines() if ln.startswith("entry:")]
    assert entry == [f"entry: {EXAMPLE}:__main__"]  # no job file given: the template wrote the effective one
    starts = [e for e in events if e["event"] == "job_start"]
    assert all(e["config"]["steps"] == STEPS for e in starts)  # every start ran the script with its --steps 9
    kinds = [e["event"] for e in events]
    if name == "uninterrupted":
        assert summary["restart_count"] == 0 and "repair" not in kinds and "fail_stop" not in kinds
        return
    (repair,) = [e for e in events if e["event"] == "repair"]  # L1: in process, on the first start
    assert (repair["restart"], repair["frontier"], repair["decision"]) == (0, 4, "preserve")
    assert [e["restart"] for e in starts] == [0, 1] and summary["restart_count"] == 1  # L2: Slurm requeued it
    assert [e for e in events if e["event"] == "requeue" and e["restart"] == 0]
    assert [(e["restart"], e["step"]) for e in events if e["event"] == "restart_load"] == [(1, 6)]
    assert "hsdp.sbatch: job" in job["out"] and " restart 1 on " in job["out"]


@pytest.mark.multiproc
def test_submitit_runs_the_script_with_its_own_arguments(reference, tmp_path):
    """``accelpact-submit --local ... train.py --steps 9``: no job file; every task runs the script with its
    arguments, and the job ends with the oracle's digest after 9 updates."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, "-m", "accelpact_slurm.cli.submit", "--local", "--wait", "--wait-timeout",
                           "240", "--run-dir", str(run_dir), EXAMPLE, "--steps", str(STEPS)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = _run(run_dir)["summary"]
    assert summary["final_step"] == STEPS and summary["world_size"] == 4
    assert summary["final_state_digest"] == reference["final_state_digest"]
    assert f"final_state_digest {reference['final_state_digest']}" in proc.stdout
    assert f"entry: {EXAMPLE}:__main__" in (run_dir / "script-job.yaml").read_text().splitlines()
