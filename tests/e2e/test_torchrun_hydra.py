"""The torchrun drop-in with a Hydra script: examples/torchrun/train_hydra.py under accelpact-run.

``accelpact-run --nnodes 2 --nproc-per-node 2 --checkpoint-every 5 [--inject-fault F] train_hydra.py steps=20``:
every rank runs the ``@hydra.main`` function with the script's own overrides; the uninterrupted run and an L1
boundary fault end with the same final_state_digest; ``steps=7`` gives 7 updates, and the job's steps and seed are
the Hydra config's (the package's ``init(steps=cfg.steps, seed=cfg.seed)``), also when Hydra changes the working
directory (``hydra.job.chdir=true``) and writes its outputs there.  A job file that fixes another seed stops the
job with both values named (exit 2): the launcher runs the script with ``HYDRA_FULL_ERROR=1``; the negative
control (``HYDRA_FULL_ERROR=0``) shows that without it Hydra turns that error into an exit 1 of the script, and
the job into a training-code stop (76) that names nothing.  The plain original runs under real torchrun.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import pytest
import yaml

from accelpact_slurm.core.events import read_events
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.multiproc

HERE = os.path.join(REPO, "examples", "torchrun")
EXAMPLE = os.path.join(HERE, "train_hydra.py")
PLAIN = os.path.join(HERE, "train_hydra_plain.py")
SIZE = ["--nnodes", "2", "--nproc-per-node", "2"]
CONF = yaml.safe_load(open(os.path.join(HERE, "conf", "config.yaml"), encoding="utf-8"))


def _hydra_installed() -> None:
    try:
        import hydra  # noqa: F401
    except ImportError:
        pytest.fail("hydra-core is not installed: pip install -e '.[hydra]' (make venv installs it)")


def _run(tmp: Path, name: str, *flags: str, overrides=("steps=20",), env=None) -> dict:
    run_dir, cwd = tmp / name, tmp / f"{name}-cwd"
    cwd.mkdir()
    proc = run_cli(["accelpact_slurm.cli.run", *SIZE, "--run-dir", str(run_dir), "--checkpoint-every", "5",
                    *flags, EXAMPLE, *overrides], timeout=540, cwd=str(cwd), env=env)
    summary, events = run_dir / "summary.json", run_dir / "events.jsonl"
    return {"proc": proc, "out": proc.stdout + proc.stderr, "cwd": cwd,
            "events": list(read_events(events)) if events.exists() else [],
            "summary": json.loads(summary.read_text()) if summary.exists() else None}


def _side_by_side(tmp: Path, specs: dict) -> dict:
    """Two jobs at a time (each is 4 ranks and 2 daemons, and much of a job waits)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(_run, tmp, name, *flags, **kw) for name, (flags, kw) in specs.items()}
        return {name: f.result(timeout=600) for name, f in done.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    _hydra_installed()
    tmp = tmp_path_factory.mktemp("hydra")
    seven = ("steps=7", "hydra.job.chdir=true", "hydra.run.dir=outputs/seven", "hydra.output_subdir=.hydra")
    out = _side_by_side(tmp, {"base": ((), {}), "boundary": (("--inject-fault", "boundary:12:1"), {}),
                              "seven": ((), {"overrides": seven})})
    for name, r in out.items():
        assert r["proc"].returncode == 0, f"{name}: {r['out'][-4000:]}"
    return out


def _started(run: dict) -> list[dict]:
    return [e for e in run["events"] if e["event"] == "job_start"]


def test_a_boundary_fault_ends_in_the_uninterrupted_runs_state(runs):
    base, run = runs["base"]["summary"], runs["boundary"]["summary"]
    assert base["final_step"] == run["final_step"] == 20
    assert run["final_state_digest"] == base["final_state_digest"]
    assert "repair" in [e["event"] for e in runs["boundary"]["events"]] and run["restart_count"] == 0
    assert "trained 20 updates" in runs["base"]["out"]  # every rank ran the decorated main to its end


def test_the_jobs_steps_and_seed_are_the_hydra_configs(runs):
    """The config file's seed (not the job's default) and the command line's steps=7 reach init()."""
    assert CONF["seed"] != 0 and CONF["steps"] == 20
    for name, steps in (("base", 20), ("seven", 7)):
        starts = _started(runs[name])
        assert starts and all(e["config"]["steps"] == steps and e["config"]["seed"] == CONF["seed"] for e in starts)
    seven, base = runs["seven"]["summary"], runs["base"]["summary"]
    assert seven["final_step"] == 7 and len(seven["losses"]) == 7
    assert seven["losses"] == base["losses"][:7]  # the same training, stopped at the config's count


def test_hydra_changing_the_working_directory_breaks_nothing(runs):
    """``hydra.job.chdir=true``: every rank ran inside Hydra's output directory (its .hydra/ record of the run
    is there, with the overrides), and the job's run directory, given relative to nothing, was not disturbed."""
    written = runs["seven"]["cwd"] / "outputs" / "seven" / ".hydra"
    assert "steps=7" in (written / "overrides.yaml").read_text()
    assert yaml.safe_load((written / "config.yaml").read_text())["steps"] == 7
    assert not (runs["base"]["cwd"] / "outputs").exists()  # the example's own config writes nothing per rank


def test_a_conflicting_seed_is_a_configuration_error_negative_control_without_full_errors(tmp_path):
    _hydra_installed()
    job = tmp_path / "job.yaml"
    job.write_text("seed: 5\n")
    flags = ("--config", str(job))
    out = _side_by_side(tmp_path, {"conflict": (flags, {"overrides": ("steps=3",)}),
                                   "hidden": (flags, {"overrides": ("steps=3",), "env": {"HYDRA_FULL_ERROR": "0"}})})
    conflict, hidden = out["conflict"], out["hidden"]
    assert conflict["proc"].returncode == 2, conflict["out"][-3000:]
    assert f"seed={CONF['seed']}" in conflict["out"] and "seed: 5" in conflict["out"], conflict["out"][-3000:]
    assert conflict["summary"] is None and not [e for e in conflict["events"] if e["event"] == "step"]
    stops = [e for e in conflict["events"] if e["event"] == "fail_stop"]
    assert stops and {e["cause"] for e in stops} == {"config"}, stops
    # Hydra's own handling of the error: the script exits 1, the job stops as if the training code had a bug
    assert hidden["proc"].returncode == 76, hidden["out"][-3000:]
    stops = [e for e in hidden["events"] if e["event"] == "fail_stop"]
    assert stops and {e["cause"] for e in stops} == {"training-code"}, stops
    assert all("exited with status 1" in e["reason"] and "seed" not in e["reason"] for e in stops), stops


def test_the_plain_original_runs_under_plain_torchrun(tmp_path):
    _hydra_installed()
    proc = run_cli(["torch.distributed.run", "--standalone", "--nproc-per-node", "4", PLAIN, "steps=3"],
                   timeout=300, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "trained 3 updates" in out, out[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no outputs/ per rank, no run directory
