"""End to end on the real Slurm dev cluster: scripts/dev-cluster.sh and sbatch_templates/hsdp.sbatch.

The training module is replaced by a stand-in (``ACCELPACT_RUN_MODULE``) that records, per task, its rank, its
node and the arguments it was given, so these tests check the template and the cluster, not the runtime.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.slurm_cluster import (  # noqa: F401,F811  (slurm_cluster is a fixture)
    HSDP_TEMPLATE,
    POLL_S,
    Cluster,
    completion_records,
    job_info,
    rerun_after_a_crash,
    submit,
    wait_job,
    watchdog_of,
)

pytestmark = pytest.mark.slurm

JOB_DEADLINE_S = 60.0
SIZES = ["--nodes=2", "--ntasks-per-node=2"]
STANDIN_MODULE = "accelpact_standin_run"

# Stands in for accelpact_slurm.cli.worker (the ranks): same command line, writes rank-<SLURM_PROCID>.json into the run dir.
# With STANDIN_WAIT_USR2=SECONDS it first writes its ready marker (as accelpact_slurm.slurm.signals.mark_ready does)
# and waits (bounded) for SIGUSR2; STANDIN_LATE_S=SECONDS delays installing its handler (a slow import).
STANDIN_SOURCE = '''\
import argparse, json, os, signal, socket, sys, time

parser = argparse.ArgumentParser()
parser.add_argument("config")
parser.add_argument("--run-dir", required=True)
args = parser.parse_args()
rank = os.environ["SLURM_PROCID"]
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
time.sleep(float(os.environ.get("STANDIN_LATE_S", "0")))  # still without a USR2 handler: the default kills
got_usr2 = []
signal.signal(signal.SIGUSR2, lambda *_: got_usr2.append(time.monotonic()))
wait_s = float(os.environ.get("STANDIN_WAIT_USR2", "0"))
if wait_s:  # the accelpact_slurm.slurm.signals.mark_ready protocol: marker first, then the request file
    os.makedirs(os.path.join(args.run_dir, ".ready"), exist_ok=True)
    open(os.path.join(args.run_dir, ".ready", f"{restart}-{rank}"), "w").close()
    if os.path.exists(os.path.join(args.run_dir, f".stop-requested-{restart}")):
        got_usr2.append(-1.0)
    deadline = time.monotonic() + wait_s
    while not got_usr2 and time.monotonic() < deadline:
        time.sleep(0.05)
record = {
    "rank": int(rank),
    "node": os.environ["SLURMD_NODENAME"],
    "node_id": int(os.environ["SLURM_NODEID"]),
    "ntasks": int(os.environ["SLURM_NTASKS"]),
    "hostname": socket.gethostname(),
    "argv": sys.argv[1:],
    "config_text": open(args.config).read(),
    "usr2": bool(got_usr2),
    "usr2_by_file": got_usr2[:1] == [-1.0],
}
with open(os.path.join(args.run_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(record, f)
'''


@pytest.fixture
def standin_env(slurm_cluster: Cluster, tmp_path: Path) -> dict[str, str]:
    """The cluster's client environment, with the template pointed at the stand-in module."""
    mods = tmp_path / "standin-modules"
    mods.mkdir()
    (mods / f"{STANDIN_MODULE}.py").write_text(STANDIN_SOURCE)
    return {
        **slurm_cluster.env,
        # the stand-in first; then this tree, for the template's own hooks (python -m accelpact_slurm.cli.node)
        "PYTHONPATH": os.pathsep.join([str(mods), REPO]),
        "ACCELPACT_RUN_MODULE": STANDIN_MODULE,
        "ACCELPACT_PYTHON": sys.executable,
    }


def _write_config(directory: Path, name: str = "job.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / name
    config.write_text("steps: 1\n")
    return config


def _ranks(run_dir: Path) -> dict[int, dict]:
    return {
        record["rank"]: record
        for record in (json.loads(p.read_text()) for p in sorted(run_dir.glob("rank-*.json")))
    }


def _job_log(submit_dir: Path, job_id: str) -> str:
    log = submit_dir / f"accelpact-hsdp-{job_id}.out"
    return log.read_text() if log.exists() else f"(no {log})"


def _assert_four_ranks_on_two_nodes(ranks: dict[int, dict], config: Path, run_dir: Path) -> None:
    assert sorted(ranks) == [0, 1, 2, 3]
    per_node: dict[str, list[int]] = {}
    for rank, record in ranks.items():
        per_node.setdefault(record["node"], []).append(rank)
        assert record["ntasks"] == 4
        # The exact paths arrive as one argument each, whatever characters they hold.
        assert record["argv"] == [str(config), "--run-dir", str(run_dir)]
        assert record["config_text"] == "steps: 1\n"
    assert {node: sorted(r) for node, r in per_node.items()} == {"node1": [0, 1], "node2": [2, 3]}


@rerun_after_a_crash
def test_hsdp_template_runs_four_ranks_over_two_nodes(slurm_cluster: Cluster, standin_env, tmp_path: Path):
    submit_dir = tmp_path / "submit"
    config = _write_config(submit_dir)

    # CONFIG relative to the submission dir, RUN_DIR left to its default.
    job_id = submit(HSDP_TEMPLATE, ["job.yaml"], standin_env, SIZES, cwd=submit_dir)
    state = wait_job(job_id, JOB_DEADLINE_S, standin_env)

    assert state == "COMPLETED", _job_log(submit_dir, job_id)
    run_dir = submit_dir / "runs" / job_id
    _assert_four_ranks_on_two_nodes(_ranks(run_dir), config, run_dir)
    info = job_info(job_id, standin_env)
    assert (info["NumNodes"], info["NumTasks"], info["NodeList"], info["ExitCode"]) == ("2", "4", "node[1-2]", "0:0")
    assert info["Requeue"] == "1"  # from '#SBATCH --requeue'
    assert info["StdOut"] == str(submit_dir / f"accelpact-hsdp-{job_id}.out")
    assert "training step exited with status 0" in _job_log(submit_dir, job_id)
    [record] = completion_records(job_id, standin_env)
    assert (record["State"], record["NodeList"], record["ExitCode"]) == ("COMPLETED", "node[1-2]", "0:0")


@rerun_after_a_crash
def test_hsdp_template_survives_hostile_paths(slurm_cluster: Cluster, standin_env, tmp_path: Path):
    # submitit's weird_tmp_path: a quote that would end a shell string, a command after it, a newline.
    submit_dir = tmp_path / "sub 'a'; echo foo\nbar"
    config = _write_config(submit_dir, "my 'job'.yaml")
    run_dir = tmp_path / "run dir 'q'\n$(touch pwned)"

    job_id = submit(HSDP_TEMPLATE, [str(config), str(run_dir)], standin_env, SIZES, cwd=submit_dir)
    state = wait_job(job_id, JOB_DEADLINE_S, standin_env)

    assert state == "COMPLETED", _job_log(submit_dir, job_id)
    _assert_four_ranks_on_two_nodes(_ranks(run_dir), config, run_dir)
    # nothing else appeared beside the two (the stand-in's modules lie in the fixture's own directory, above this
    # try's: rerun_after_a_crash)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([submit_dir.name, run_dir.name])
    assert not list(tmp_path.rglob("pwned"))


@rerun_after_a_crash
def test_hsdp_template_forwards_usr2_to_every_task(slurm_cluster: Cluster, standin_env, tmp_path: Path):
    """The pre-timeout USR2 goes to the batch shell only (B:); it must reach every task, not kill the shell."""
    submit_dir = tmp_path / "submit"
    config = _write_config(submit_dir)
    run_dir = tmp_path / "run"
    env = {**standin_env, "STANDIN_WAIT_USR2": "30"}

    job_id = submit(HSDP_TEMPLATE, [str(config), str(run_dir)], env, SIZES, cwd=submit_dir)
    deadline = time.monotonic() + JOB_DEADLINE_S
    while len(list(run_dir.glob(".ready/0-*"))) < 4:  # every task has its handler installed
        assert time.monotonic() < deadline, f"tasks not ready: {_job_log(submit_dir, job_id)}"
        time.sleep(POLL_S)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], env=env, check=True, timeout=30)
    state = wait_job(job_id, JOB_DEADLINE_S, env)

    assert state == "COMPLETED", _job_log(submit_dir, job_id)
    ranks = _ranks(run_dir)
    assert sorted(ranks) == [0, 1, 2, 3]
    assert all(r["usr2"] and not r["usr2_by_file"] for r in ranks.values()), ranks
    assert "USR2 (time limit near): forwarding" in _job_log(submit_dir, job_id)


@rerun_after_a_crash
def test_hsdp_template_holds_an_early_usr2_until_the_tasks_take_it(slurm_cluster: Cluster, standin_env,
                                                                   tmp_path: Path):
    """A USR2 that reaches the batch shell while the tasks are still starting (no handler yet: the default action
    would kill them) is recorded in the run directory instead of forwarded; every task picks it up.
    Negative control: forwarding it at once kills the tasks and fails the job."""
    submit_dir = tmp_path / "submit"
    config = _write_config(submit_dir)
    run_dir = tmp_path / "run"
    env = {**standin_env, "STANDIN_WAIT_USR2": "30", "STANDIN_LATE_S": "8"}

    job_id = submit(HSDP_TEMPLATE, [str(config), str(run_dir)], env, SIZES, cwd=submit_dir)
    deadline = time.monotonic() + JOB_DEADLINE_S
    while not run_dir.exists():  # the batch script has started (it creates the run directory)
        assert time.monotonic() < deadline, f"job never started: {_job_log(submit_dir, job_id)}"
        time.sleep(POLL_S)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], env=env, check=True, timeout=30)
    state = wait_job(job_id, JOB_DEADLINE_S, env)

    assert state == "COMPLETED", _job_log(submit_dir, job_id)
    ranks = _ranks(run_dir)
    assert sorted(ranks) == [0, 1, 2, 3]
    assert all(r["usr2"] for r in ranks.values()), ranks
    assert "recorded in the run directory" in _job_log(submit_dir, job_id)


def _daemon_pids(status_output: str) -> dict[str, str]:
    return dict(re.findall(r"^(munged|slurmctld|slurmd node\d)\s+pid (\d+)\s+alive$", status_output, re.M))


def test_start_is_idempotent_and_status_reports(slurm_cluster: Cluster):
    before = slurm_cluster.script("status")
    assert before.returncode == 0, before.stdout
    pids = _daemon_pids(before.stdout)
    assert {"slurmctld", "slurmd node1", "slurmd node2"} <= set(pids), before.stdout
    assert re.search(r"^debug\*\s+up\s+infinite\s+2\s+idle\s+node\[1-2\]$", before.stdout, re.M), before.stdout

    again = slurm_cluster.script("start")

    assert again.returncode == 0, again.stdout
    assert "already running with this config" in again.stdout
    assert _daemon_pids(again.stdout) == pids  # nothing was restarted


@pytest.mark.skipif(os.geteuid() != 0, reason="restarting the cluster needs root")
def test_start_restarts_when_the_config_changed(slurm_cluster: Cluster):
    pids = _daemon_pids(slurm_cluster.script("status").stdout)
    conf = slurm_cluster.conf
    conf.write_text(conf.read_text().replace("KillWait=5", "KillWait=17"))  # as if written by an older script

    with watchdog_of(slurm_cluster).paused():
        restarted = slurm_cluster.script("start")

    assert restarted.returncode == 0, restarted.stdout
    assert "config changed: restarting the cluster" in restarted.stdout
    new_pids = _daemon_pids(restarted.stdout)
    assert set(new_pids) == set(pids)
    assert new_pids["slurmctld"] != pids["slurmctld"]
    assert "KillWait=17" not in conf.read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="restarting a slurmd needs root")
def test_the_watchdog_brings_back_a_slurmd_that_died_and_jobs_run_again(slurm_cluster: Cluster, tmp_path: Path):
    """A slurmd that dies under the tests (it aborted once on a heap check while two jobs launched their steps) is
    started again by the session's watchdog, and a two-node job runs after it. Negative control: while the watchdog
    is paused, the dead slurmd stays dead (nothing else brings it back), and its death is what the watchdog sees."""
    dog = watchdog_of(slurm_cluster)
    pid_file = slurm_cluster.state_dir / "run" / "slurmd-node2.pid"
    old_pid = int(pid_file.read_text())
    restarts = len(dog.restarts)

    with dog.paused():
        os.kill(old_pid, 9)
        deadline = time.monotonic() + JOB_DEADLINE_S
        while dog.dead() != ["slurmd-node2"]:
            assert time.monotonic() < deadline, f"slurmd node2 (pid {old_pid}) still counted alive after SIGKILL"
            time.sleep(POLL_S)
        assert len(dog.restarts) == restarts  # paused: not started again

    deadline = time.monotonic() + 2 * JOB_DEADLINE_S
    while dog.dead() or len(dog.restarts) == restarts:
        assert time.monotonic() < deadline, f"the watchdog did not start slurmd node2 again: {dog.restarts}"
        time.sleep(POLL_S)
    assert "slurmd-node2 not running" in dog.restarts[-1] and "exit 0" in dog.restarts[-1], dog.restarts[-1]
    assert int(pid_file.read_text()) != old_pid

    script = tmp_path / "both-nodes.sh"
    script.write_text("#!/bin/sh\nsrun true\n")  # a step on each node: node2's slurmd must launch it
    job_id = submit(script, env=slurm_cluster.env, extra_sbatch_args=["--nodes=2", "--ntasks-per-node=1"],
                    cwd=tmp_path)
    assert wait_job(job_id, JOB_DEADLINE_S, slurm_cluster.env) == "COMPLETED"
    assert job_info(job_id, slurm_cluster.env)["NodeList"] == "node[1-2]"
