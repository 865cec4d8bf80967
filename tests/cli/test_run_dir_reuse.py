"""A run directory remembers what its first start trained; a rerun with another training is refused in one line."""

from __future__ import annotations

import json

import pytest

from accelpact_slurm.cli.run import TRAINING_FILE, check_same_training
from accelpact_slurm.core.config import load_config, training_diff, training_part, with_overrides
from accelpact_slurm.core.errors import ConfigError
from tests.conftest import DECODER_JOB, decoder_text, run_cli


def test_training_diff_names_dotted_keys():
    old = {"seed": 1, "steps": 5, "params": {"width": 64, "lr": 0.1}, "entry": "a:b"}
    new = {"seed": 2, "steps": 5, "params": {"width": 128, "lr": 0.1, "extra": 1}, "entry": "a:b"}
    assert training_diff(old, new) == ["params.extra", "params.width", "seed"]
    assert training_diff(old, old) == []


def test_first_start_records_and_a_rerun_with_the_same_training_passes(tmp_path):
    cfg = load_config(DECODER_JOB)
    check_same_training(cfg, str(tmp_path), allow=False)
    assert json.loads((tmp_path / TRAINING_FILE).read_text()) == json.loads(json.dumps(training_part(cfg)))
    # timeouts, faults and cadence are not the training: a requeue may change them
    check_same_training(with_overrides(cfg, {"timeouts.collective_s": 2, "checkpoint.every_steps": 3}),
                       str(tmp_path), allow=False)


def test_another_seed_or_model_size_is_refused_unless_allowed(tmp_path):
    cfg = load_config(DECODER_JOB)
    check_same_training(cfg, str(tmp_path), allow=False)
    changed = with_overrides(cfg, {"seed": 99, "params": {**cfg.params, "width": 128}})
    with pytest.raises(ConfigError, match=r"other values of params\.width, seed: use another --run-dir"):
        check_same_training(changed, str(tmp_path), allow=False)
    check_same_training(changed, str(tmp_path), allow=True)  # deliberate: the new training is recorded
    assert json.loads((tmp_path / TRAINING_FILE).read_text())["seed"] == 99


def test_the_cli_exits_2_with_one_line_before_starting_anything(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(decoder_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = training_part(load_config(job))
    (run_dir / TRAINING_FILE).write_text(json.dumps({**first, "seed": first["seed"] + 1}))
    proc = run_cli(["accelpact_slurm.cli.run", str(job), "--run-dir", str(run_dir)], timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "other values of seed" in lines[0], proc.stderr
    assert not (run_dir / "events.jsonl").exists()
