"""The torchrun drop-in end to end: examples/torchrun/train.py, a plain argparse script, under accelpact-run.

``accelpact-run --nnodes 2 --nproc-per-node 2 --checkpoint-every 5 [--inject-fault F] train.py --steps 20``: the
uninterrupted run, an L1 boundary fault (repaired in process) and a forward fault (L2: fail-stop, the launcher
relaunches every rank, the script runs again from the top and job.protect reloads the newest verified snapshot) all end with the
same final_state_digest; the script's own --steps 7 gives 7 updates (its argv reaches it; its value is the job's).
Negative controls: a job file that fixes steps: 20 against the script's --steps 7 stops with both values named
(exit 2, nothing trained), and a script that builds its own world with init_process_group is refused in one
line naming the fix.  And the same script runs under plain torchrun, unprotected.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
from pathlib import Path

import pytest

from accelpact_slurm.core.events import read_events
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.multiproc

EXAMPLE = os.path.join(REPO, "examples", "torchrun", "train.py")
SIZE = ["--nnodes", "2", "--nproc-per-node", "2"]


def _run(tmp: Path, name: str, *flags: str, script: str = EXAMPLE, script_args=("--steps", "20")) -> dict:
    run_dir = tmp / name
    proc = run_cli(["accelpact_slurm.cli.run", *SIZE, "--run-dir", str(run_dir), "--checkpoint-every", "5",
                    *flags, script, *script_args], timeout=540)
    summary = run_dir / "summary.json"
    events = run_dir / "events.jsonl"
    return {"proc": proc, "out": proc.stdout + proc.stderr,
            "events": list(read_events(events)) if events.exists() else [],
            "summary": json.loads(summary.read_text()) if summary.exists() else None}


def _side_by_side(tmp: Path, specs: dict) -> dict:
    """Two jobs at a time (each is 4 ranks and 2 daemons, and much of a job waits)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(_run, tmp, name, *flags, **kw) for name, (flags, kw) in specs.items()}
        return {name: f.result(timeout=600) for name, f in done.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    out = _side_by_side(tmp, {"base": ((), {}), "boundary": (("--inject-fault", "boundary:12:1"), {}),
                              "forward": (("--inject-fault", "forward:12:1"), {}),
                              "seven": ((), {"script_args": ("--steps", "7")})})
    for name, r in out.items():
        assert r["proc"].returncode == 0, f"{name}: {r['out'][-4000:]}"
    return out


@pytest.mark.parametrize("fault", ["boundary", "forward"])
def test_a_fault_ends_in_the_uninterrupted_runs_state(runs, fault):
    base, run = runs["base"]["summary"], runs[fault]["summary"]
    assert base["final_step"] == run["final_step"] == 20
    assert run["final_state_digest"] == base["final_state_digest"]
    kinds = [e["event"] for e in runs[fault]["events"]]
    if fault == "boundary":  # L1: repaired in process, no restart
        assert "repair" in kinds and run["restart_count"] == 0
    else:  # L2: every rank relaunched, the script ran again from the top and protect reloaded a snapshot
        assert run["restart_count"] == 1
        loads = [e for e in runs[fault]["events"] if e["event"] == "restart_load"]
        assert loads and loads[0]["step"] in (5, 10)  # the newest snapshot verified when the fault came
        starts = [e for e in runs[fault]["events"] if e["event"] == "job_start"]
        assert [e["restart"] for e in starts] == [0, 1]  # init() announced each start with the script's steps
        assert all(e["config"]["steps"] == 20 for e in starts)


def test_the_scripts_own_steps_flag_is_the_jobs_length(runs):
    seven, base = runs["seven"]["summary"], runs["base"]["summary"]
    assert seven["final_step"] == 7 and len(seven["losses"]) == 7
    assert seven["losses"] == base["losses"][:7]  # the same training, stopped at the script's own count


def test_negative_controls_a_conflicting_job_file_and_a_world_of_the_scripts_own(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("steps: 20\n")
    own = tmp_path / "own_world.py"
    own.write_text("import torch.distributed as dist\n\ndist.init_process_group('gloo')\nprint('trained alone')\n")
    out = _side_by_side(tmp_path, {"conflict": (("--config", str(job)), {"script_args": ("--steps", "7")}),
                                   "own": ((), {"script": str(own), "script_args": ()})})
    conflict, mine = out["conflict"], out["own"]
    assert conflict["proc"].returncode == 2, conflict["out"][-3000:]
    assert "steps=7" in conflict["out"] and "steps: 20" in conflict["out"], conflict["out"][-3000:]
    assert conflict["summary"] is None and not [e for e in conflict["events"] if e["event"] == "step"]
    for r in (conflict, mine):  # a start that stopped before (or without) init() is on record all the same
        kinds = [e["event"] for e in r["events"] if e.get("rank") == 0]
        assert "job_start" in kinds and kinds.index("job_start") < kinds.index("fail_stop"), kinds
    assert mine["proc"].returncode == 2, mine["out"][-3000:]
    assert "accelpact_slurm.init(" in mine["out"] and "trained alone" not in mine["out"], mine["out"][-3000:]


def test_the_same_script_runs_under_plain_torchrun_unprotected(tmp_path):
    proc = run_cli(["torch.distributed.run", "--standalone", "--nproc-per-node", "4", EXAMPLE, "--steps", "3"],
                   timeout=300, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "training unprotected" in out and "step     3/3" in out, out[-3000:]
    assert not (tmp_path / "runs").exists()  # nothing of accelpact's ran: no run directory
