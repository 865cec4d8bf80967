"""A checkpoint daemon stopped with SIGSTOP: its node skips snapshots, training goes on, and no verified
snapshot holds another step's state.

A real job on the embedded default (2 emulated nodes x 2 ranks, the tiny decoder), node2's real daemon stopped
with SIGSTOP as soon as it serves, resumed with SIGCONT once three snapshots were skipped.  The oracle: HSDP's
replicas hold the same state at every step, and node1's daemon was never stopped, so node2's snapshot of a step
must equal node1's snapshot of that step tensor for tensor.  No sleeps: every wait polls against a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ckpt_service.index import scan
from tests.conftest import REPO, wait_for

pytestmark = pytest.mark.multiproc

ENTRY = os.path.join(REPO, "examples", "decoder", "train_decoder.py") + ":main"
CONFIG = f"""
name: stop
entry: {ENTRY}
seed: 1234
steps: 24
log_every: 4
topology: {{nodes: 2, ranks_per_node: 2}}
checkpoint: {{every_steps: 2, keep_last: 30, shared_every: 0}}
timeouts: {{collective_s: 3, control_s: 8, startup_s: 60, shutdown_s: 5}}
recovery: {{max_restarts: 0}}
params: {{fsdp: fsdp1, mesh: device_mesh, layers: 2, width: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.1,
          sequences: 10000, batch_per_rank: 2, lr: 0.003, min_lr: 0.0003, warmup_steps: 2, weight_decay: 0.01}}
"""


def events(run_dir):
    try:
        with open(run_dir / "events.jsonl") as fh:
            return [json.loads(ln) for ln in fh if ln.endswith("\n")]
    except FileNotFoundError:
        return []


def daemon_pid(run_dir, node):
    try:
        m = re.search(r"accelpact-ckptd: serving .* \(pid (\d+)[;)]", (run_dir / "logs" / f"ckptd-{node}.log").read_text())
    except FileNotFoundError:
        return None
    return int(m.group(1)) if m else None


def state(pid):
    with open(f"/proc/{pid}/stat") as fh:
        s = fh.read()
    return s[s.rindex(")") + 2]


def load(step_dir, out):
    """A snapshot as stock torch reads it (one dict of tensors and plain values)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(str(out), weights_only=False)


def differences(a, b, path=""):
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [path]
    return [] if a == b else [path]


def test_a_stopped_daemon_skips_snapshots_and_every_verified_one_holds_its_step(tmp_path):
    """Negative control: on the code before the fix a silent daemon counted as "no daemon: nothing reads the slot",
    the rank restaged into slots the stopped daemon still had to write, and node2's early snapshots were
    committed and verified holding a later step's weights (or the job fail-stopped on the timeouts)."""
    (tmp_path / "job.yaml").write_text(CONFIG)
    rd = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", str(tmp_path / "job.yaml"), "--run-dir",
                            str(rd)], env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    pid = None
    try:
        pid = wait_for(lambda: daemon_pid(rd, "node2") or job.poll() is not None, 120, "node2's daemon to serve")
        assert job.poll() is None and pid is not True, "the job ended before node2's daemon served"
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: state(pid) == "T", 30, "node2's daemon to stop")
        assert not [e for e in events(rd) if e["event"] == "snapshot"], "a snapshot was taken before the stop"

        def skipped():
            return len([e for e in events(rd) if e["event"] == "snapshot" and e.get("skipped")]) >= 3 \
                or job.poll() is not None
        wait_for(skipped, 240, "three skipped snapshots")
        assert job.poll() is None, "the job ended while node2's daemon was stopped"
        os.kill(pid, signal.SIGCONT)
        out, _ = job.communicate(timeout=300)
    finally:
        if pid is not None and pid is not True:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()
            job.communicate(timeout=60)

    # training went on through the stop, to the end
    assert job.returncode == 0, out[-4000:]
    assert json.loads((rd / "summary.json").read_text())["final_step"] == 24
    evs = events(rd)
    skips = [e["step"] for e in evs if e["event"] == "snapshot" and e.get("skipped")]
    assert len(skips) >= 3, skips
    # one warning for the episode, naming the node, the step and why
    warnings = [e for e in evs if e["event"] == "warning" and "snapshot" in e["reason"]]
    assert len(warnings) == 1, warnings
    w = warnings[0]
    assert w["hostname"] == "node2" and w["step"] == skips[0], w
    assert re.search(r"the checkpoint daemon has not released slot \d .*not answering for [\d.]+ s", w["reason"]), w
    # the daemon answered again and the snapshots resumed
    resumed = [e for e in evs if e["event"] == "snapshot" and e.get("resumed")]
    assert len(resumed) == 1 and resumed[0]["resumed"][0]["hostname"] == "node2", resumed
    assert resumed[0]["step"] > skips[-1]

    # every verified snapshot holds its step: node2's equals node1's (replicas, node1 never stopped)
    n1 = {r.step: r for r in scan(str(rd / "node-local" / "node1"))}
    n2 = {r.step: r for r in scan(str(rd / "node-local" / "node2"))}
    verified2 = sorted(s for s, r in n2.items() if r.state == "verified")
    assert [s for s in verified2 if s > resumed[0]["step"] - 1], f"no snapshot on node2 after the resume: {n2}"
    for step in verified2:
        assert n1[step].state == "verified", (step, n1[step])
        a = load(n1[step].path, tmp_path / f"n1-{step}.pt")
        b = load(n2[step].path, tmp_path / f"n2-{step}.pt")
        assert json.loads(b["extra"]["json"])["run"]["step"] == step
        diff = differences(a, b)
        assert not diff, f"node2's verified snapshot {step} differs from node1's in {diff[:5]}"
    # nothing committed that is not verified or failed for a stated reason
    for step, r in n2.items():
        assert r.state in ("verified", "failed"), (step, r.state, r.reason)
