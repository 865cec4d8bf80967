"""L2 Restart end to end on the real dev cluster (2 nodes x 2 tasks, sbatch_templates/hsdp.sbatch).

The oracle is an uninterrupted run of the same job file on the embedded default
(same topology, same math): its ``final_state_digest`` and per-step losses.  Each scenario (``_<test name>``)
runs in the module's fixture, two at a time (``outcomes``); each test reports its own scenario.
Requeues are real (``scontrol requeue`` from rank 0, from outside, or after the
pre-timeout USR2), and so are the restarts (``SLURM_RESTART_COUNT``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from accelpact_slurm.core.errors import EXIT_NO_REQUEUE
from accelpact_slurm.core.events import read_events
from tests.conftest import DECODER_JOB, REPO, VISION_JOB, job_text, run_cli
from tests.slurm_cluster import Cluster, again_after_a_crash, job_info, submit, wait_job

# The first test waits for every scenario (the fixture is in its setup): the lanes get a limit of their own.
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1500)]

TEMPLATE = Path(REPO) / "sbatch_templates" / "hsdp.sbatch"
SIZES = ["--nodes=2", "--ntasks-per-node=2"]
JOB_DEADLINE_S = 420


def job_file(tmp_path: Path, name: str, steps: int, every: int, example: str = "decoder", **extra: str) -> Path:
    lines = []
    for line in job_text(VISION_JOB if example == "vision" else DECODER_JOB).splitlines():
        key = line.strip().split(":")[0]
        if line.startswith("steps:"):
            line = f"steps: {steps}"
        elif line.startswith("log_every:"):
            line = "log_every: 50"
        elif key == "every_steps":
            line = f"  every_steps: {every}"
        elif key == "collective_s":
            line = "  collective_s: 2"
        lines.append(line)
    text = "\n".join(lines) + "\n"
    for old, new in extra.items():
        text = text.replace(old, new)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


#: The uninterrupted runs' summaries, by job file text: tests whose jobs are the same compare with one run (the
#: first scenario to ask runs it; one asking meanwhile, in the other lane, waits for that run).
_REFERENCES: dict[str, concurrent.futures.Future] = {}
_REFERENCES_LOCK = threading.Lock()


def reference(tmp_path: Path, config: Path) -> dict:
    """The summary of ``config`` run uninterrupted on the embedded default (run once per job file text)."""
    text = config.read_text()
    with _REFERENCES_LOCK:
        mine = text not in _REFERENCES
        if mine:
            _REFERENCES[text] = concurrent.futures.Future()
        result = _REFERENCES[text]
    if mine:
        try:
            proc = run_cli(["accelpact_slurm.cli.run", str(config), "--run-dir", str(tmp_path / "reference")])
            assert proc.returncode == 0, proc.stdout[-3000:]
            result.set_result(json.loads((tmp_path / "reference" / "summary.json").read_text()))
        except BaseException as exc:
            result.set_exception(exc)
            raise
    return result.result(timeout=JOB_DEADLINE_S)


def sbatch(cluster: Cluster, tmp_path: Path, config: Path, *extra_args: str,
           extra_env: dict | None = None) -> tuple[str, Path, dict]:
    run_dir = tmp_path / "run"
    env = dict(cluster.env)
    env.update({"ACCELPACT_PYTHON": sys.executable, "PYTHONPATH": REPO, **(extra_env or {})})
    job_id = submit(TEMPLATE, [str(config), str(run_dir)], env, [*SIZES, *extra_args], cwd=tmp_path)
    return job_id, run_dir, env


def finish(job_id: str, run_dir: Path, env: dict, tmp_path: Path) -> tuple[str, list[dict], dict | None, dict]:
    state = wait_job(job_id, deadline_s=JOB_DEADLINE_S, env=env)
    events = list(read_events(run_dir / "events.jsonl"))
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else None
    info = job_info(job_id, env) if state != "UNKNOWN" else {}
    log = tmp_path / f"accelpact-hsdp-{job_id}.out"
    assert summary is not None or state != "COMPLETED", log.read_text()[-4000:] if log.exists() else ""
    return state, events, summary, info


def hold_after_first_start(job_id: str, env: dict) -> None:
    """Wait for the first start to stop (exit 75 without a requeue), then requeue the job held: the test
    changes the run directory between the two starts and releases it."""
    assert wait_job(job_id, deadline_s=JOB_DEADLINE_S, env=env) == "FAILED"
    subprocess.run(["scontrol", "requeuehold", job_id], env=env, check=True, timeout=30)


def restarts_seen(events: list[dict]) -> set[int]:
    return {e["restart"] for e in events if e["event"] == "job_start"}


def _boundary_fault_is_repaired_in_process_without_requeue(slurm_cluster: Cluster, tmp_path: Path):
    config = job_file(tmp_path, "job", steps=12, every=4, **{"faults: []": 'faults: ["boundary:7:3"]'})
    ref = reference(tmp_path, job_file(tmp_path, "ref", steps=12, every=0))
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config)
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED"
    assert info.get("Restarts") == "0" and restarts_seen(events) == {0}
    repairs = [e for e in events if e["event"] == "repair"]
    assert len(repairs) == 1 and repairs[0]["frontier"] == 7
    assert not [e for e in events if e["event"] in ("fail_stop", "requeue")]
    assert summary["final_state_digest"] == ref["final_state_digest"]
    assert summary["losses"] == ref["losses"]


def _forward_fault_requeues_and_reloads_the_newest_verified(slurm_cluster: Cluster, tmp_path: Path,
                                                             example: str):
    config = job_file(tmp_path, "job", steps=12, every=4, example=example,
                      **{"faults: []": 'faults: ["forward:10:2"]'})
    ref = reference(tmp_path, job_file(tmp_path, "ref", steps=12, every=0, example=example))
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config)
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED"
    assert int(info.get("Restarts", 0)) >= 1 and restarts_seen(events) >= {0, 1}
    requeues = [e for e in events if e["event"] == "requeue"]
    assert requeues and requeues[0]["by"] == "scontrol" and requeues[0]["accepted"] is True
    loads = [e for e in events if e["event"] == "restart_load" and e["restart"] == 1]
    assert loads, ("restart 1 loaded no snapshot; checkpoints: "
                   f"{[(e['step'], e.get('state'), e.get('hostname')) for e in events if e['event'] == 'checkpoint']}")
    fault = min(e["ts"] for e in events if e["event"] == "fault")
    verified = [e["step"] for e in events if e["event"] == "checkpoint" and e.get("state") == "verified"
                and e["ts"] < loads[0]["ts"]]
    assert loads and loads[0]["step"] == max(verified) and loads[0]["step"] in (4, 8)
    assert fault < loads[0]["ts"]
    checks = [e for e in events if e["event"] == "replay_check"]
    assert checks and checks[0]["verdict"] == "match", checks
    assert summary["final_state_digest"] == ref["final_state_digest"]
    assert summary["losses"] == ref["losses"]


def _requeue_from_outside_at_an_arbitrary_moment(slurm_cluster: Cluster, tmp_path: Path):
    config = job_file(tmp_path, "job", steps=60, every=15)
    ref = reference(tmp_path, job_file(tmp_path, "ref", steps=60, every=0))
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config)
    deadline = time.monotonic() + JOB_DEADLINE_S
    while True:  # once a snapshot is verified on both nodes, requeue from outside, wherever the run is
        events = list(read_events(run_dir / "events.jsonl"))
        verified = {(e["step"], e.get("hostname")) for e in events
                    if e["event"] == "checkpoint" and e.get("state") == "verified"}
        if any((step, "node2") in verified for step, host in verified if host == "node1"):
            break
        assert time.monotonic() < deadline, "no snapshot was verified on both nodes"
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", job_id], env=env, check=True, timeout=30)
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED"
    assert restarts_seen(events) >= {0, 1}
    loads = [e for e in events if e["event"] == "restart_load" and e["restart"] >= 1]
    assert loads and loads[0]["step"] is not None and loads[0]["step"] >= 15
    assert summary["final_state_digest"] == ref["final_state_digest"]
    assert summary["losses"] == ref["losses"]


def _a_job_that_faults_before_every_commit_stops_requeueing(slurm_cluster: Cluster, tmp_path: Path):
    config = job_file(tmp_path, "job", steps=6, every=0, **{
        "faults: []": 'faults: ["forward:1:1:always"]', "max_stalled_restarts: 3": "max_stalled_restarts: 1"})
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config)
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "FAILED" and summary is None
    assert info.get("ExitCode", "").startswith(f"{EXIT_NO_REQUEUE}:")
    stops = [e for e in events if e["event"] == "fail_stop" and e["exit_code"] == EXIT_NO_REQUEUE]
    assert stops and "no progress" in stops[0]["reason"]
    assert max(restarts_seen(events)) == 2  # the first start and a restart that did not advance, then the stop


def _time_limit_usr2_snapshots_requeues_and_completes(slurm_cluster: Cluster, tmp_path: Path):
    small = {"layers: 4": "layers: 1", "width: 64": "width: 32", "log_every: 50": "log_every: 500"}
    config = job_file(tmp_path, "job", steps=500, every=0, **small)
    # One minute, and the template's --signal=B:USR2@60: the warning comes at the controller's first check, up to
    # ~30 s after the start. The first start is paced (0.2 s an update, ACCELPACT_TEST_PACE) so that it is still
    # running then; the restart runs at full speed. The reference runs meanwhile: the paced start leaves the
    # cores idle.
    # node1 settles the snapshot 3 s after node2: node2's ranks must not stop (and have srun --kill-on-bad-exit
    # kill node1's, rank 0 before its requeue request) until every rank has its node's answer.
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config, "--time=1",
                                  extra_env={"ACCELPACT_CKPTD_SLOW_VERIFY": "node1:3", "ACCELPACT_TEST_PACE": "0.2"})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ref_run = pool.submit(reference, tmp_path, job_file(tmp_path, "ref", steps=500, every=0, **small))
        deadline = time.monotonic() + JOB_DEADLINE_S
        while True:  # after the requeue, give the second start room to finish
            info = job_info(job_id, env)
            if int(info.get("Restarts", 0)) >= 1:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=15"], env=env, check=True,
                               timeout=30)
                break
            if info.get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT"):
                log = tmp_path / f"accelpact-hsdp-{job_id}.out"
                events = (run_dir / "events.jsonl").read_text() if (run_dir / "events.jsonl").exists() else ""
                pytest.fail(f"{info.get('JobState')} before any requeue ({info.get('ExitCode')});\n"
                            f"log: {log.read_text()[-4000:] if log.exists() else ''}\nevents: {events[-4000:]}")
            assert time.monotonic() < deadline, "the job was never requeued"
            time.sleep(0.5)
        ref = ref_run.result(timeout=JOB_DEADLINE_S)
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED"
    stops = [e for e in events if e["event"] == "fail_stop" and e["restart"] == 0]
    assert stops and all("SIGUSR2" in e["reason"] for e in stops), stops[:1]
    snap = stops[0]["frontier"]
    assert any(e["event"] == "checkpoint" and e.get("step") == snap and e.get("state") in ("committed", "verified")
               and e["ts"] <= stops[0]["ts"] for e in events)
    loads = [e for e in events if e["event"] == "restart_load" and e["restart"] == 1]
    assert loads and loads[0]["step"] == snap
    assert summary["final_state_digest"] == ref["final_state_digest"]
    assert summary["losses"] == ref["losses"]


def _newest_checkpoint_corrupted_between_requeue_and_restart(slurm_cluster: Cluster, tmp_path: Path):
    config = job_file(tmp_path, "job", steps=12, every=4)
    ref = reference(tmp_path, job_file(tmp_path, "ref", steps=12, every=0))
    # The first start stops (exit 75, no requeue) once snapshot 8 is verified, so 4 and 8 both exist.
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config,
                                  extra_env={"ACCELPACT_CKPT_EXIT_AFTER_VERIFIED": "8"})
    # Requeue and hold in one step; damage the newest snapshot of node1 while the job waits; then release it.
    hold_after_first_start(job_id, env)
    node1 = run_dir / "node-local" / "node1"
    newest = max(node1.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert int(newest.name.split("-")[1]) == 8, newest
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit flipped in the middle of the shard
    shard.write_bytes(bytes(data))
    subprocess.run(["scontrol", "release", job_id], env=env, check=True, timeout=30)
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED"
    rejected = [e for e in events if e["event"] == "checkpoint" and e.get("step") == 8
                and e.get("state") == "rejected"]
    assert rejected, "step 8 was not rejected"
    # node2's copy of 8 is sound: it is copied to the shared tier for node1 (checked on arrival) and loaded.
    loads = [e for e in events if e["event"] == "restart_load" and e["restart"] >= 1]
    assert loads and loads[0]["step"] == 8 and loads[0]["skipped"] == []
    assert loads[0]["copied"]["from"] == "node2" and loads[0]["copied"]["hosts"] == ["node1"]
    assert "fails its BLAKE3 checksum" in loads[0]["copied"]["after"]
    assert summary["final_state_digest"] == ref["final_state_digest"]
    assert summary["losses"] == ref["losses"]


def _a_node_directory_lost_between_requeue_and_restart_resumes_from_the_survivor(slurm_cluster: Cluster,
                                                                                  tmp_path: Path):
    """The first start stops once snapshot 9 is verified (snapshots 3, 6, 9; the shared tier has every 2nd,
    6); while the requeued job is held, node2's snapshot directory is removed, as when the job lands on a
    fresh node.  The restart copies node1's 9 to the shared tier, checks it on arrival, and node2's ranks
    load it: the job completes in the uninterrupted run's state.  (Negative control: the embedded default's
    twin, tests/e2e/test_l2_reload_e2e.py, without the copy starts from scratch.)"""
    config = job_file(tmp_path, "job", steps=12, every=3)
    ref = reference(tmp_path, job_file(tmp_path, "ref", steps=12, every=0))
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config,
                                  extra_env={"ACCELPACT_CKPT_EXIT_AFTER_VERIFIED": "9"})
    hold_after_first_start(job_id, env)
    node2 = run_dir / "node-local" / "node2"
    assert max(int(p.name.split("-")[1]) for p in node2.glob("step-*")) == 9
    shutil.rmtree(node2)
    subprocess.run(["scontrol", "release", job_id], env=env, check=True, timeout=30)
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED", info
    loads = [e for e in events if e["event"] == "restart_load" and e["restart"] >= 1]
    assert loads and loads[0]["step"] == 9, loads
    assert loads[0]["copied"]["from"] == "node1" and loads[0]["copied"]["hosts"] == ["node2"]
    assert summary["final_state_digest"] == ref["final_state_digest"]
    assert summary["losses"] == ref["losses"]


def _a_crashed_rank_is_named_by_the_survivors_requeued_and_the_job_completes(slurm_cluster: Cluster,
                                                                               tmp_path: Path):
    """Rank 2 is killed (SIGKILL, as by the OOM killer) as update 10 begins, on the first start only: its node peer
    sees its process end, every survivor fail-stops naming it, rank 0 asks Slurm for the requeue; the next start
    reloads snapshot 8 and completes.  Negative control: before the detector, nobody fail-stopped and the
    template requeued a crash (test_run_local.py covers the template's crash path: every rank killed)."""
    config = job_file(tmp_path, "job", steps=12, every=4)
    ref = reference(tmp_path, job_file(tmp_path, "ref", steps=12, every=0))
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config, extra_env={"ACCELPACT_TEST_CRASH_AT": "10:2"})
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED", info
    stops = [e for e in events if e["event"] == "fail_stop" and e["restart"] == 0]
    assert stops and all(e["cause"] == "dead-rank" and e["culprit"] == 2 for e in stops), stops
    requeues = [e for e in events if e["event"] == "requeue"]
    assert requeues and requeues[0]["by"] == "scontrol", requeues
    loads = [e for e in events if e["event"] == "restart_load" and e["restart"] == 1]
    assert loads and loads[0]["step"] == 8
    assert summary["final_state_digest"] == ref["final_state_digest"]


def _a_node_lost_whole_is_excluded_on_the_requeue(slurm_cluster: Cluster, tmp_path: Path):
    """Both ranks of the job's second node SIGKILL themselves at update 6's vote (no spare: L2).  The job's store
    sees their connections close and marks them dead; the survivors name the node lost whole; rank 0 requeues the
    job excluding that node's host (held, its ``ExcNodeList`` widened, released), and the next start runs on the
    partition's other two nodes and completes in the uninterrupted run's state.  Negative control: without the
    exclusion, ``ExcNodeList`` stays empty and Slurm may put the job on the lost node again
    (tests/slurm/test_requeue_exclude.py: the plain update of a running job is refused)."""
    config = job_file(tmp_path, "job", steps=10, every=4)
    ref = reference(tmp_path, job_file(tmp_path, "ref", steps=10, every=0))
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config, "--partition=wide",
                                  extra_env={"ACCELPACT_TEST_KILL_NODE": "vote:6:1:0"})
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED", info
    hosts = {e["restart"]: e["hostnames"] for e in events if e["event"] == "job_start"}
    lost = hosts[0][1]
    stops = [e for e in events if e["event"] == "fail_stop" and e["restart"] == 0 and e.get("rank") in (0, 1)]
    assert stops and all(e.get("lost_nodes") == [1] for e in stops), stops
    requeues = [e for e in events if e["event"] == "requeue" and e["restart"] == 0]
    assert requeues and requeues[0]["by"] == "scontrol" and requeues[0]["accepted"], requeues
    assert lost in requeues[0]["excluded"], requeues
    assert lost in info.get("ExcNodeList", ""), info
    assert lost not in hosts[1] and len(hosts[1]) == 2, hosts
    assert summary["restart_count"] == 1 and summary["final_state_digest"] == ref["final_state_digest"]
    status = run_cli(["accelpact_slurm.cli.status", str(run_dir)], timeout=60)
    assert f"{lost} (lost whole; the requeue keeps the job off them)" in status.stdout, status.stdout


def buggy_job(tmp_path: Path, steps: int) -> Path:
    path = job_file(tmp_path, "buggy", steps=steps, every=0)
    text = "\n".join(f"entry: {REPO}/tests/data/buggy_train.py:main" if line.startswith("entry:") else line
                     for line in path.read_text().splitlines())
    path.write_text(text + "\n")
    return path


def _a_bug_stops_the_job_at_once_and_slurm_does_not_requeue_it(slurm_cluster: Cluster, tmp_path: Path):
    """The training code raises ValueError on rank 1 in update 3: every rank stops with 76 on the first start,
    the batch script passes 76 on, and Slurm does not requeue; the traceback is in the job's output.  Negative
    control: before, the job was requeued four times and ended with 76 only by the no-progress rule, its
    traceback nowhere."""
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, buggy_job(tmp_path, 8), extra_env={"BUGGY_AT": "3:1"})
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "FAILED" and summary is None
    assert info.get("ExitCode", "").startswith(f"{EXIT_NO_REQUEUE}:") and info.get("Restarts") == "0", info
    assert restarts_seen(events) == {0} and not [e for e in events if e["event"] == "requeue"]
    stops = [e for e in events if e["event"] == "fail_stop"]
    assert sorted(e["rank"] for e in stops) == [0, 1, 2, 3] and all(e["cause"] == "training-code" for e in stops)
    output = (tmp_path / f"accelpact-hsdp-{job_id}.out").read_text(errors="replace")
    assert "Traceback (most recent call last)" in output and "ValueError" in output and "buggy_train.py" in output
    # Every line a rank writes carries its rank (srun --label): the traceback is rank 1's.  Negative control:
    # before, the ranks' lines interleaved unlabelled.
    assert re.search(r"^1: Traceback \(most recent call last\)", output, re.M), output[-3000:]
    assert all(re.match(r"^ ?\d+: ", line) for line in output.splitlines() if "Traceback" in line)


def _a_job_file_error_stops_with_2_names_the_field_and_is_not_requeued(slurm_cluster: Cluster, tmp_path: Path):
    """A job file the workers refuse (``steps: -1``): every task exits 2 before training, naming the field, the
    value and the fix; the batch script passes 2 on and Slurm does not requeue.  Negative control: a 2 read as
    a crash would be requeued by the template (``core.exit_verdict``, held by ``tests/launch/test_core.py``)."""
    config = job_file(tmp_path, "bad", steps=-1, every=0)
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config)
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "FAILED" and summary is None, info
    assert info.get("ExitCode", "").startswith("2:") and info.get("Restarts") == "0", info
    assert not [e for e in events if e["event"] in ("requeue", "step")]
    output = (tmp_path / f"accelpact-hsdp-{job_id}.out").read_text(errors="replace")
    assert "steps" in output and "-1" in output and "must be >= 0" in output, output[-3000:]


def _a_hung_rank_is_named_dumped_killed_and_the_requeued_job_completes(slurm_cluster: Cluster, tmp_path: Path):
    """Rank 2 stops (SIGSTOP) as update 6 begins: after heartbeat_s without a heartbeat every other rank fail-stops
    naming it, its node peer dumps its stacks into the job's output and kills it, rank 0 requeues; the next
    start completes in the uninterrupted state.  Negative control (tests/e2e/test_detection.py): blind, nobody
    names it, and the start ends only by the timers."""
    hb = {"shutdown_s: 10": "shutdown_s: 10\n  heartbeat_s: 3\n  heartbeat_interval_s: 0.25"}
    config = job_file(tmp_path, "job", steps=12, every=4, **hb)
    ref = reference(tmp_path, job_file(tmp_path, "ref", steps=12, every=0))
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config, extra_env={"ACCELPACT_TEST_HANG_AT": "6:2"})
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "COMPLETED", info
    stops = [e for e in events if e["event"] == "fail_stop" and e["restart"] == 0 and e["rank"] != 2]
    assert sorted(e["rank"] for e in stops) == [0, 1, 3], stops
    assert all(e["cause"] == "hung-rank" and e["culprit"] == 2 for e in stops), stops
    assert [e["by"] for e in events if e["event"] == "requeue"][:1] == ["scontrol"]
    output = (tmp_path / f"accelpact-hsdp-{job_id}.out").read_text(errors="replace")
    assert "most recent call first" in output
    assert summary["final_state_digest"] == ref["final_state_digest"]


def _a_crash_that_recurs_stops_with_do_not_requeue(slurm_cluster: Cluster, tmp_path: Path):
    """Rank 1 crashes in update 2 of every start.  Blind (the detector off), nobody decides before srun's
    --kill-on-bad-exit ends the step: the template requeues each crash, and the no-progress rule stops the job."""
    config = job_file(tmp_path, "job", steps=6, every=0, **{"max_stalled_restarts: 3": "max_stalled_restarts: 1"})
    job_id, run_dir, env = sbatch(slurm_cluster, tmp_path, config,
                                  extra_env={"ACCELPACT_TEST_CRASH_AT": "2:1:always",
                                             "ACCELPACT_TEST_NO_DETECTOR": "1"})
    state, events, summary, info = finish(job_id, run_dir, env, tmp_path)
    assert state == "FAILED" and summary is None
    assert info.get("ExitCode", "").startswith(f"{EXIT_NO_REQUEUE}:")
    assert len([e for e in events if e["event"] == "requeue" and e["by"] == "template"]) == 2
    stops = [e for e in events if e["event"] == "fail_stop" and e["exit_code"] == EXIT_NO_REQUEUE]
    assert stops and "no progress" in stops[0]["reason"]


# --------------------------------------------------------------------------- two lanes
#: Every scenario above, the longest first, by the test that reports it.  The dev cluster's two nodes take two
#: such jobs at once (4 CPUs each, a job takes 2 per node), and much of a job waits (Slurm's requeue, the
#: detector's timeouts, the paced start waiting for the time limit's warning), so they run two at a time.
SCENARIOS = {
    "time_limit_usr2_snapshots_requeues_and_completes": _time_limit_usr2_snapshots_requeues_and_completes,
    "a_crash_that_recurs_stops_with_do_not_requeue": _a_crash_that_recurs_stops_with_do_not_requeue,
    "requeue_from_outside_at_an_arbitrary_moment": _requeue_from_outside_at_an_arbitrary_moment,
    "a_job_that_faults_before_every_commit_stops_requeueing": _a_job_that_faults_before_every_commit_stops_requeueing,
    **{f"forward_fault_requeues_and_reloads_the_newest_verified[{example}]": functools.partial(
        _forward_fault_requeues_and_reloads_the_newest_verified, example=example) for example in ("vision", "decoder")},
    "a_hung_rank_is_named_dumped_killed_and_the_requeued_job_completes":
        _a_hung_rank_is_named_dumped_killed_and_the_requeued_job_completes,
    "newest_checkpoint_corrupted_between_requeue_and_restart": _newest_checkpoint_corrupted_between_requeue_and_restart,
    "a_node_directory_lost_between_requeue_and_restart_resumes_from_the_survivor":
        _a_node_directory_lost_between_requeue_and_restart_resumes_from_the_survivor,
    "a_crashed_rank_is_named_by_the_survivors_requeued_and_the_job_completes":
        _a_crashed_rank_is_named_by_the_survivors_requeued_and_the_job_completes,
    "boundary_fault_is_repaired_in_process_without_requeue": _boundary_fault_is_repaired_in_process_without_requeue,
    "a_node_lost_whole_is_excluded_on_the_requeue": _a_node_lost_whole_is_excluded_on_the_requeue,
    "a_bug_stops_the_job_at_once_and_slurm_does_not_requeue_it": _a_bug_stops_the_job_at_once_and_slurm_does_not_requeue_it,
    "a_job_file_error_stops_with_2_names_the_field_and_is_not_requeued":
        _a_job_file_error_stops_with_2_names_the_field_and_is_not_requeued,
}
LANES = 2


@pytest.fixture(scope="module")
def outcomes(request, slurm_cluster: Cluster, tmp_path_factory) -> dict[str, BaseException | None]:
    """The selected tests' scenarios, in ``LANES`` lanes: what each raised (its failed assertion, ``pytest.fail``),
    or None."""
    wanted = {item.originalname[len("test_"):] + (f"[{item.callspec.id}]" if hasattr(item, "callspec") else "")
              for item in request.session.items if item.module is sys.modules[__name__]}
    def one(name: str, body) -> BaseException | None:
        try:  # a scenario under a Slurm daemon's crash runs again (tests/slurm_cluster.py: Watchdog)
            again_after_a_crash(slurm_cluster,
                                lambda: body(slurm_cluster, tmp_path_factory.mktemp(re.sub(r"\W+", "_", name)[:40])))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the scenario's own test
            return exc
        return None

    with concurrent.futures.ThreadPoolExecutor(LANES) as pool:
        running = {name: pool.submit(one, name, body) for name, body in SCENARIOS.items() if name in wanted}
        return {name: f.result(timeout=len(SCENARIOS) * JOB_DEADLINE_S) for name, f in running.items()}


def outcome(outcomes: dict[str, BaseException | None], name: str) -> None:
    """The scenario's verdict, as its test's: what it raised, raised again here."""
    exc = outcomes[name]
    if exc is not None:
        raise exc


def test_boundary_fault_is_repaired_in_process_without_requeue(outcomes):
    outcome(outcomes, "boundary_fault_is_repaired_in_process_without_requeue")


@pytest.mark.parametrize("example", ["decoder", "vision"])
def test_forward_fault_requeues_and_reloads_the_newest_verified(outcomes, example):
    outcome(outcomes, f"forward_fault_requeues_and_reloads_the_newest_verified[{example}]")


def test_requeue_from_outside_at_an_arbitrary_moment(outcomes):
    outcome(outcomes, "requeue_from_outside_at_an_arbitrary_moment")


def test_a_job_that_faults_before_every_commit_stops_requeueing(outcomes):
    outcome(outcomes, "a_job_that_faults_before_every_commit_stops_requeueing")


def test_time_limit_usr2_snapshots_requeues_and_completes(outcomes):
    outcome(outcomes, "time_limit_usr2_snapshots_requeues_and_completes")


def test_newest_checkpoint_corrupted_between_requeue_and_restart(outcomes):
    outcome(outcomes, "newest_checkpoint_corrupted_between_requeue_and_restart")


def test_a_node_directory_lost_between_requeue_and_restart_resumes_from_the_survivor(outcomes):
    outcome(outcomes, "a_node_directory_lost_between_requeue_and_restart_resumes_from_the_survivor")


def test_a_crashed_rank_is_named_by_the_survivors_requeued_and_the_job_completes(outcomes):
    outcome(outcomes, "a_crashed_rank_is_named_by_the_survivors_requeued_and_the_job_completes")


def test_a_node_lost_whole_is_excluded_on_the_requeue(outcomes):
    outcome(outcomes, "a_node_lost_whole_is_excluded_on_the_requeue")


def test_a_bug_stops_the_job_at_once_and_slurm_does_not_requeue_it(outcomes):
    outcome(outcomes, "a_bug_stops_the_job_at_once_and_slurm_does_not_requeue_it")


def test_a_job_file_error_stops_with_2_names_the_field_and_is_not_requeued(outcomes):
    outcome(outcomes, "a_job_file_error_stops_with_2_names_the_field_and_is_not_requeued")


def test_a_hung_rank_is_named_dumped_killed_and_the_requeued_job_completes(outcomes):
    outcome(outcomes, "a_hung_rank_is_named_dumped_killed_and_the_requeued_job_completes")


def test_a_crash_that_recurs_stops_with_do_not_requeue(outcomes):
    outcome(outcomes, "a_crash_that_recurs_stops_with_do_not_requeue")
