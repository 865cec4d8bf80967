"""Two jobs on one run directory at once, on the embedded default: the second stops in one line, exit 2, before
any of its ranks or daemons starts; the first completes undisturbed.  No sleeps: waits poll against a deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, run_cli, wait_for

pytestmark = pytest.mark.multiproc

ENTRY = os.path.join(REPO, "examples", "decoder", "train_decoder.py") + ":main"
CONFIG = f"""
name: lock
entry: {ENTRY}
seed: 1234
steps: 12
log_every: 4
topology: {{nodes: 2, ranks_per_node: 2}}
checkpoint: {{every_steps: 4, keep_last: 2}}
timeouts: {{collective_s: 3, control_s: 20, startup_s: 60, shutdown_s: 5}}
recovery: {{max_restarts: 0}}
params: {{fsdp: fsdp1, mesh: device_mesh, layers: 2, width: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.1,
          sequences: 10000, batch_per_rank: 2, lr: 0.003, min_lr: 0.0003, warmup_steps: 2, weight_decay: 0.01}}
"""


def test_a_second_job_on_the_same_run_dir_exits_2_in_one_line_and_the_first_completes(tmp_path):
    """Negative control: before the lock the second job started daemons (refused: the node directories are
    locked) and ranks that trained through the first job's daemons and slots, into the same event log."""
    job = tmp_path / "job.yaml"
    job.write_text(CONFIG)
    rd = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO)
    first = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", str(job), "--run-dir", str(rd)],
                             env=dict(env, ACCELPACT_LOCAL_JOB_ID="job-a"), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        # the first job is under way: its ranks have started (their logs exist), so it holds the run directory
        wait_for(lambda: (rd / "logs" / "rank-0.log").exists() or first.poll() is not None, 120,
                 "the first job's ranks")
        assert first.poll() is None, "the first job ended before the second could start"
        second = run_cli(["accelpact_slurm.cli.run", str(job), "--run-dir", str(rd)],
                         env={"ACCELPACT_LOCAL_JOB_ID": "job-b"}, timeout=120)
        running = first.poll() is None
        out, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate(timeout=60)
    assert running, "the first job had ended before the second one's verdict: the test proves nothing"
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    assert lines[0].startswith("accelpact-run: error: run dir") and str(rd) in lines[0] and "job job-a" in lines[0]
    assert "embedded default" not in second.stdout  # it never got as far as launching
    # the first job completed undisturbed, alone in the run directory
    assert first.returncode == 0, out[-4000:]
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["job_id"] == "job-a" and summary["final_step"] == 12
    events = [json.loads(ln) for ln in open(rd / "events.jsonl")]
    assert {e.get("job_id") for e in events} == {"job-a"}, {e.get("job_id") for e in events}
    assert not [e for e in events if e["event"] in ("fail_stop", "warning")
                or (e["event"] == "checkpoint" and e["state"] in ("failed", "rejected"))], events
    assert sorted(os.listdir(rd / "logs")) == sorted(["ckptd-node1.log", "ckptd-node2.log"]
                                                     + [f"rank-{r}.log" for r in range(4)])
    for node in ("node1", "node2"):  # no refused second daemon wrote into the first job's daemon logs
        assert "already serves" not in (rd / "logs" / f"ckptd-{node}.log").read_text()


def test_a_relaunch_of_the_same_job_is_not_refused(tmp_path):
    """The embedded default relaunches a fail-stopped job (restart 1) under the lock it holds: the relaunch and
    its ranks (which check the lock under the same job id) go on, and the job completes."""
    job = tmp_path / "job.yaml"
    job.write_text(CONFIG.replace("max_restarts: 0", "max_restarts: 1"))
    rd = tmp_path / "run"
    proc = run_cli(["accelpact_slurm.cli.run", str(job), "--run-dir", str(rd)],
                   env={"ACCELPACT_LOCAL_JOB_ID": "job-r", "ACCELPACT_CKPT_EXIT_AFTER_VERIFIED": "4"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "relaunching the job (restart 1)" in proc.stdout
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["restart_count"] == 1 and summary["final_step"] == 12
