"""accelpact-run on the embedded default: real local ranks, real FSDP HSDP over Gloo.

Each run costs a few seconds of 4 processes on 2 cores, so the runs are shared
between assertions through module-scoped fixtures.
"""

from __future__ import annotations

import json
import os

import pytest

from accelpact_slurm.core.events import read_events
from tests.conftest import decoder_text, run_cli

pytestmark = pytest.mark.multiproc

TINY = "examples/decoder/job.yaml"
STEPS = 8


def _run(run_dir, *extra, config=TINY):
    proc = run_cli(["accelpact_slurm.cli.run", config, "--run-dir", str(run_dir), "--steps", str(STEPS), *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as fh:
        return proc, json.load(fh)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return {
        "a": _run(base / "a"),
        "b": _run(base / "b"),
        "seed": _run(base / "seed", "--seed", "99"),
        "dir": base,
    }


def test_same_seed_same_digest_other_seed_differs(runs):
    (_, a), (_, b), (_, c) = runs["a"], runs["b"], runs["seed"]
    assert a["final_state_digest"] == b["final_state_digest"]
    assert a["losses"] == b["losses"]
    assert c["final_state_digest"] != a["final_state_digest"]


def test_summary_and_progress(runs):
    proc, s = runs["a"]
    assert s["final_step"] == STEPS and len(s["losses"]) == STEPS
    assert s["final_loss"] == s["losses"][-1] and s["wall_s"] > 0
    assert len(s["final_state_digest"]) == 64
    assert "step     5/8" in proc.stdout and "ms/update" in proc.stdout
    assert "final_state_digest" in proc.stdout
    assert s["losses"][-1] < s["losses"][0]  # it learns


def test_event_log(runs):
    events = list(read_events(runs["dir"] / "a" / "events.jsonl"))
    kinds = [e["event"] for e in events]
    assert kinds[0] in ("job_start", "membership") and kinds[-1] == "job_end"
    start = next(e for e in events if e["event"] == "job_start")
    assert start["config"]["steps"] == STEPS and start["world_size"] == 4
    members = sorted((e["rank"], e["node"], e["local_rank"]) for e in events if e["event"] == "membership")
    assert members == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    end = events[-1]
    assert end["final_state_digest"] == json.load(open(runs["dir"] / "a" / "summary.json"))["final_state_digest"]


@pytest.mark.parametrize("fsdp, mesh", [("fsdp1", "group_pair"), ("fsdp2", "device_mesh")])
def test_other_wrappings_train_to_the_same_state(runs, tmp_path, fsdp, mesh):
    text = decoder_text()
    text = text.replace("fsdp: fsdp1 ", f"fsdp: {fsdp} ").replace("mesh: device_mesh ", f"mesh: {mesh} ")
    cfg = tmp_path / "variant.yaml"
    cfg.write_text(text)
    _, s = _run(tmp_path / "run", config=str(cfg))
    start = next(e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "job_start")
    assert (start["config"]["params"]["fsdp"], start["config"]["params"]["mesh"]) == (fsdp, mesh)
    # Same math, same seed: every wrapping ends in the same training state.
    assert s["final_state_digest"] == runs["a"][1]["final_state_digest"]
