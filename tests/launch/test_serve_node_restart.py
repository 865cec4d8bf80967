"""The sbatch template's node task (``accelpact_slurm.cli.node serve``) starts its daemon again after a ``kill -9``.

A real ``accelpact-ckptd`` under the real node task, as the template starts it (Slurm's variables set by hand: no
cluster needed), killed with a real SIGKILL; no sleeps: every wait polls against a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.conftest import REPO, wait_for

CONFIG = """
name: serve
entry: {entry}
steps: 4
topology: {{nodes: 1, ranks_per_node: 1}}
checkpoint: {{every_steps: 2, local_dir: {local}}}
"""


def _lock_pid(ndir):
    try:
        with open(os.path.join(ndir, "ckptd.lock")) as fh:
            return int(fh.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


def _restarts(run_dir):
    from accelpact_slurm.core.events import read_events

    path = os.path.join(run_dir, "events.jsonl")
    return [e for e in read_events(path) if e.get("event") == "ckptd_restarted"] if os.path.exists(path) else []


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_node_task_restarts_a_killed_daemon_and_not_a_stopped_one(tmp_path):
    """kill -9 of the node's daemon: the node task writes ``ckptd_restarted`` (the node, the old pid, -9) and a new
    daemon serves the same node directory (its pid in ``ckptd.lock``); SIGINT, the template's stop, ends the new
    one and the task with exit 0 and no second restart.

    Negative control: with the restart loop of ``serve_node`` left out, the task ends with its daemon ("the node
    task ended with its daemon (exit 137)"): the node would serve no snapshot for the rest of the job."""
    local = tmp_path / "nvme"
    config = tmp_path / "job.yaml"
    config.write_text(CONFIG.format(entry=os.path.join(REPO, "examples", "decoder", "train_decoder.py") + ":main",
                                    local=local))
    rd = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO, SLURMD_NODENAME="n1", SLURM_NODEID="0", SLURM_JOB_ID="77",
               SLURM_JOB_NUM_NODES="1", SLURM_RESTART_COUNT="0")
    task = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.node", "serve", str(config), "--run-dir",
                             str(rd)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ndir = local / "n1"
    try:
        first = wait_for(lambda: _lock_pid(ndir), 120, "the first daemon's lock")
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: ((p := _lock_pid(ndir)) and p != first and _alive(p) and p) or task.poll() is not None,
                          120, "a new daemon")
        assert task.poll() is None, f"the node task ended with its daemon (exit {task.returncode})"
        (ev,) = wait_for(lambda: _restarts(rd), 30, "the ckptd_restarted event")
        assert (ev["hostname"], ev["old_pid"], ev["exit_status"], ev["pid"], ev["count"]) == \
            ("n1", first, -signal.SIGKILL, second, 1), ev
        # the template stops its daemons with SIGINT, which reaches every process of the step: no restart after it
        task.send_signal(signal.SIGINT)
        os.kill(second, signal.SIGINT)
        out, _ = task.communicate(timeout=120)
    finally:
        if task.poll() is None:
            task.kill()
            task.wait(timeout=30)
    assert task.returncode == 0, out[-3000:]
    assert len(_restarts(rd)) == 1 and not _alive(second)
