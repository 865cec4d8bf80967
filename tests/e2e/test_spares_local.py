"""Spare nodes on the embedded default, end to end: the decoder example with ``--spare-nodes 1`` ends in the same
training state as without, every process of the job is named with its pid and node, the spares park warm in the
job's store and are all gone at the end, and ``accelpact-status`` shows the pool.

One run with a spare node and one without (the reference), shared by the tests through a module fixture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from accelpact_slurm.core.events import read_events
from tests.conftest import REPO, run_cli, wait_for
from tests.node_procs import alive, kill_node, node_pids, processes

pytestmark = pytest.mark.multiproc

TINY = "examples/decoder/job.yaml"
STEPS = 6


def _run(run_dir, *extra):
    proc = run_cli(["accelpact_slurm.cli.run", TINY, "--run-dir", str(run_dir), "--steps", str(STEPS), *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as fh:
        return proc, json.load(fh), list(read_events(os.path.join(run_dir, "events.jsonl")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("spares")
    return {"none": _run(base / "none"), "one": _run(base / "one", "--spare-nodes", "1"), "dir": base}


def test_a_spare_node_changes_nothing_of_the_training(runs):
    (_, without, _), (_, with_spare, _) = runs["none"], runs["one"]
    assert with_spare["final_state_digest"] == without["final_state_digest"]
    assert with_spare["losses"] == without["losses"] and with_spare["world_size"] == 4


def test_every_process_is_named_with_its_pid_and_node(runs):
    """Negative control: the run without spares names no spare, and node 2 has no process there."""
    _, _, events = runs["one"]
    procs = processes(events)
    roles = sorted((e["role"], e["node"]) for e in procs)
    assert roles == sorted([("rank", 0), ("rank", 0), ("rank", 1), ("rank", 1), ("store", 0), ("daemon", 0),
                            ("daemon", 1), ("spare", 2), ("spare", 2), ("launcher", None), ("zygote", None),
                            ("store-standby", 1)])
    assert len({e["pid"] for e in procs}) == len(procs)  # one pid each
    assert sorted(e["rank"] for e in procs if e["role"] == "rank") == [0, 1, 2, 3]
    members = {e["rank"]: e["pid"] for e in events if e["event"] == "membership"}
    assert {e["rank"]: e["pid"] for e in procs if e["role"] == "rank"} == members
    spares = node_pids(events, 2)
    assert sorted(spares.values()) == ["spare", "spare"]
    assert sorted(node_pids(events, 1).values()) == ["daemon", "rank", "rank", "store-standby"]
    assert {e["hostname"] for e in procs if e["node"] == 2} == {"node3"}
    _, _, plain = runs["none"]
    assert not [e for e in plain if e["event"].startswith("spare")] and node_pids(plain, 2) == {}


def test_the_spares_park_warm_and_are_all_gone_at_the_end(runs):
    _, _, events = runs["one"]
    ready = [e for e in events if e["event"] == "spare_ready"]
    assert sorted((e["node"], e["local_rank"]) for e in ready) == [(2, 0), (2, 1)]
    ends = [e for e in events if e["event"] == "spare_end"]
    assert sorted((e["node"], e["local_rank"], e["exit_code"]) for e in ends) == [(2, 0, 0), (2, 1, 0)]
    # rank 0 announces the end; a spare that missed it sees the store go, or the launcher's SIGTERM
    assert all(e["reason"] == "the job ended" or "store is gone" in e["reason"] or "SIGTERM" in e["reason"]
               for e in ends), ends
    end = next(i for i, e in enumerate(events) if e["event"] == "job_end")
    assert all(events.index(e) < end for e in ready)  # parked while the ranks trained
    leftover = [e for e in processes(events) if e["role"] != "launcher" and alive(e["pid"])]
    assert leftover == []
    assert not [e for e in events if e["event"] == "fail_stop"]  # no spare's exit counted as a rank's failure


def test_status_shows_the_pool(runs):
    """While the spares are parked (the log as it stood once both were ready and the job started) the pool is free;
    at the end it has ended.  Negative control: the run without spares shows no pool."""
    _, _, events = runs["one"]
    # a spare may be ready before rank 0 wrote job_start (it joins the store as soon as rank 0 hosts it)
    last_ready = max(i for i, e in enumerate(events) if e["event"] in ("spare_ready", "job_start"))
    parked = runs["dir"] / "parked"
    parked.mkdir()
    with open(parked / "events.jsonl", "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in events[:last_ready + 1])
    live = run_cli(["accelpact_slurm.cli.status", str(parked)], timeout=60)
    assert live.returncode == 0, live.stderr
    line = next(l for l in live.stdout.splitlines() if "spare pool" in l)
    assert "1 spare node(s) x 2: free 1, used 0" in line and "node index 2 free" in line
    done = run_cli(["accelpact_slurm.cli.status", str(runs["dir"] / "one"), "--json"], timeout=60)
    pool = json.loads(done.stdout)["jobs"][0]["spares"]
    assert (pool["configured"], pool["free"], pool["used"], pool["ended"]) == (1, 0, 0, 1)
    plain = run_cli(["accelpact_slurm.cli.status", str(runs["dir"] / "none")], timeout=60)
    assert "spare pool" not in plain.stdout


def test_a_spare_node_killed_whole_is_no_failure_of_the_job(runs, tmp_path):
    """SIGKILL every process of the spare node (found in the events, as a node loss test will) while the ranks
    train: the job completes without a stop or a relaunch, in the reference state.  Negative control: a launcher
    that counted a spare's exit as a rank's (its supervision over ranks and spares alike) relaunches this job
    (a ``fail_stop`` by the launcher, ``restart`` 1) and the test fails; the same helper aimed at node 1 finds that
    node's ranks and daemon, not the spares."""
    run_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", TINY, "--run-dir", str(run_dir),
                             "--steps", str(STEPS), "--spare-nodes", "1"], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def ready():
            events = list(read_events(run_dir / "events.jsonl"))
            return events if len([e for e in events if e["event"] == "spare_ready"]) == 2 else None

        events = wait_for(ready, 300, "both spare processes ready")
        assert not [e for e in events if e["event"] == "job_end"]  # the ranks still train
        killed = kill_node(str(run_dir), 2)
        assert sorted(killed.values()) == ["spare", "spare"]
        roles = sorted(node_pids(events, 1).values())  # the control: another node's processes, no spare
        assert roles.count("rank") == 2 and "daemon" in roles and "spare" not in roles
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_state_digest"] == runs["none"][1]["final_state_digest"]
    events = list(read_events(run_dir / "events.jsonl"))
    assert not [e for e in events if e["event"] == "fail_stop"] and {e["restart"] for e in events} == {0}
    assert not any(alive(pid) for pid in killed)


def test_a_relaunch_stops_the_spares_of_its_start_and_starts_new_ones(runs, tmp_path):
    """A fault L1 may not repair (forward: L2) ends start 0; the launcher stops that start's spares (bounded, never
    waiting on them), relaunches, and start 1 has spares of its own; the job ends in the reference state.
    Negative control: start 0's spares did not see the job's end (their reasons say how they were stopped)."""
    run_dir = tmp_path / "relaunched"
    _proc, summary, events = _run(run_dir, "--spare-nodes", "1", "--inject-fault", "forward:3:1")
    assert summary["final_state_digest"] == runs["none"][1]["final_state_digest"]
    assert summary["restart_count"] == 1
    ends = {(e["restart"], e["local_rank"]): e["reason"] for e in events if e["event"] == "spare_end"}
    assert set(ends) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(ends[(1, l)] == "the job ended" for l in (0, 1))
    assert all(ends[(0, l)] != "the job ended" for l in (0, 1)), ends  # the control
    assert [e for e in processes(events, 1) if e["role"] == "spare"] and \
        not [e for e in processes(events) if alive(e["pid"]) and e["role"] != "launcher"]
    assert not [e for e in processes(events, 0) if alive(e["pid"]) and e["role"] != "launcher"]
