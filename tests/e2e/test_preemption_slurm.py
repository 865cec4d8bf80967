"""Preemption on the real dev cluster (2 nodes x 2 tasks, sbatch_templates/hsdp.sbatch): SIGTERM takes the USR2 path.

How the signal is sent, and why that is what a preemption sends: at the start of a preemption's grace time
(``PreemptMode=REQUEUE``, partition ``GraceTime``) slurmctld calls ``job_signal(job, SIGCONT)`` then
``job_signal(job, SIGTERM)`` with no flags, which slurmd delivers to every task of every step and not to the
batch shell (``KILL_STEPS_ONLY``).  ``scancel --signal=CONT JOBID`` and ``scancel --signal=TERM JOBID`` make
exactly that call.  Not this: ``scancel --full`` signals the batch shell's process group, whose ``srun``
processes answer SIGTERM by SIGKILLing their tasks (a job's end, not a preemption's notice); ``scancel
--batch`` signals the batch shell alone.  Not modelled: the end of the grace time (Slurm's own SIGTERM to
everything, SIGKILL after KillWait, and its own requeue), which a job that is done in time never sees; the
dev cluster has no preemption partition.

The oracle is an uninterrupted run of the same job file on the embedded default: its ``final_state_digest``
and per-step losses.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from accelpact_slurm.core.events import read_events
from tests.e2e.test_l2_slurm import JOB_DEADLINE_S, finish, job_file, reference, restarts_seen, sbatch
from tests.slurm_cluster import Cluster, job_info, rerun_after_a_crash, wait_job

pytestmark = pytest.mark.slurm

SMALL = {"layers: 4": "layers: 1", "width: 64": "width: 32", "log_every: 50": "log_every: 500"}
STEPS = 100


def _train_until(job_id: str, run_dir: Path, env: dict, tmp_path: Path, step: int) -> int:
    """Poll the event log until the first start has committed ``step`` updates; return the highest seen."""
    deadline = time.monotonic() + JOB_DEADLINE_S
    while True:
        events = list(read_events(run_dir / "events.jsonl")) if (run_dir / "events.jsonl").exists() else []
        seen = max((e["step"] for e in events if e["event"] == "step" and e["restart"] == 0), default=0)
        if seen >= step:
            return seen
        info = job_info(job_id, env)
        if info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            log = tmp_path / f"accelpact-hsdp-{job_id}.out"
            tail = log.read_text()[-4000:] if log.exists() else ""
            pytest.fail(f"{info.get('JobState')} before update {step}: {tail}")
        assert time.monotonic() < deadline, f"the job never reached update {step}"
        time.sleep(0.2)  # polling the event log against a deadline, not synchronisation


def _scancel(env: dict, *args: str) -> None:
    subprocess.run(["scancel", *args], env=env, check=True, timeout=30)


@rerun_after_a_crash
def test_preemption_sigterm_snapshots_at_the_next_boundary_requeues_and_completes(slurm_cluster: Cluster,
                                                                                  tmp_path: Path):
    """SIGCONT + SIGTERM to every task, as a preemption's grace time begins: the ranks snapshot at the next
    committed boundary (their daemons serve on through the SIGTERM), rank 0 requeues the still running job, every
    rank exits 75, and the next start reloads that snapshot and ends with the uninterrupted run's digest.
    There are no periodic snapshots (every_steps 0): the only snapshot is the preemption's.

    Negative controls: with SIGTERM's default action in the ranks (``stop_signals`` without SIGTERM) the ranks
    died at once, the template requeued a crash and the next start trained from update 0 (no SIGTERM fail-stop,
    no snapshot); with the daemons stopping on SIGTERM (no ``--keep-serving-on-sigterm``) the snapshot was never
    committed."""
    config = job_file(tmp_path, "job", steps=STEPS, every=0, **SMALL)
    ref = reference(tmp_path, job_file(tmp_path, "ref", steps=STEPS, every=0, **SMALL))
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config)
    seen = _train_until(job_id, run_dir, env, tmp_path, 20)
    _scancel(env, "--signal=CONT", job_id)
    _scancel(env, "--signal=TERM", job_id)
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED", info
    assert int(info.get("Restarts", 0)) == 1 and restarts_seen(events) == {0, 1}

    stops = [e for e in events if e["event"] == "fail_stop" and e["restart"] == 0]
    assert stops and all("SIGTERM received" in e["reason"] and e["exit_code"] == 75 for e in stops), stops[:1]
    snap = stops[0]["frontier"]
    # The next committed boundary: after what the first start had committed when the signal came, and its last.
    first_steps = [e["step"] for e in events if e["event"] == "step" and e["restart"] == 0]
    assert seen <= snap == max(first_steps) < STEPS
    assert any(e["event"] == "checkpoint" and e.get("step") == snap and e.get("state") in ("committed", "verified")
               and e["ts"] <= stops[0]["ts"] for e in events)
    # Requeued once, by rank 0 (the job still ran); the batch script did not requeue it again.
    requeues = [e for e in events if e["event"] == "requeue"]
    assert [(e["by"], e["accepted"]) for e in requeues] == [("scontrol", True)], requeues
    loads = [e for e in events if e["event"] == "restart_load" and e["restart"] == 1]
    assert loads and loads[0]["step"] == snap
    assert summary["final_state_digest"] == ref["final_state_digest"]
    assert summary["losses"] == ref["losses"]


@rerun_after_a_crash
def test_a_plain_scancel_still_ends_the_job_for_good(slurm_cluster: Cluster, tmp_path: Path):
    """A plain ``scancel`` (SIGTERM to the batch shell and every step, SIGKILL after KillWait) ends the job
    CANCELLED: nobody requeues it, though the batch script now outlives its SIGTERM and the ranks take SIGTERM
    for a preemption's notice.  Within KillWait the ranks often reach a boundary, snapshot and stop with 75; rank
    0 then finds the job COMPLETING and does not ask for the requeue (Slurm would accept one for a completing
    job).  Ranks killed first leave the batch script a killed step, which it does not requeue after its own
    SIGTERM.

    Negative controls (each: the cancelled job came back and ran to COMPLETED): rank 0 without the job-state
    check (``requeue_after_sigterm`` always yes) requeued it; ranks that die at SIGTERM with the template's
    check of its own SIGTERM removed: the batch script requeued the killed step as a crash."""
    config = job_file(tmp_path, "job", steps=STEPS, every=0, **SMALL)
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config)
    _train_until(job_id, run_dir, env, tmp_path, 5)
    _scancel(env, job_id)
    state = wait_job(job_id, deadline_s=JOB_DEADLINE_S, env=env)
    log = tmp_path / f"accelpact-hsdp-{job_id}.out"
    assert state == "CANCELLED", log.read_text()[-4000:] if log.exists() else state
    assert job_info(job_id, env).get("Restarts") == "0"
    events = list(read_events(run_dir / "events.jsonl"))
    assert not [e for e in events if e["event"] == "requeue" and e.get("accepted") is not False]
    assert restarts_seen(events) == {0}
