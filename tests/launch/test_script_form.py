"""accelpact-run's torchrun form (accelpact_slurm/launch/script.py) and the package's init() (no rank spawned).

The command line: the script's own arguments pass through untouched, torchrun's flags this launcher needs mean the
same, the ones it cannot honour are refused in one line (exit 2) before anything starts, and a job file's form is
told apart by its suffix.  The job: a job file is optional, the one it names fixes steps and seed, and the
script's init(steps=..., seed=...) against it is an error naming both values.
"""

from __future__ import annotations

import types

import pytest

from accelpact_slurm.cli import run as run_cli
from accelpact_slurm.core.config import JobConfig, load_config, with_overrides
from accelpact_slurm.core.errors import EXIT_USAGE, ConfigError, UsageError
from accelpact_slurm.core.script import Fixed, ScriptSpec, is_script_entry
from accelpact_slurm.launch import core
from accelpact_slurm.launch import script as form
from accelpact_slurm.runtime.job import script as rank_side


@pytest.fixture(autouse=True)
def no_job_served():
    """Every test starts and ends outside a job (the package's init() keeps its job per process)."""
    rank_side._served = None
    yield
    rank_side._served = None


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('never run here')\n")
    return path


def _parse(argv):
    return form.parse(run_cli.build_script_parser(), argv)


# --------------------------------------------------------------------------- the command line


def test_the_scripts_own_arguments_pass_through_untouched(script):
    args = _parse(["--nnodes", "2", "--nproc-per-node", "2", "--run-dir", "d", str(script), "--steps", "20",
                   "--nnodes", "3", "--lr=0.1", "pos"])
    assert (args.nnodes, args.nproc_per_node, args.run_dir) == (2, 2, "d")
    assert args.script == str(script)
    assert args.script_args == ["--steps", "20", "--nnodes", "3", "--lr=0.1", "pos"]  # the script's, not ours
    cfg, spec = form.script_job(args)
    assert spec.argv == ("--steps", "20", "--nnodes", "3", "--lr=0.1", "pos")
    assert (cfg.topology.nodes, cfg.topology.ranks_per_node) == (2, 2)
    assert is_script_entry(cfg.entry) and cfg.entry == f"{script}:__main__" and cfg.name == "train"


def test_torchruns_spellings_mean_the_same(script):
    args = _parse(["--standalone", "--nproc_per_node=3", "--nnodes", "1:1", "--max_restarts", "4", "--node-rank",
                   "0", str(script)])
    cfg, _ = form.script_job(args)
    assert (cfg.topology.nodes, cfg.topology.ranks_per_node, cfg.recovery.max_restarts) == (1, 3, 4)


@pytest.mark.parametrize("argv, flag", [
    (["--nnodes", "1:4"], "--nnodes"),
    (["--nproc-per-node", "auto"], "--nproc-per-node"),
    (["--nproc-per-node", "0"], "--nproc-per-node"),
    (["--node-rank", "1"], "--node-rank"),
    (["--rdzv-endpoint", "host:29400"], "--rdzv-endpoint"),
    (["--rdzv_backend", "c10d"], "--rdzv_backend"),
    (["--master-port", "29500"], "--master-port"),
    (["--no-python"], "--no-python"),
    (["--log-dir", "x"], "--log-dir"),
    (["--steps", "7"], "--steps"),  # the script's flag before its path: the script's init() is the one source
])
def test_a_flag_it_cannot_honour_is_refused_in_one_line_before_anything_starts(argv, flag, script, tmp_path,
                                                                               capsys):
    run_dir = tmp_path / "run"
    assert run_cli.main([*argv, "--run-dir", str(run_dir), str(script), "--steps", "3"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"accelpact-run: error: {flag}: "), err
    assert not run_dir.exists()  # refused before the run directory, a daemon or a rank


def test_help_lists_torchruns_flags_and_both_forms(capsys):
    with pytest.raises(SystemExit) as done:
        run_cli.main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--nnodes", "--nproc-per-node", "--standalone", "--max-restarts", "--node-rank", "--module",
                 "--rdzv-endpoint", "--master-addr", "--no-python", "--spare-nodes", "--run-dir", "--inject-fault"):
        assert flag in out
    assert "JOB.yaml" in out and "SCRIPT.py" in out


def test_the_job_file_form_is_told_apart_by_its_suffix(script, tmp_path):
    job, script_p = run_cli.build_parser(), run_cli.build_script_parser()
    assert form.script_mode([str(script), "--x"], job, script_p)
    assert form.script_mode(["-m", "pkg.train"], job, script_p)
    assert form.script_mode(["--config", "job.yaml", "--run-dir", "a.yaml", str(script)], job, script_p)
    assert not form.script_mode(["job.yaml", "--steps", "3"], job, script_p)
    assert not form.script_mode(["--run-dir", "x.py", "job.yml"], job, script_p)
    with pytest.raises(ConfigError, match="give a training script"):
        form.script_mode(["notes.txt"], job, script_p)


def test_the_ranks_get_the_spec_through_the_worker_flags(script):
    args = _parse(["--inject-fault", "boundary:12:1", str(script), "--steps", "20"])
    cfg, spec = form.script_job(args)
    passed = form.worker_args(args, spec)
    worker = core.add_job_flags(__import__("argparse").ArgumentParser()).parse_args(["job.yaml", *passed])
    assert core.script_spec(worker) == spec
    assert [str(f) for f in cfg.faults] == ["boundary:12:1"]


# --------------------------------------------------------------------------- the job: optional file, one source


def test_without_a_job_file_every_field_has_its_default(script, tmp_path):
    cfg, spec = form.script_job(_parse([str(script)]))
    default = JobConfig()
    assert (cfg.steps, cfg.seed, cfg.checkpoint, cfg.timeouts) == (default.steps, default.seed, default.checkpoint,
                                                                   default.timeouts)
    assert spec.fixed == {}
    path = form.write_job_file(cfg, str(tmp_path))  # what every rank and daemon reads
    assert load_config(path) == cfg


def test_a_job_file_fixes_steps_and_seed_and_may_not_name_an_entry(script, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("steps: 20\nseed: 5\ncheckpoint:\n  every_steps: 4\n")
    cfg, spec = form.script_job(_parse(["--config", str(job), str(script)]))
    assert cfg.checkpoint.every_steps == 4
    assert spec.fixed == {"steps": Fixed(20, f"the job file {job}"), "seed": Fixed(5, f"the job file {job}")}
    job.write_text("entry: train:main\n")
    with pytest.raises(ConfigError, match="is the entry of this form"):
        form.script_job(_parse(["--config", str(job), str(script)]))


def _served(cfg: JobConfig, fixed: dict) -> types.SimpleNamespace:
    job = types.SimpleNamespace(config=cfg, steps=cfg.steps, seed=cfg.seed, run=None)
    rank_side.serve(job, ScriptSpec(fixed=fixed))  # type: ignore[arg-type]
    return job


def test_init_takes_the_scripts_values_and_names_both_on_a_conflict():
    job = _served(JobConfig(), {})
    assert rank_side.init(steps=7, seed=3) is job
    assert (job.steps, job.seed, job.config.steps, job.config.seed) == (7, 3, 7, 3)
    assert rank_side.init() is job  # a second call, no values: the same job
    with pytest.raises(UsageError, match="steps=7"):
        rank_side.init(steps=8)

    _served(JobConfig(), {"steps": Fixed(20, "the job file a.yaml")})
    with pytest.raises(ConfigError) as err:
        rank_side.init(steps=30)
    text = str(err.value)
    assert "steps=30" in text and "steps: 20" in text and "a.yaml" in text  # both values, and where the other is
    assert rank_side.init(steps=20).steps == 20  # agreeing values are fine


def test_init_checks_an_injected_fault_against_the_scripts_steps_and_comes_before_protect():
    _served(with_overrides(JobConfig(), {"faults": ["boundary:12:1"]}), {})
    with pytest.raises(ConfigError, match=r"faults\[0\].*STEP must be <= steps \(7\)"):
        rank_side.init(steps=7)
    job = _served(JobConfig(), {})
    job.run = object()  # protect() came first
    with pytest.raises(UsageError, match="before job.protect"):
        rank_side.init(steps=9)
