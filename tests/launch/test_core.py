"""The one launch core (accelpact_slurm/launch/core.py): the exit verdict every path acts on, the start-up checks
every rank runs, the rank labels, and that no launcher maps exit codes or starts a rank by itself."""

from __future__ import annotations

import ast
import io
import json
import os
import signal
from pathlib import Path

import pytest

from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_OK, EXIT_REQUEUE, EXIT_USAGE, ConfigError
from accelpact_slurm.launch import core
from tests.conftest import REPO, decoder_text

PKG = Path(REPO) / "accelpact_slurm"


# --------------------------------------------------------------------------- the exit verdict


@pytest.mark.parametrize("status, decided, ending, on_slurm, off_slurm", [
    (EXIT_OK, None, False, (core.DONE, EXIT_OK, False), (core.DONE, EXIT_OK, False)),
    (EXIT_USAGE, None, False, (core.STOP, EXIT_USAGE, False), (core.STOP, EXIT_USAGE, False)),
    # a bug in the training code (or no progress): stop, never requeue, never relaunch
    (EXIT_NO_REQUEUE, None, False, (core.STOP, EXIT_NO_REQUEUE, False), (core.STOP, EXIT_NO_REQUEUE, False)),
    # a fail-stop: rank 0 asked Slurm already; without Slurm the launcher relaunches in place
    (EXIT_REQUEUE, None, False, (core.REQUEUE, EXIT_REQUEUE, False), (core.RELAUNCH, EXIT_REQUEUE, False)),
    (EXIT_REQUEUE, None, True, (core.REQUEUE, EXIT_REQUEUE, False), (core.RELAUNCH, EXIT_REQUEUE, False)),
    # srun's 143 after --kill-on-bad-exit: what the ranks decided wins
    (143, EXIT_NO_REQUEUE, False, (core.STOP, EXIT_NO_REQUEUE, False), (core.STOP, EXIT_NO_REQUEUE, False)),
    (143, EXIT_REQUEUE, False, (core.REQUEUE, EXIT_REQUEUE, False), (core.RELAUNCH, EXIT_REQUEUE, False)),
    # a crash nobody decided on (a kill -9, a segfault, an exception outside the runtime): a fail-stop; on Slurm
    # the launcher side asks for the requeue
    (137, None, False, (core.REQUEUE, EXIT_REQUEUE, True), (core.RELAUNCH, EXIT_REQUEUE, False)),
    (-signal.SIGKILL, None, False, (core.REQUEUE, EXIT_REQUEUE, True), (core.RELAUNCH, EXIT_REQUEUE, False)),
    (1, None, False, (core.REQUEUE, EXIT_REQUEUE, True), (core.RELAUNCH, EXIT_REQUEUE, False)),
    # ... unless someone is ending the job (Slurm's SIGTERM to the batch shell, the user's to the launcher)
    (143, None, True, (core.STOP, 143, False), (core.STOP, 143, False)),
    (130, None, True, (core.STOP, 130, False), (core.STOP, 130, False)),
])
def test_one_verdict_for_every_path(status, decided, ending, on_slurm, off_slurm):
    """Slurm requeues what the embedded default and submitit's local executor relaunch in place: the same
    verdict otherwise, on every path."""
    for slurm, expect in ((True, on_slurm), (False, off_slurm)):
        v = core.exit_verdict(status, decided=decided, ending=ending, slurm=slurm)
        assert (v.action, v.exit_code, v.ask) == expect, (slurm, v)


def test_relaunch_in_place_is_bounded_and_never_relaunches_a_stop():
    crash = core.exit_verdict(-9, slurm=False)
    assert core.relaunch_in_place(crash, 0, 2) == (True, crash.reason)
    ok, why = core.relaunch_in_place(crash, 2, 2)
    assert not ok and "max_restarts (2)" in why
    for code in (EXIT_OK, EXIT_USAGE, EXIT_NO_REQUEUE):
        assert not core.relaunch_in_place(core.exit_verdict(code, slurm=False), 0, 20)[0]
    assert not core.relaunch_in_place(core.exit_verdict(143, ending=True, slurm=False), 0, 20)[0]


def _exit_code_comparisons(path: Path) -> list[str]:
    """Every comparison in ``path`` against a requeue/stop exit code (75, 76 or their names)."""
    names = {"EXIT_REQUEUE", "EXIT_NO_REQUEUE"}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Name) and sub.id in names) or (
                    isinstance(sub, ast.Constant) and type(sub.value) is int and sub.value in (EXIT_REQUEUE,
                                                                                                EXIT_NO_REQUEUE)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
                break
    return found


def test_only_the_core_maps_exit_codes():
    """No launcher (launch/, cli/) decides by itself what a 75 or a 76 means: they all ask core.exit_verdict.
    Negative control: before, launch/local.py (combine_exit_codes, the relaunch loop) and launch/submission.py
    (relaunch_decision) each compared exit codes themselves, and the template had its own case on them."""
    offenders = []
    for folder in ("launch", "cli"):
        for path in sorted((PKG / folder).glob("*.py")):
            if path.name != "core.py":
                offenders += _exit_code_comparisons(path)
    assert offenders == []
    assert _exit_code_comparisons(PKG / "launch" / "core.py")  # positive control: the scan finds the core's


def _calls(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def test_every_path_goes_through_the_core():
    """The worker entry (the template's and the embedded default's ranks) and submitit's RankTask start a rank
    through core.run_task (start_rank: check_same_training, mark_ready); both local launchers act on
    core.exit_verdict + core.relaunch_in_place; the template's end is core.settle_step.  Negative control:
    before, RankTask called run_rank itself and skipped check_same_training and mark_ready."""
    assert {"install_signals", "run_task"} <= _calls(PKG / "cli" / "worker.py")
    assert {"install_signals", "run_task"} <= _calls(PKG / "launch" / "submission.py")
    assert "run_rank" not in _calls(PKG / "launch" / "submission.py") | _calls(PKG / "cli" / "worker.py")
    assert {"check_same_training", "mark_ready", "check_run_dir", "claim"} <= _calls(PKG / "launch" / "core.py")
    assert {"exit_verdict", "relaunch_in_place"} <= _calls(PKG / "launch" / "local.py")
    assert {"decided_code", "exit_verdict", "relaunch_in_place"} <= _calls(PKG / "launch" / "submission.py")
    assert {"settle_step", "forward_usr2", "serve_node"} <= _calls(PKG / "cli" / "node.py")


def test_combine_exit_codes_is_the_verdicts():
    assert core.combine_exit_codes([0, None, 0]) == EXIT_OK
    assert core.combine_exit_codes([-9, EXIT_NO_REQUEUE, EXIT_REQUEUE]) == EXIT_NO_REQUEUE
    assert core.combine_exit_codes([EXIT_REQUEUE, EXIT_USAGE]) == EXIT_USAGE
    assert core.combine_exit_codes([0, 1]) == EXIT_REQUEUE


# --------------------------------------------------------------------------- the start-up checks


def _emulated(job_id: str, rank: int = 0) -> dict[str, str]:
    from accelpact_slurm.launch.ranks import rank_environ

    return rank_environ({"PATH": os.environ.get("PATH", "")}, job_id, rank, 2, 2, restart=0, data_port=1,
                        control_port=2)


def test_start_rank_checks_the_training_and_marks_ready(tmp_path):
    """What every rank runs before it joins, on every path: a run directory whose first start trained something
    else is refused with exit 2's error (as accelpact-run refuses it), and a rank that passed writes its ready
    marker (the batch script forwards USR2 only then)."""
    from accelpact_slurm.core.config import load_config, with_overrides
    from accelpact_slurm.slurm import signals

    job = tmp_path / "job.yaml"
    job.write_text(decoder_text())
    cfg = load_config(str(job))
    run_dir = tmp_path / "run"
    start = core.start_rank(cfg, str(run_dir), _emulated("local-7", rank=1))
    assert (start.ctx.rank, start.run_dir) == (1, str(run_dir))
    assert (run_dir / signals.READY_DIR / "0-1").exists()
    assert json.loads((run_dir / core.TRAINING_FILE).read_text())["seed"] == cfg.seed
    changed = with_overrides(cfg, {"seed": cfg.seed + 1})
    with pytest.raises(ConfigError, match="its first start trained with other values of seed"):
        core.start_rank(changed, str(run_dir), _emulated("local-7", rank=2))
    assert not (run_dir / signals.READY_DIR / "0-2").exists()  # refused before it said it was ready
    core.start_rank(changed, str(run_dir), _emulated("local-7", rank=3), allow_config_change=True)
    assert (run_dir / signals.READY_DIR / "0-3").exists()


def test_the_same_job_flags_on_both_launchers():
    """accelpact-run and accelpact-submit take the job-level flags from one helper (core.add_job_flags).
    Negative control: before, accelpact-submit had no --steps, --seed, --entry, --inject-fault nor
    --allow-config-change."""
    from accelpact_slurm.cli import run, submit, worker

    flags = ["job.yaml", "--run-dir", "d", "--steps", "3", "--seed", "5", "--entry", "m:f", "--spare-nodes", "1",
             "--inject-fault", "boundary:1:1", "--allow-config-change"]
    parsed = [p.parse_args(flags) for p in (run.build_parser(), submit.build_parser(), worker.build_parser())]
    assert len({tuple(core.worker_args(a)) for a in parsed}) == 1
    assert core.worker_args(parsed[0]) == flags[3:]
    job_level = {a.dest for a in core.add_job_flags(__import__("argparse").ArgumentParser())._actions}
    for p in (run.build_parser(), submit.build_parser()):
        assert job_level <= {a.dest for a in p._actions}


def test_submit_refuses_a_changed_training_as_accelpact_run_does(tmp_path):
    """accelpact-submit with a run directory whose first start trained another seed: refused before anything is
    submitted, with the same one-line error and exit 2 as accelpact-run.  Negative control: before, the job was
    submitted and its ranks trained on."""
    from tests.conftest import run_cli

    job = tmp_path / "job.yaml"
    job.write_text(decoder_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    from accelpact_slurm.core.config import load_config, training_part

    first = json.loads(json.dumps(training_part(load_config(str(job)))))
    (run_dir / core.TRAINING_FILE).write_text(json.dumps({**first, "seed": first["seed"] + 1}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    outs = {}
    for module in ("accelpact_slurm.cli.run", "accelpact_slurm.cli.submit"):
        extra = ["--local"] if module.endswith("submit") else []
        proc = run_cli([module, str(job), "--run-dir", str(run_dir), *extra], env=env, timeout=120)
        assert proc.returncode == EXIT_USAGE, proc.stdout[-2000:] + proc.stderr[-2000:]
        outs[module] = proc.stderr.strip().split(": error: ", 1)[1]
    assert len(set(outs.values())) == 1 and "other values of seed" in outs["accelpact_slurm.cli.run"], outs
    assert not (run_dir / "submitit").exists()


# --------------------------------------------------------------------------- rank labels


def test_rank_label_is_srun_labels_form():
    assert core.rank_label(3, 4) == "3: "
    assert core.rank_label(3, 12) == " 3: " and core.rank_label(11, 12) == "11: "
    buf = io.StringIO()
    w = core.LabelledWriter(buf, "2: ")
    w.write("a\nb")
    w.write("c\n\nd\n")
    assert buf.getvalue() == "2: a\n2: bc\n2: \n2: d\n"


def test_the_terminal_echo_of_rank_0_says_its_rank_once():
    """A log record in rank 0's own file reads ``[rank 0] ...``; echoed to the terminal it reads ``0: ...``.
    Negative control: without ``drop`` the echo read ``0: [rank 0] ...``."""
    from accelpact_slurm.runtime.job.entry import record_label

    buf = io.StringIO()
    w = core.LabelledWriter(buf, "0: ", record_label(0))
    w.write("[rank 0] WARNING x\n[rank 0] Traceback\nplain [rank 0] kept\n")
    assert buf.getvalue() == "0: WARNING x\n0: Traceback\n0: plain [rank 0] kept\n"
    buf = io.StringIO()
    core.LabelledWriter(buf, "0: ").write("[rank 0] WARNING x\n")
    assert buf.getvalue() == "0: [rank 0] WARNING x\n"


def test_accelpact_run_is_a_launcher_only(tmp_path):
    """Inside a Slurm task accelpact-run does not turn into a rank: it refuses with the fix (the ranks run the
    worker entry).  Negative control: before, the same command joined the job as SLURM_PROCID's rank."""
    from tests.conftest import run_cli

    with open(os.path.join(REPO, "tests", "data", "slurm_env", "srun_2x2.json")) as fh:
        task = json.load(fh)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **task}
    job = tmp_path / "job.yaml"
    job.write_text(decoder_text())
    proc = run_cli(["accelpact_slurm.cli.run", str(job), "--run-dir", str(tmp_path / "run")], env=env, timeout=120)
    assert proc.returncode == EXIT_USAGE, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "is not a task of one" in proc.stderr and "accelpact_slurm.cli.worker" in proc.stderr
    assert not (tmp_path / "run").exists()
