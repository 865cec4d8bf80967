"""L1 on NCCL with a real fault, between two GPUs (``pytest -m multigpu``; ``scripts/gpu-check.sh`` runs it).

Two emulated nodes of one rank each, one GPU per rank (``cuda:RANK``), FSDP2 on the 2-D mesh, NCCL for the
data plane.  Rank 1 withholds its part of every replication all-reduce of update 15's backward: its peer's
NCCL all-reduce never completes, the guard's wait on the same communicator times out and raises, the vote
discards the update, every group is replaced by new NCCL communicators and rebound, and the update runs
again.  The run must end with the uninterrupted run's digest, with no restart.

Skipped, with the reason, where fewer than two GPUs are visible: one GPU cannot host two NCCL ranks
(NCCL refuses duplicate devices), and the CPU suite never needs a GPU.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.conftest import decoder_text, run_cli

pytestmark = pytest.mark.multigpu


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = _gpus()
NEED = ("needs two or more GPUs (visible: %d): one GPU cannot host two NCCL ranks, NCCL refuses duplicate devices; "
        "run scripts/gpu-check.sh on a machine with two GPUs" % GPUS)


def _job(tmp_path) -> str:
    text = decoder_text()
    text = re.sub(r"^  nodes: \d+", "  nodes: 2", text, flags=re.M)
    text = re.sub(r"^  ranks_per_node: \d+", "  ranks_per_node: 1\n  device: cuda", text, flags=re.M)
    text = re.sub(r"^  fsdp: \w+", "  fsdp: fsdp2", text, flags=re.M)
    text = re.sub(r"^  collective_s: .*", "  collective_s: 10", text, flags=re.M)
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def _events(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.mark.skipif(GPUS < 2, reason=NEED)
def test_a_backward_fault_on_nccl_is_repaired_in_process_bitwise(tmp_path):
    job = _job(tmp_path)
    plain, faulted = tmp_path / "plain", tmp_path / "faulted"
    r = run_cli(["accelpact_slurm.cli.run", job, "--run-dir", str(plain)], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # Preserve attempted for this platform's key, as accelpact-qualify's trials do.
    r = run_cli(["accelpact_slurm.cli.run", job, "--run-dir", str(faulted), "--inject-fault", "backward:15:1"],
                env={"ACCELPACT_QUALIFYING": "backward"}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    events = _events(faulted)
    start = next(e for e in events if e["event"] == "job_start")
    assert start["backend"] == "cpu:gloo,cuda:nccl" and start["device"] == "cuda:0"
    repairs = [e for e in events if e["event"] == "repair"]
    assert repairs and repairs[0]["scope"] == "update" and repairs[0]["discarded_update"] == 15
    assert not [e for e in events if e["event"] == "restart_load" and e.get("step") is not None]
    digest = lambda d: json.loads((d / "summary.json").read_text())["final_state_digest"]  # noqa: E731
    assert digest(faulted) == digest(plain)
