"""accelpact-submit: arguments, backend detection, the Checkpointable mapping, and real runs.

Real runs (one reference ``accelpact-run`` shared by the module; each costs seconds of 4 processes on 2 cores):

* submitit's local executor (``--local``): completes with the reference digest;
* the dev cluster (``slurm``): completes with the reference digest; and a USR2 sent to the running job
  (``scancel --signal=USR2``, as a preemption or the pre-timeout warning would) takes our path -- snapshot,
  ``scontrol requeue``, exit 75, restart from the snapshot -- and still ends with the reference digest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelpact_slurm.slurm import signals
from accelpact_slurm.cli import submit as cli
from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_REQUEUE, EXIT_USAGE, SlurmEnvError
from accelpact_slurm.core.events import read_events
from tests.conftest import decoder_text, REPO, run_cli

STEPS = 16
# Periodic snapshots off: only the USR2 snapshot is taken, so no run waits for a verification at its end.
EVERY_STEPS = 100
POLL_S = 0.1


def _job_file(path: Path, every_steps: int = EVERY_STEPS) -> Path:
    text = decoder_text()
    lines = []
    for line in text.splitlines():
        if line.startswith("steps:"):
            line = f"steps: {STEPS}"
        elif line.strip().startswith("every_steps:"):
            line = f"  every_steps: {every_steps}"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    return path


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# --------------------------------------------------------------------------- arguments and detection


def test_arguments_defaults_and_choices():
    args = cli.build_parser().parse_args(["job.yaml"])
    assert (args.backend, args.wait, args.time_min, args.nodes, args.ranks_per_node) == (None, False, 60, None, None)
    args = cli.build_parser().parse_args(["job.yaml", "--local", "--nodes", "3", "--ranks-per-node", "1",
                                          "--partition", "p", "--folder", "f", "--wait", "--wait-timeout", "9"])
    assert (args.backend, args.nodes, args.ranks_per_node, args.partition, args.wait_timeout) == ("local", 3, 1, "p", 9)
    assert cli.build_parser().parse_args(["j", "--slurm"]).backend == "slurm"
    for bad in (["j", "--local", "--slurm"], ["j", "--nodes", "0"], ["j", "--time-min", "x"]):
        with pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args(bad)
        assert exc.value.code == EXIT_USAGE


def test_topology_defaults_from_the_file_and_flags_win(tmp_path):
    job = _job_file(tmp_path / "job.yaml")
    cfg = cli.effective_config(cli.build_parser().parse_args([str(job)]))
    assert (cfg.topology.nodes, cfg.topology.ranks_per_node) == (2, 2)
    cfg = cli.effective_config(cli.build_parser().parse_args([str(job), "--nodes", "1", "--ranks-per-node", "3"]))
    assert (cfg.topology.nodes, cfg.topology.ranks_per_node) == (1, 3)


def test_backend_detection():
    nothing = lambda name: None  # noqa: E731
    slurm = {"sbatch": "/usr/bin/sbatch", "srun": "/usr/bin/srun"}.get
    assert cli.detect_backend(None, nothing)[0] == "local"
    assert cli.detect_backend(None, slurm) == ("slurm", "sbatch found at /usr/bin/sbatch")
    assert cli.detect_backend(None, {"sbatch": "/x/sbatch"}.get)[0] == "local"  # sbatch without srun: no tasks
    assert cli.detect_backend("local", slurm)[0] == "local"
    assert cli.detect_backend("slurm", slurm)[0] == "slurm"
    with pytest.raises(cli.SubmitUsageError, match="--slurm: sbatch/srun not found"):
        cli.detect_backend("slurm", nothing)


def test_errors_are_one_line_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: -1\n")
    assert cli.main([str(bad), "--local"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("accelpact-submit: error: steps:") and "\n" not in err
    assert cli.main([str(tmp_path / "missing.yaml")]) == EXIT_USAGE
    assert "\n" not in capsys.readouterr().err.strip()
    # No Slurm on this PATH and --slurm forced: a fresh process with an empty PATH.
    job = _job_file(tmp_path / "job.yaml")
    proc = run_cli(["accelpact_slurm.cli.submit", str(job), "--slurm"], env={"PATH": str(tmp_path)}, timeout=60)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "accelpact-submit: error: --slurm: sbatch/srun not found on the PATH: run on a Slurm login node, "
        "or use --local for submitit's local executor"]


def test_the_script_form_hands_every_task_the_script_and_its_own_arguments(tmp_path, monkeypatch, capsys):
    """``accelpact-submit [flags] train.py [its args]``, no job file: the effective one is written into the run
    directory before anything is submitted, and each task, parsing its TaskSpec as ``RankTask`` does, gets the
    script as its entry and the script's arguments untouched (``--nodes`` among them is the script's).  Spare
    nodes are refused as for a job file: exit 2, one line, nothing written."""
    import argparse

    from accelpact_slurm.launch import core, submission

    script = tmp_path / "train.py"
    script.write_text("")
    seen = {}
    monkeypatch.setattr(submission, "submit_until_settled", lambda submit, spec, **kw: (seen.update(spec=spec) or
                                                                                        (None, spec, None)))
    run_dir = tmp_path / "run"
    assert cli.main(["--local", "--nodes", "3", "--nproc-per-node", "1", "--checkpoint-every", "4", "--run-dir",
                     str(run_dir), str(script), "--steps", "9", "--nodes", "x y"]) == 0
    spec = seen["spec"]
    assert spec.config_path == str(run_dir / "script-job.yaml") and (spec.nodes, spec.ranks_per_node) == (3, 1)
    args = core.add_job_flags(argparse.ArgumentParser()).parse_args([spec.config_path, *spec.worker_args])
    assert core.script_spec(args).argv == ("--steps", "9", "--nodes", "x y")
    cfg = core.job_config(args)
    assert cfg.entry == f"{script}:__main__" and cfg.checkpoint.every_steps == 4
    capsys.readouterr()
    assert cli.main(["--local", "--spare-nodes", "1", "--run-dir", str(tmp_path / "spares"), str(script)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("accelpact-submit: error: topology.spare_nodes:") and "\n" not in err
    assert not (tmp_path / "spares").exists()


# --------------------------------------------------------------------------- the task side, pure parts


def _spec(**kw):
    from accelpact_slurm.launch.submission import TaskSpec

    base = dict(backend="local", config_path="/j.yaml", runs_root="/runs", nodes=2, ranks_per_node=2,
                master_port=1234, control_port=1235)
    base.update(kw)
    return TaskSpec(**base)


def test_local_task_environment_emulates_srun():
    from accelpact_slurm.slurm.env import SlurmContext, in_slurm
    from accelpact_slurm.launch.submission import task_environ

    base = {"PATH": "/bin", "SLURM_JOB_ID": "99", "SLURM_PROCID": "7"}  # an enclosing allocation is not ours
    env = task_environ(_spec(restart_count=2), base, "4242", global_rank=3, num_tasks=4)
    assert in_slurm(env) and env["PATH"] == "/bin"
    ctx = SlurmContext.from_environ(env)
    assert (ctx.job_id, ctx.rank, ctx.node_index, ctx.local_rank, ctx.hostname) == ("local-4242", 3, 1, 1, "node2")
    assert (ctx.num_nodes, ctx.world_size, ctx.restart_count) == (2, 4, 2)
    assert (env["ACCELPACT_EMULATED"], env["ACCELPACT_MASTER_ADDR"]) == ("1", "127.0.0.1")
    assert (env["ACCELPACT_MASTER_PORT"], env["ACCELPACT_CONTROL_PORT"]) == ("1234", "1235")
    assert SlurmContext.from_environ(task_environ(_spec(job_id="local-1"), {}, "5", 0, 4)).job_id == "local-1"
    with pytest.raises(SlurmEnvError, match="started 3 tasks but the job needs 2 x 2 = 4"):
        task_environ(_spec(), {}, "1", 0, 3)
    with pytest.raises(SlurmEnvError, match="master_port"):
        task_environ(_spec(master_port=None), {}, "1", 0, 4)


def test_relaunch_decision():
    """Through the launch core's exit verdict, as on the embedded default: a fail-stop or a crash is relaunched in
    place (Slurm would requeue it), a bug never.  Negative control: before, a crash (no fail-stop) was not
    relaunched here, though the embedded default relaunched it and the template requeued it."""
    from accelpact_slurm.launch.submission import relaunch_decision

    def stop(code, restart=0):
        return {"event": "fail_stop", "exit_code": code, "restart": restart}

    assert relaunch_decision([stop(EXIT_REQUEUE)], 0, 20)[0]
    assert not relaunch_decision([stop(EXIT_REQUEUE), stop(EXIT_NO_REQUEUE)], 0, 20)[0]
    assert relaunch_decision([stop(EXIT_REQUEUE, restart=0)], 1, 20)[0]  # an earlier attempt's: this one crashed
    assert relaunch_decision([{"event": "step", "restart": 0}], 0, 20)[0]  # crash: no fail-stop, relaunched
    assert not relaunch_decision([stop(EXIT_NO_REQUEUE)], 0, 20)[0]  # a bug: never
    ok, why = relaunch_decision([stop(EXIT_REQUEUE, restart=3)], 3, 3)
    assert not ok and "max_restarts (3)" in why


def test_judge_results():
    from accelpact_slurm.launch.submission import judge

    ok = ("success", {"exit_code": 0})
    assert judge([ok, ok]).state == "completed"
    assert judge([ok, None]).state == "ended"
    failed = judge([ok, ("error", "Traceback ...\nValueError: boom\n")])
    assert failed.state == "failed" and failed.errors == ("ValueError: boom",)
    assert judge([ok, ("success", {"exit_code": 75})]).state == "failed"


def test_checkpoint_only_requests_and_resubmits_the_same_task(tmp_path):
    """submitit's own USR2 path (job_environment._checkpoint) calls checkpoint(): it must only set our flag."""
    from submitit.core import job_environment, utils

    from accelpact_slurm.launch.submission import RankTask

    task = RankTask(_spec())
    delayed = utils.DelayedSubmission(task)
    delayed.set_timeout(60, 3)
    signals.clear()
    try:
        assert job_environment._checkpoint(delayed, tmp_path / "submitted.pkl", countdown=3) == ""  # "" = requeue
        assert signals.requested() and signals.reason() == "SIGUSR2"
    finally:
        signals.clear()
    again = utils.DelayedSubmission.load(tmp_path / "submitted.pkl")
    assert isinstance(again.function, RankTask) and again.function.spec == task.spec and again.args == ()


def test_task_replaces_submitits_usr2_handler(monkeypatch):
    """What __call__ does first: after it, USR2 only sets our flag (submitit's handler would requeue mid-update)."""
    from accelpact_slurm.launch.submission import RankTask

    submitits = []
    previous = signal.signal(signal.SIGUSR2, lambda *a: submitits.append(a))
    def stop_after_install():
        raise RuntimeError("stop after install")

    monkeypatch.setattr("submitit.JobEnvironment", stop_after_install)
    signals.clear()
    try:
        with pytest.raises(RuntimeError, match="stop after install"):
            RankTask(_spec())()
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while not signals.requested() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        assert signals.requested() and submitits == []
    finally:
        signal.signal(signal.SIGUSR2, previous)
        signals.clear()


def test_slurm_sbatch_script_asks_for_requeue_and_usr2(tmp_path):
    import shutil

    if not shutil.which("srun"):
        pytest.skip("submitit's Slurm executor needs srun on the PATH")
    args = cli.build_parser().parse_args(["j.yaml", "--partition", "debug", "--time-min", "7"])
    cfg = cli.effective_config(cli.build_parser().parse_args([str(_job_file(tmp_path / "job.yaml"))]))
    ex = cli.make_executor("slurm", str(tmp_path / "f"), cfg, args)
    text = ex._executor._make_submission_file_text("CMD", "uid")
    for line in ("#SBATCH --requeue", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --time=7",
                 "#SBATCH --partition=debug", "#SBATCH --signal=USR2@90"):
        assert line in text.splitlines(), text
    assert "--gpu-bind" not in text and "cpus-per-task" not in text  # a CPU job, as before
    # every line of rank R starts "R: ", as under the sbatch template (srun --label).  Negative control: before,
    # submitit's srun had no --label.
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert "--label" in srun.split(), srun


# --------------------------------------------------------------------------- GPUs


def test_gpus_and_cpus_per_task_arguments():
    args = cli.build_parser().parse_args(["j.yaml"])
    assert (args.gpus_per_node, args.cpus_per_task) == (0, None)
    args = cli.build_parser().parse_args(["j.yaml", "--gpus-per-node", "4", "--cpus-per-task", "8"])
    assert (args.gpus_per_node, args.cpus_per_task) == (4, 8)
    for bad in (["j", "--gpus-per-node", "-1"], ["j", "--gpus-per-node", "x"], ["j", "--cpus-per-task", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args(bad)
        assert exc.value.code == EXIT_USAGE
    assert "--gpus-per-node G" in cli.build_parser().format_help()


def test_slurm_gpu_job_reaches_the_executor(tmp_path):
    import shutil

    if not shutil.which("srun"):
        pytest.skip("submitit's Slurm executor needs srun on the PATH")
    job = str(_job_file(tmp_path / "job.yaml"))
    args = cli.build_parser().parse_args([job, "--ranks-per-node", "4", "--gpus-per-node", "4",
                                          "--cpus-per-task", "8"])
    cfg = cli.effective_config(args)
    cli.check_gpus(args.gpus_per_node, cfg)
    ex = cli.make_executor("slurm", str(tmp_path / "f"), cfg, args)
    params = ex._executor.parameters
    assert (params["nodes"], params["ntasks_per_node"]) == (2, 4)
    assert (params["gpus_per_node"], params["cpus_per_task"]) == (4, 8)
    assert params["srun_args"] == ["--label", "--cpus-per-task=8", "--cpu-bind=cores", "--gpu-bind=none"]
    lines = ex._executor._make_submission_file_text("CMD", "uid").splitlines()
    for line in ("#SBATCH --gpus-per-node=4", "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --requeue"):
        assert line in lines, lines
    [srun] = [line for line in lines if line.startswith("srun ")]
    assert srun.endswith(" --cpus-per-task=8 --cpu-bind=cores --gpu-bind=none CMD"), srun


def test_local_gpu_job_makes_one_gpu_visible_per_emulated_rank(tmp_path):
    job = str(_job_file(tmp_path / "job.yaml"))  # 2 nodes x 2 ranks
    for flags, gpus in (([], 0), (["--gpus-per-node", "2"], 4)):
        args = cli.build_parser().parse_args([job, *flags])
        cfg = cli.effective_config(args)
        cli.check_gpus(args.gpus_per_node, cfg)
        params = cli.make_executor("local", str(tmp_path / "f"), cfg, args)._executor.parameters
        assert (params["tasks_per_node"], params["gpus_per_node"]) == (4, gpus)


@pytest.mark.parametrize("flags, rpn", [(["--gpus-per-node", "4"], 2),
                                        (["--ranks-per-node", "4", "--gpus-per-node", "8"], 4)])
def test_gpus_per_node_other_than_the_ranks_per_node_is_refused(tmp_path, capsys, flags, rpn):
    job = _job_file(tmp_path / "job.yaml")
    folder = tmp_path / "submitit"
    assert cli.main([str(job), "--local", "--folder", str(folder), *flags]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    gpus = flags[-1]
    assert err == (f"accelpact-submit: error: --gpus-per-node {gpus}: the job runs {rpn} ranks per node "
                   f"(--ranks-per-node, else the file's topology.ranks_per_node) and each rank drives one GPU: "
                   f"give --gpus-per-node {rpn}, or --ranks-per-node {gpus} to use every GPU")
    assert not folder.exists()  # refused before anything was submitted


def test_gpu_notes_on_the_job_files_device(tmp_path):
    from accelpact_slurm.core.config import with_overrides

    cfg = cli.effective_config(cli.build_parser().parse_args([str(_job_file(tmp_path / "job.yaml"))]))
    assert cli.gpu_notes(0, cfg, "slurm") == [] and cli.gpu_notes(2, cfg, "slurm") == []  # auto
    [note] = cli.gpu_notes(2, with_overrides(cfg, {"topology.device": "cpu"}), "slurm")
    assert "topology.device: cpu" in note and "GPUs stay idle" in note
    cuda = with_overrides(cfg, {"topology.device": "cuda"})
    assert cli.gpu_notes(2, cuda, "local") == []
    [note] = cli.gpu_notes(0, cuda, "local")
    assert "the local executor hides every GPU" in note and note.endswith("pass --gpus-per-node 2")


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain ``accelpact-run`` of the test job: the digest every submission must reach."""
    base = tmp_path_factory.mktemp("submit")
    job = _job_file(base / "job.yaml")
    proc = run_cli(["accelpact_slurm.cli.run", str(job), "--run-dir", str(base / "reference")], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return job, _summary(base / "reference")["final_state_digest"]


def _submit(args, env, timeout):
    return subprocess.run([sys.executable, "-m", "accelpact_slurm.cli.submit", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def _check_completed(proc, run_dir: Path, digest: str) -> dict:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = _summary(run_dir)
    assert summary["final_step"] == STEPS and summary["world_size"] == 4
    assert summary["final_state_digest"] == digest
    assert f"final_state_digest {digest}" in proc.stdout and f"run dir {run_dir}" in proc.stdout
    return summary


@pytest.mark.multiproc
def test_local_executor_runs_the_job_to_the_reference_digest(reference, tmp_path):
    job, digest = reference
    run_dir = tmp_path / "local run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["PYTHONPATH"] = REPO
    proc = _submit([str(job), "--local", "--run-dir", str(run_dir), "--wait", "--wait-timeout", "240"], env, 300)
    _check_completed(proc, run_dir, digest)
    assert "(local: --local; 2 nodes x 2 ranks)" in proc.stdout
    events = list(read_events(run_dir / "events.jsonl"))
    members = sorted((e["rank"], e["hostname"]) for e in events if e["event"] == "membership")
    assert members == [(0, "node1"), (1, "node1"), (2, "node2"), (3, "node2")]
    assert {e["job_id"] for e in events if e.get("rank") is not None} == {events[0]["job_id"]}
    assert events[0]["job_id"].startswith("local-")
    # The same start-up as every other path (core.start_rank): each task marked itself ready and the run directory
    # recorded its training; each task's log is labelled with its rank.  Negative control: before, the submitit
    # path skipped check_same_training and signals.mark_ready (no job-training.json, no .ready markers).
    assert sorted(p.name for p in (run_dir / signals.READY_DIR).iterdir()) == ["0-0", "0-1", "0-2", "0-3"]
    assert (run_dir / "job-training.json").exists()
    lines = [ln for p in sorted((run_dir / "submitit").rglob("*_0_log.*"))
             for ln in p.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith("submitit ")]
    assert lines and all(ln.startswith("0: ") for ln in lines), lines[:5]
    assert any("final_state_digest" in ln for ln in lines), lines[-5:]


@pytest.mark.multiproc
def test_local_executor_stops_a_bug_once_and_does_not_relaunch_it(tmp_path):
    """The training code raises ValueError on rank 1 in update 2 (``tests/data/buggy_train.py``): through submitit
    every task stops with 76 on the first start, the traceback in the rank's log, and ``--wait`` does not
    relaunch it.  Negative control: ``ACCELPACT_TEST_BUG_RESTARTS=1`` (a bug restarted like a fault) relaunches."""
    job = _job_file(tmp_path / "job.yaml")
    job.write_text("\n".join(f"entry: {REPO}/tests/data/buggy_train.py:main" if line.startswith("entry:") else line
                             for line in job.read_text().splitlines()) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update({"PYTHONPATH": REPO, "BUGGY_AT": "2:1"})
    run_dir = tmp_path / "run"
    proc = _submit([str(job), "--local", "--run-dir", str(run_dir), "--wait", "--wait-timeout", "240"], env, 300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "relaunching" not in out, out[-3000:]
    events = list(read_events(run_dir / "events.jsonl"))
    assert {e["restart"] for e in events if e["event"] == "job_start"} == {0}
    stops = [e for e in events if e["event"] == "fail_stop"]
    assert sorted(e["rank"] for e in stops) == [0, 1, 2, 3] and all(e["cause"] == "training-code" for e in stops)
    assert all(e["exit_code"] == 76 for e in stops)
    logs = " ".join(p.read_text(errors="replace") for p in (run_dir / "submitit").rglob("*_log.*"))
    assert "Traceback (most recent call last)" in logs and "buggy_train.py" in logs
    env["ACCELPACT_TEST_BUG_RESTARTS"] = "1"
    # one relaunch shows it; a relaunch may wait (up to startup_s) for the daemon of the start before it to end
    control = tmp_path / "control.yaml"
    control.write_text(job.read_text().replace("startup_s: 120", "startup_s: 30").replace("max_restarts: 20",
                                                                                          "max_restarts: 1"))
    assert "max_restarts: 1" in control.read_text() and "startup_s: 30" in control.read_text()
    again = _submit([str(control), "--local", "--run-dir", str(tmp_path / "control"), "--wait", "--wait-timeout",
                     "240"], env, 300)
    assert "relaunching" in again.stdout + again.stderr, (again.stdout + again.stderr)[-3000:]


@pytest.mark.multiproc
def test_local_executor_relaunches_a_crashed_rank_from_its_snapshot_and_completes(reference, tmp_path):
    """Rank 2 is killed (SIGKILL) as update 10 begins, on the first start only: the survivors name it and stop
    with 75, ``--wait`` relaunches the tasks in place (no Slurm to requeue them), the next start reloads snapshot 8
    and the job ends with the reference digest.  Negative control: a crash left to the launcher (nobody decided
    on 75) is not relaunched (``tests/launch/test_core.py``, the verdict table)."""
    _, digest = reference
    job = _job_file(tmp_path / "job.yaml", every_steps=4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update({"PYTHONPATH": REPO, "ACCELPACT_TEST_CRASH_AT": "10:2"})
    run_dir = tmp_path / "run"
    proc = _submit([str(job), "--local", "--run-dir", str(run_dir), "--wait", "--wait-timeout", "280"], env, 320)
    _check_completed(proc, run_dir, digest)
    assert "relaunching" in proc.stdout + proc.stderr
    events = list(read_events(run_dir / "events.jsonl"))
    stops = [e for e in events if e["event"] == "fail_stop" and e["restart"] == 0]
    assert stops and all(e["cause"] == "dead-rank" and e["culprit"] == 2 for e in stops), stops
    assert {e["exit_code"] for e in stops} == {EXIT_REQUEUE}
    loads = [e for e in events if e["event"] == "restart_load" and e["restart"] == 1]
    assert loads and loads[0]["step"] == 8


def _slurm_env(cluster) -> dict:
    env = dict(cluster.env)
    env["PYTHONPATH"] = REPO  # submitit starts the tasks with this interpreter (sys.executable): the venv's
    return env


@pytest.mark.slurm
def test_slurm_runs_the_job_to_the_reference_digest(slurm_cluster, reference, tmp_path):
    job, digest = reference
    run_dir = tmp_path / "slurm run"
    proc = _submit([str(job), "--slurm", "--time-min", "10", "--run-dir", str(run_dir), "--wait",
                    "--wait-timeout", "240"], _slurm_env(slurm_cluster), 300)
    summary = _check_completed(proc, run_dir, digest)
    assert summary["restart_count"] == 0
    events = list(read_events(run_dir / "events.jsonl"))
    assert sorted((e["rank"], e["hostname"]) for e in events if e["event"] == "membership") == [
        (0, "node1"), (1, "node1"), (2, "node2"), (3, "node2")]
    script = next((run_dir / "submitit").glob("*_submission.sh")).read_text()
    assert "#SBATCH --requeue" in script.splitlines()


@pytest.mark.slurm
def test_slurm_stops_a_bug_once_and_slurm_does_not_requeue_it(slurm_cluster, tmp_path):
    """The training code raises on rank 1 in update 2: through submitit on Slurm every task stops with 76 on
    the first start, nobody asks for a requeue, and the job is not started again.  Its negative control (a bug
    restarted like a fault, ``ACCELPACT_TEST_BUG_RESTARTS=1``, is started again) runs on the local executor
    above: the tasks and the verdict (``core.exit_verdict``) are the same on both backends."""
    job = _job_file(tmp_path / "job.yaml")
    job.write_text("\n".join(f"entry: {REPO}/tests/data/buggy_train.py:main" if line.startswith("entry:") else line
                             for line in job.read_text().splitlines()) + "\n")
    env = _slurm_env(slurm_cluster)
    env["BUGGY_AT"] = "2:1"
    run_dir = tmp_path / "run"
    proc = _submit([str(job), "--slurm", "--time-min", "10", "--run-dir", str(run_dir), "--wait",
                    "--wait-timeout", "240"], env, 300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    events = list(read_events(run_dir / "events.jsonl"))
    assert {e["restart"] for e in events if e["event"] == "job_start"} == {0}
    stops = [e for e in events if e["event"] == "fail_stop"]
    assert sorted(e["rank"] for e in stops) == [0, 1, 2, 3] and all(e["cause"] == "training-code" for e in stops)
    assert {e["exit_code"] for e in stops} == {EXIT_NO_REQUEUE}
    assert not [e for e in events if e["event"] == "requeue"], out[-3000:]
    logs = " ".join(p.read_text(errors="replace") for p in (run_dir / "submitit").rglob("*_log.*"))
    assert "Traceback (most recent call last)" in logs and "buggy_train.py" in logs


def _wait_for_step(events_path: Path, step: int, deadline_s: float, proc) -> str:
    """The job id once rank 0 logged update ``step`` (polled against a deadline)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for e in read_events(events_path):
            if e.get("event") == "step" and e.get("step", 0) >= step:
                return str(e["job_id"])
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(POLL_S)
    raise AssertionError(f"no step {step} in {events_path} after {deadline_s} s")


@pytest.mark.slurm
@pytest.mark.parametrize("sig", ["USR2", "TERM"])
def test_slurm_usr2_or_sigterm_takes_our_snapshot_requeue_path(slurm_cluster, reference, tmp_path, sig):
    """USR2, or a preemption's SIGCONT + SIGTERM (``scancel --signal`` without flags: every task of every step,
    as slurmctld signals a preempted job when its grace time begins), to a submitit job: snapshot, requeue, resume.

    Negative controls (TERM): with only USR2 ours, submitit's handler (which logs SIGTERM and bypasses it) let
    the job train on without a snapshot or a requeue; with the daemon stopping on SIGTERM, the snapshot was never
    committed and the next start had nothing to load."""
    job, digest = reference
    run_dir = tmp_path / f"{sig} run"
    env = _slurm_env(slurm_cluster)
    proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.submit", str(job), "--slurm", "--time-min",
                             "10", "--run-dir", str(run_dir), "--wait", "--wait-timeout", "240"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    job_id = None
    try:
        job_id = _wait_for_step(run_dir / "events.jsonl", 2, 120, proc)
        # To every process of the job's steps, as a preemption would (daemons included: they must serve on).
        if sig == "TERM":
            subprocess.run(["scancel", "--signal=CONT", job_id], env=env, check=True, timeout=30)
        subprocess.run(["scancel", f"--signal={sig}", job_id], env=env, check=True, timeout=30)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
            if job_id:
                subprocess.run(["scancel", job_id], env=env, timeout=30)
    assert proc.returncode == 0, out[-4000:]
    summary = _summary(run_dir)
    assert summary["final_step"] == STEPS and summary["final_state_digest"] == digest
    assert summary["restart_count"] == 1, out[-4000:]
    events = list(read_events(run_dir / "events.jsonl"))
    stops = [e for e in events if e["event"] == "fail_stop" and e["restart"] == 0]
    assert sorted(e["rank"] for e in stops) == [0, 1, 2, 3]
    assert all(e["exit_code"] == EXIT_REQUEUE and f"SIG{sig} received" in e["reason"] for e in stops)
    assert any(e["event"] == "requeue" and e["by"] == "scontrol" and e["accepted"] for e in events)
    frontier = stops[0]["frontier"]
    loads = [e for e in events if e["event"] == "restart_load" and e["restart"] == 1]
    assert loads and loads[0]["step"] == frontier
