"""A checkpoint daemon SIGKILLed mid-job is started again by the launcher, and its node snapshots to the end.

Real ranks (2 emulated nodes x 2, FSDP, Gloo), real daemons, a real ``kill -9`` of node2's daemon after its first
snapshot was handed to it; the job must end with the uninterrupted run's digest AND node2's final snapshot verified.
No sleeps: every wait polls against a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ckpt_service.index import scan
from tests.conftest import REPO, wait_for

pytestmark = pytest.mark.multiproc

CONFIG = """
name: restart
entry: {entry}
seed: 1234
steps: 12
log_every: 1
topology: {{nodes: 2, ranks_per_node: 2}}
checkpoint: {{every_steps: 3, keep_last: 2}}
timeouts: {{collective_s: 3, control_s: 20, startup_s: 60, shutdown_s: 5}}
recovery: {{max_restarts: 0}}
params: {{fsdp: fsdp1, mesh: device_mesh, layers: 2, width: 16, heads: 4, vocab: 64, seq_len: 16, dropout: 0.1,
          sequences: 10000, batch_per_rank: 2, lr: 0.003, min_lr: 0.0003, warmup_steps: 2, weight_decay: 0.01}}
"""
ENTRY = os.path.join(REPO, "examples", "decoder", "train_decoder.py") + ":main"


def _events(run_dir):
    from accelpact_slurm.core.events import read_events

    path = os.path.join(run_dir, "events.jsonl")
    return read_events(path) if os.path.exists(path) else []


def _start(config, run_dir):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", config, "--run-dir", str(run_dir)],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _digest(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as fh:
        return json.load(fh)["final_state_digest"]


def _verified(ndir):
    return {r.step for r in scan(str(ndir)) if r.state == "verified"}


def test_a_killed_daemon_is_restarted_and_its_node_snapshots_to_the_end(tmp_path):
    """node2's daemon is SIGKILLed once update 4 is committed (snapshot 3 handed to it; 6, 9, 12 to come): the
    launcher notices its exit (poll, at its supervision tick), writes a ``ckptd_restarted`` event (node2, the old
    pid, exit status -9) and starts a new daemon on node2's directory; the ranks' next hand-over reaches it.  The
    job ends with the uninterrupted run's digest, and node2's final snapshot (update 12) is verified, as node1's.

    Negative control: without the restart (the ``tick`` that calls ``restart_exited`` left out of
    ``launch/local.py``'s ``_supervise`` call) the job still ends bitwise but node2 has no verified snapshot at all
    (killed during the write of 3, nothing after it): "node2's final snapshot is not verified: []"."""
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG.format(entry=ENTRY))
    ref, rd = tmp_path / "ref", tmp_path / "run"
    proc = _start(str(config), ref)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]

    ndir = rd / "node-local" / "node2"
    job = _start(str(config), rd)
    try:
        # update 4 committed: snapshot 3 handed over (being written, or done); 6, 9 and 12 still to come
        wait_for(lambda: any(e.get("event") == "step" and e["step"] >= 4 for e in _events(rd))
                 or job.poll() is not None, 180, "update 4 committed")
        assert job.poll() is None, "the job ended before the daemon could be killed"
        pid = int((ndir / "ckptd.lock").read_text().strip())
        steps = [e["step"] for e in _events(rd) if e.get("event") == "step"]
        os.kill(pid, signal.SIGKILL)
        out, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=30)
    assert max(steps) < 12, f"the kill came after the last update ({steps}): nothing left to snapshot"
    assert job.returncode == 0, out[-3000:]
    assert _digest(rd) == _digest(ref), "the run with a killed daemon does not end bitwise"
    assert 12 in _verified(ndir), f"node2's final snapshot is not verified: {sorted(_verified(ndir))}"
    assert 12 in _verified(rd / "node-local" / "node1")
    restarted = [e for e in _events(rd) if e.get("event") == "ckptd_restarted"]
    assert [(e["hostname"], e["old_pid"], e["exit_status"], e["count"]) for e in restarted] == \
        [("node2", pid, -signal.SIGKILL, 1)], restarted
    new_pid = restarted[0]["pid"]
    assert new_pid and new_pid != pid
    final = [e for e in _events(rd) if e.get("event") == "saved" and e.get("trigger") == "final"]
    assert final and final[-1]["verified"] is True, final
    written = [e for e in _events(rd) if e.get("event") == "checkpoint" and e.get("hostname") == "node2"
               and e.get("state") == "verified" and e["step"] > 3]
    assert written, "no snapshot of node2 after the kill was verified"
    assert not [n for n in os.listdir(ndir) if n.startswith((".tmp-", ".del-"))]
