"""sbatch_templates/hsdp.sbatch without Slurm: its syntax, its GPU check alone, the steps it would start (in the
job-file form and in the torchrun form), and what it makes of the training step's status.

The template runs under bash with a made-up Slurm environment, a stand-in ``srun`` on the PATH that records its
arguments instead of starting anything (and ends the training step with ``$FAKE_STEP_STATUS``) and a stand-in
``scontrol`` that records its arguments; the template's Python hooks (``python -m accelpact_slurm.cli.node``) are
real.  The tests on the real dev cluster are in tests/e2e.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from accelpact_slurm.cli import worker
from accelpact_slurm.launch import core
from tests.conftest import DECODER_JOB, job_text

TEMPLATE = Path(__file__).resolve().parents[2] / "sbatch_templates" / "hsdp.sbatch"
BASE_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}

# Records its arguments (one a line) in $SRUN_LOG/daemons or $SRUN_LOG/training; the training step ends with
# $FAKE_STEP_STATUS (default 0).
FAKE_SRUN = """#!/bin/bash
case " $* " in
  *" --overlap "*) step=daemons ;;
  *) step=training ;;
esac
printf '%s\\n' "$@" >"$SRUN_LOG/$step"
if [[ $step == training ]]; then
  if [[ -n ${FAKE_TERM_BATCH:-} ]]; then kill -TERM "$PPID"; fi  # Slurm ending the job: SIGTERM to the batch shell
  exit "${FAKE_STEP_STATUS:-0}"
fi
"""
# Records its arguments in $SRUN_LOG/scontrol and succeeds.
FAKE_SCONTROL = """#!/bin/bash
printf '%s\\n' "$@" >>"$SRUN_LOG/scontrol"
"""
REPO = Path(__file__).resolve().parents[2]


def test_template_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(TEMPLATE)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_template_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    if not shellcheck:
        pytest.skip("shellcheck is not installed")
    proc = subprocess.run([shellcheck, "--severity=warning", str(TEMPLATE)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout


def _check_gpus(env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """The template's first check (``python -m accelpact_slurm.cli.node gpus --job-file CONFIG``), alone, under
    ``env``; prints the GPUs per node when it passes."""
    assert ("GPUS_PER_NODE=$(\"$PY\" -m accelpact_slurm.cli.node gpus --job-file \"$CONFIG\") || exit 2"
            in TEMPLATE.read_text())
    return subprocess.run([sys.executable, "-m", "accelpact_slurm.cli.node", "gpus", *extra], capture_output=True,
                          text=True, timeout=60, env={**BASE_ENV, "PYTHONPATH": str(REPO), **env})


@pytest.mark.parametrize("env, gpus", [
    ({}, 0),  # a CPU job
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "0"}, 0),
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "4"}, 4),
    ({"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_GPUS_PER_NODE": "h100:4"}, 4),
    ({"SLURM_TASKS_PER_NODE": "2,2", "SLURM_GPUS_PER_NODE": "2"}, 2),
    ({"SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"}, 8),
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_GPUS": "0-3"}, 4),
    # This node's count wins over the request's.
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "8"}, 4),
])
def test_gpu_check_accepts_one_gpu_per_task(env, gpus):
    proc = _check_gpus(env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(gpus) and proc.stderr == ""


@pytest.mark.parametrize("env, words", [
    ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "4"},
     ["4 GPUs per node (SLURM_GPUS_ON_NODE=4) but 2 tasks per node (SLURM_NTASKS_PER_NODE=2)",
      "--ntasks-per-node=4 --gpus-per-node=4, or --ntasks-per-node=2 --gpus-per-node=2"]),
    ({"SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_GPUS_PER_NODE": "a100:4"},
     ["4 GPUs per node (SLURM_GPUS_PER_NODE=a100:4) but 8 tasks per node (SLURM_TASKS_PER_NODE=8(x2))"]),
    ({"SLURM_TASKS_PER_NODE": "3,1", "SLURM_GPUS_PER_NODE": "2"},
     ["SLURM_TASKS_PER_NODE=3,1: a GPU job needs the same number of tasks on every node",
      "--ntasks-per-node=2 --gpus-per-node=2"]),
    ({"SLURM_GPUS_ON_NODE": "4"}, ["cannot tell the tasks per node", "--ntasks-per-node=4 --gpus-per-node=4"]),
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_PER_NODE": "four"},
     ["SLURM_GPUS_PER_NODE=four: cannot tell the GPUs per node"]),
])
def test_gpu_check_rejects_unequal_counts_with_the_fix(env, words):
    proc = _check_gpus(env)
    assert proc.returncode == 2 and proc.stdout == ""
    err = proc.stderr.strip()
    assert err.startswith("hsdp.sbatch: error: ") and "\n" not in err
    for w in words:
        assert w in err, err


def test_the_first_check_refuses_a_job_file_the_workers_would_refuse(tmp_path: Path):
    """Every task would refuse it alike, and ``srun --kill-on-bad-exit`` would end the slower ones (status 143, a
    crash to the template, requeued) before they could exit 2: the batch shell checks it first.  Negative
    control: the same check without ``--job-file`` passes it."""
    good = tmp_path / "good.yaml"
    good.write_text(job_text(DECODER_JOB))
    bad = tmp_path / "bad.yaml"
    bad.write_text("\n".join("steps: -1" if line.startswith("steps:") else line
                             for line in job_text(DECODER_JOB).splitlines()) + "\n")
    assert _check_gpus({}, "--job-file", str(good)).returncode == 0
    proc = _check_gpus({}, "--job-file", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    err = proc.stderr.strip()
    assert err.startswith("hsdp.sbatch: error: ") and "steps" in err and "-1" in err and "must be >= 0" in err, err
    assert _check_gpus({}).returncode == 0  # the control: without the job file nothing sees it


def _run_template(tmp_path: Path, env: dict[str, str], args: tuple[str, ...] = ("job.yaml",),
                  template: Path = TEMPLATE) -> tuple[subprocess.CompletedProcess, Path]:
    """The whole template (``template`` with ``args``) with a stand-in srun; returns the process and where srun's
    arguments are."""
    bin_dir, log = tmp_path / "bin", tmp_path / "srun"
    bin_dir.mkdir(exist_ok=True)
    shutil.rmtree(log, ignore_errors=True)
    log.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    # The template's own hooks run for real: "python-on-the-nodes" is this interpreter on this tree.
    (bin_dir / "python-on-the-nodes").write_text(f'#!/bin/bash\nPYTHONPATH={REPO} exec {sys.executable} "$@"\n')
    for name in ("srun", "scontrol", "python-on-the-nodes"):
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.yaml").write_text("steps: 1\n")
    full = {**BASE_ENV, "PATH": f"{bin_dir}:{BASE_ENV['PATH']}", "SRUN_LOG": str(log),
            "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_TASKS_PER_NODE": "4(x2)", "ACCELPACT_PYTHON": "python-on-the-nodes", **env}
    proc = subprocess.run(["bash", str(template), *args], capture_output=True, text=True, timeout=60,
                          env=full, cwd=tmp_path)
    return proc, log


def test_template_stops_before_any_step_when_gpus_and_tasks_differ(tmp_path):
    proc, log = _run_template(tmp_path, {"SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_NODE": "8"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "8 GPUs per node (SLURM_GPUS_ON_NODE=8) but 4 tasks per node" in proc.stderr
    assert list(log.iterdir()) == []  # no srun: neither the daemons nor the training step (nor scontrol)
    assert not (tmp_path / "runs").exists()


def test_gpu_job_steps_bind_gpus_and_cpus(tmp_path):
    proc, log = _run_template(tmp_path, {"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "4",
                                         "SLURM_CPUS_PER_TASK": "8"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 GPUs per node, one per task" in proc.stdout
    run_dir = tmp_path / "runs" / "42"
    assert (log / "training").read_text().splitlines() == [
        "--label", "--kill-on-bad-exit=1", "--cpus-per-task=8", "--cpu-bind=cores", "--gpu-bind=none",
        "python-on-the-nodes", "-m", "accelpact_slurm.cli.worker", str(tmp_path / "job.yaml"), "--run-dir",
        str(run_dir)]
    assert "--gpu-bind=none" not in (log / "daemons").read_text().splitlines()


def test_cpu_job_step_is_unchanged(tmp_path):
    proc, log = _run_template(tmp_path, {})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPUs per node" not in proc.stdout
    assert (log / "training").read_text().splitlines() == [
        "--label", "--kill-on-bad-exit=1", "python-on-the-nodes", "-m", "accelpact_slurm.cli.worker",
        str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "runs" / "42")]
    daemons = (log / "daemons").read_text().splitlines()
    assert daemons == ["--ntasks=2", "--ntasks-per-node=1", "--overlap", "--kill-on-bad-exit=0",
                       "--disable-status", "python-on-the-nodes", "-m", "accelpact_slurm.cli.node", "serve",
                       str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "runs" / "42")]
    assert not (log / "scontrol").exists()


def test_cpu_binding_without_gpus(tmp_path):
    proc, log = _run_template(tmp_path, {"SLURM_CPUS_PER_TASK": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (log / "training").read_text().splitlines()[:4] == [
        "--label", "--kill-on-bad-exit=1", "--cpus-per-task=2", "--cpu-bind=cores"]
    assert "--gpu-bind=none" not in (log / "training").read_text().splitlines()


# --------------------------------------------------------------------------- the template is a thin srun wrapper


def test_template_spells_no_protocol():
    """What a start's exit means, the daemon's command, the ready markers and the requeue are the launch core's
    (accelpact_slurm/launch/core.py): the template only starts the steps and passes the step's status on.
    Negative control: the template of before (270 lines, a case on 0|2|75|76, scontrol requeue, the daemon's
    command line, the ready-marker count and the GPU arithmetic in shell) fails every line of this test."""
    text = TEMPLATE.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert len(text.splitlines()) <= 160 and len(code.splitlines()) <= 80, len(code.splitlines())
    for spelled in ("75", "76", "$((", "BASH_REMATCH", "case ", "scontrol", "events.jsonl", "accelpact_slurm.cli.ckptd",
                    "--drop-staging", "--keep-serving-on-sigterm", ".ready", ".stop-requested",
                    "accelpact_slurm.slurm.requeue", "printf '{"):
        assert spelled not in code, f"the template spells {spelled!r} itself"
    # every decision goes through the core's hooks; every rank's line is labelled
    for hook in ("job", "gpus", "serve", "usr2", "settle"):
        assert f"accelpact_slurm.cli.node {hook}" in code
    assert "STEP_OPTS=(--label" in code


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("status, expect", [(0, 0), (2, 2), (75, 75), (76, 76)])
def test_a_documented_status_is_passed_on_without_a_requeue(tmp_path, status, expect):
    proc, log = _run_template(tmp_path, {"FAKE_STEP_STATUS": str(status)})
    assert proc.returncode == expect, proc.stdout + proc.stderr
    assert f"training step exited with status {status}" in proc.stdout
    assert not (log / "scontrol").exists()  # 75: rank 0 asked already; 0, 2, 76: nothing to ask


def test_a_crash_nobody_decided_on_is_requeued_by_the_core(tmp_path):
    """A training step killed (status 137) with no decision in the event log: the core writes the requeue event
    (by template) and runs scontrol requeue; the job exits 75, as the embedded default relaunches such a crash."""
    proc, log = _run_template(tmp_path, {"FAKE_STEP_STATUS": "137"})
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert (log / "scontrol").read_text().splitlines() == ["requeue", "42"]
    (event,) = _events(tmp_path / "runs" / "42")
    assert (event["event"], event["by"], event["restart"]) == ("requeue", "template", 0)
    assert "crashed (exit status 137)" in event["reason"] and "requeued" in proc.stderr


def test_a_stop_the_ranks_decided_is_not_a_crash(tmp_path):
    """srun reports 143 once --kill-on-bad-exit ended the ranks after the first one left: the event log's
    decision (76: a bug) wins, and nothing is requeued."""
    run_dir = tmp_path / "runs" / "42"
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text(json.dumps({"ts": 1.0, "event": "fail_stop", "restart": 0,
                                                      "exit_code": 76}) + "\n")
    proc, log = _run_template(tmp_path, {"FAKE_STEP_STATUS": "143"})
    assert proc.returncode == 76, proc.stdout + proc.stderr
    assert not (log / "scontrol").exists()


def test_a_crash_while_slurm_ends_the_job_is_not_requeued(tmp_path):
    """The batch shell's own SIGTERM (scancel, the time limit, a requeue by someone) and then a killed step: the
    core is told (--ending) and requeues nothing (a requeue now would bring a cancelled job back)."""
    proc, log = _run_template(tmp_path, {"FAKE_STEP_STATUS": "143", "FAKE_TERM_BATCH": "1"})
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "Slurm is ending this job" in proc.stderr and "not requeued here" in proc.stderr
    assert not (log / "scontrol").exists() and _events(tmp_path / "runs" / "42") == []


# --------------------------------------------------------------------------- the torchrun form

#: The script's own arguments: a value with a space, quotes and a command substitution, and flags the launcher has
#: too (--run-dir, --nnodes): all the script's, as they are.
SCRIPT_ARGS = ("--steps", "9", "--lr=0.003", "a b 'c' $(touch pwned)", "--run-dir", "theirs", "--nnodes", "7")


def _rank_command(log: Path) -> argparse.Namespace:
    """The training step's command after ``python -m accelpact_slurm.cli.worker``, parsed as every rank parses it."""
    argv = (log / "training").read_text().splitlines()
    return worker.build_parser().parse_args(argv[argv.index("accelpact_slurm.cli.worker") + 1:])


def test_the_script_form_hands_every_rank_the_script_and_its_own_arguments(tmp_path):
    """``hsdp.sbatch [flags] train.py [its args]``: the core writes the effective job file (the script as the entry,
    the flags, the allocation's sizes) into the run directory, the daemons and ranks read it, and every rank gets
    the script's arguments untouched (its sys.argv[1:]).  A requeue (the same arguments, restart 1) gives the same
    file and command line.  Negative control: the template with the ranks' WORKER_ARGS left off its srun line --
    the ranks get no script arguments (the script's --steps 9 would not reach it: 20 updates, its default)."""
    script = tmp_path / "train.py"
    script.write_text("")
    args = ("--checkpoint-every", "4", "--inject-fault", "boundary:3:1", "train.py", *SCRIPT_ARGS)
    proc, log = _run_template(tmp_path, {}, args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "runs" / "42"
    rank = _rank_command(log)
    assert (rank.config, rank.run_dir) == (str(run_dir / "script-job.yaml"), str(run_dir))
    assert core.script_spec(rank).argv == SCRIPT_ARGS
    cfg = core.job_config(rank)
    assert cfg.entry == f"{script}:__main__" and cfg.checkpoint.every_steps == 4
    assert [str(f) for f in cfg.faults] == ["boundary:3:1"]
    assert (cfg.topology.nodes, cfg.topology.ranks_per_node) == (2, 4)  # the allocation's (2 nodes, 4 per node)
    assert (log / "daemons").read_text().splitlines()[-3:] == [rank.config, "--run-dir", str(run_dir)]
    assert not list(tmp_path.rglob("pwned"))  # the values went through the template's eval as values
    first, command = Path(rank.config).read_text(), (log / "training").read_text()
    again, log = _run_template(tmp_path, {"SLURM_RESTART_COUNT": "1"}, args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (log / "training").read_text() == command and Path(rank.config).read_text() == first
    text = TEMPLATE.read_text()
    assert text.count(' "${WORKER_ARGS[@]}" &') == 1
    mutant = tmp_path / "mutant.sbatch"
    mutant.write_text(text.replace(' "${WORKER_ARGS[@]}" &', " &"))
    _, log = _run_template(tmp_path, {}, args, template=mutant)
    assert core.script_spec(_rank_command(log)).argv == ()


@pytest.mark.parametrize("args, words", [
    (("--spare-nodes", "1", "train.py"), ["topology.spare_nodes: invalid value 1", "sbatch template"]),
    (("--nnodes", "3", "train.py", "--steps", "9"), ["--nnodes: invalid value 3", "the allocation has 2",
                                                     "--nodes=3"]),
    (("--master-port", "29500", "train.py"), ["--master-port: invalid value '29500': not supported by hsdp.sbatch"]),
    (("--max-restarts", "3", "train.py"), ["--max-restarts: invalid value 3: under the template Slurm requeues"]),
    (("--run-dir", "d", "job.yaml"), ["SCRIPT: invalid value 'job.yaml'", "a job file comes first"]),
    (("job.yaml", "run", "extra"), ["the job-file form takes CONFIG [RUN_DIR] only"]),
    (("--help",), ["usage: hsdp.sbatch"]),
])
def test_the_script_form_refuses_before_anything_starts(tmp_path, args, words):
    """Exit 2 (a requeue would not help) with the reason, before a daemon or a rank starts or a run directory is
    made; a --help goes to the job's output, never run as shell."""
    (tmp_path / "train.py").write_text("")
    proc, log = _run_template(tmp_path, {}, args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr
    assert list(log.iterdir()) == [] and not (tmp_path / "runs").exists()
    assert "command not found" not in proc.stderr and "hsdp.sbatch: job" not in proc.stdout
