"""The job file: defaults, overrides, and one clear line for every kind of bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from accelpact_slurm.core.config import (
    FaultSpec, JobConfig, check_timeouts, load_config, parse_config, with_overrides, TimeoutConfig,
)
from accelpact_slurm.core.errors import ConfigError

TINY = "examples/decoder/job.yaml"


def test_shipped_example_loads_as_the_embedded_default():
    cfg = load_config(TINY)
    assert (cfg.topology.nodes, cfg.topology.ranks_per_node) == (2, 2)
    assert cfg.world_size == 4
    assert cfg.steps == 25 and cfg.faults == ()
    with pytest.raises(Exception):
        cfg.steps = 3  # frozen


def test_empty_file_gives_defaults():
    assert parse_config("") == JobConfig()


def test_shared_tier_is_on_by_default_and_in_both_examples():
    c = parse_config("").checkpoint
    assert (c.shared_every, c.shared_keep) == (2, 2)
    for path in (TINY, "examples/vision/job.yaml"):
        with open(path, encoding="utf-8") as fh:
            assert "shared_every:" in fh.read(), path  # set, with its comment, where users copy from
        assert load_config(path).checkpoint.shared_every == 2


def test_gpu_example_loads_with_one_gpu_per_rank():
    path = "examples/vision/job-gpu.yaml"
    cpu, gpu = load_config("examples/vision/job.yaml"), load_config(path)
    t = gpu.topology
    assert (t.device, t.nodes, t.ranks_per_node) == ("cuda", 2, 4)
    assert gpu.entry == cpu.entry and gpu.params["precision"] == "bf16" and gpu.params["fsdp"] == "fsdp2"
    assert gpu.checkpoint.shared_every == 2 and gpu.faults == ()
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    # The submission commands in its comments ask for what its topology says: a GPU and the threads per rank.
    rpn, threads = t.ranks_per_node, t.threads_per_rank
    assert (f"sbatch --nodes={t.nodes} --ntasks-per-node={rpn} --gpus-per-node={rpn} --cpus-per-task={threads} "
            f"sbatch_templates/hsdp.sbatch {path}") in text
    assert f"accelpact-submit {path} --gpus-per-node {rpn} --cpus-per-task {threads}" in text


def test_digest_is_stable_and_sensitive():
    a, b = load_config(TINY), load_config(TINY)
    assert a.digest() == b.digest()
    assert with_overrides(a, {"seed": a.seed + 1}).digest() != a.digest()


@pytest.mark.parametrize(
    "text, field, words",
    [
        ("steps: 10\nmodel: [1, 2\n", "config", "malformed YAML at line"),
        ("stepz: 10\n", "stepz", "unknown key"),
        ("timeouts:\n  layerz: 3\n", "timeouts.layerz", "unknown key"),
        ("steps: -3\n", "steps", "must be >= 0"),
        ("steps: ten\n", "steps", "must be an integer"),
        ("steps: true\n", "steps", "must be an integer"),
        ("timeouts:\n  collective_s: 30\n  control_s: 30\n", "timeouts.collective_s", "shorter than timeouts.control_s"),
        ("timeouts:\n  collective_s: 40\n  control_s: 30\n", "timeouts.collective_s", "shorter than timeouts.control_s"),
        ("timeouts:\n  control_s: -1\n", "timeouts.control_s", "positive"),
        ("checkpoint:\n  keep_last: 1\n", "checkpoint.keep_last", "must be >= 2"),
        ("checkpoint:\n  shared_every: -1\n", "checkpoint.shared_every", "must be >= 0"),
        ("checkpoint:\n  shared_keep: 0\n", "checkpoint.shared_keep", "keeps at least its newest verified copy"),
        ("topology:\n  nodes: 0\n", "topology.nodes", ">= 1"),
        ("topology:\n  spare_nodes: -1\n", "topology.spare_nodes", "must be >= 0"),
        ("topology:\n  spare_nodes: one\n", "topology.spare_nodes", "must be an integer"),
        ("faults: [sideways:3:0]\n", "faults[0]", "PHASE must be one of"),
        ("steps: 5\nfaults: [boundary:6:0]\n", "faults[0]", "STEP must be <= steps (5)"),
        ("faults: [boundary:3:4]\n", "faults[0]", "RANK must be < the world size (4)"),
        ("faults: [boundary:3]\n", "faults[0]", "PHASE:STEP:RANK"),
        ("- just\n- a list\n", "config", "mapping"),
        ("timeouts: 3\n", "timeouts", "mapping"),
        ("params: 3\n", "params", "mapping"),
        ("entry: train\n", "entry", "module:function"),
        ("log_every: 0\n", "log_every", ">= 1"),
    ],
)
def test_bad_input_names_field_value_and_fix(text, field, words):
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    msg = str(info.value)
    assert info.value.field == field
    assert msg.startswith(field + ":")
    assert words in msg
    assert "\n" not in msg


def test_timeout_relation_is_a_pure_decision():
    ok, reason = check_timeouts(TimeoutConfig(collective_s=5, control_s=30))
    assert ok and "shorter" in reason
    ok, reason = check_timeouts(TimeoutConfig(collective_s=30, control_s=30))
    assert not ok and "30" in reason


def test_fault_spec_round_trip():
    f = FaultSpec.parse("backward:7:3")
    assert (f.phase, f.step, f.rank) == ("backward", 7, 3)
    assert str(f) == "backward:7:3"


def test_overrides_reject_unknown_keys():
    cfg = load_config(TINY)
    assert with_overrides(cfg, {"steps": 3, "topology.nodes": 1}).topology.nodes == 1
    with pytest.raises(ConfigError, match="no such configuration key"):
        with_overrides(cfg, {"checkpoint.depth": 3})


def test_config_error_pickles():
    import pickle

    err = ConfigError("steps", -1, "must be >= 0")
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err)


@pytest.mark.parametrize(
    "text, field",
    [
        ("steps: [1\n", "config"),
        ("bogus: 1\n", "bogus"),
        ("steps: -1\n", "steps"),
        ("timeouts:\n  collective_s: 60\n  control_s: 30\n", "timeouts.collective_s"),
    ],
)
def test_cli_prints_one_clear_line(tmp_path, text, field):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "accelpact_slurm.cli.run", str(bad), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"accelpact-run: error: {field}:")


# --------------------------------------------------------------------------- hostile job files


@pytest.mark.parametrize("field", ["collective_s", "control_s", "startup_s", "shutdown_s"])
@pytest.mark.parametrize("literal", [".nan", ".NaN", ".inf", "-.inf", "+.Inf"])
def test_non_finite_float_is_refused_with_the_field_named(field, literal):
    # .nan passes every `<= 0` and `>=` check; accepted, it crashes every rank at its first timeout.
    with pytest.raises(ConfigError) as info:
        parse_config(f"timeouts: {{{field}: {literal}}}\n")
    assert info.value.field == f"timeouts.{field}"
    assert "finite" in str(info.value) and "\n" not in str(info.value)


def test_non_finite_override_is_refused():
    with pytest.raises(ConfigError, match="timeouts.control_s.*finite"):
        with_overrides(load_config(TINY), {"timeouts.control_s": float("inf")})


def test_non_utf8_job_file_is_one_line(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_bytes(b"\xff\xfe steps: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    msg = str(info.value)
    assert msg.startswith("config:") and "is not UTF-8 text" in msg and "\n" not in msg


def _alias_bomb(levels: int) -> str:
    """The "billion laughs": each level is a list of nine aliases of the level below."""
    lines = ['  a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "params:\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize("text", [
    _alias_bomb(7) + "steps: *a6\n",  # today: a 30 MB "must be an integer" line
    _alias_bomb(9),  # today: accepted; the job_start event then expands it to gigabytes
    "params:\n  base: &b {lr: 0.1}\n  run: *b\n",
    "params:\n  base: &b {lr: 0.1}\n  run: {<<: *b, wd: 0.0}\n",
])
def test_yaml_aliases_are_refused_cheaply_in_one_short_line(text):
    assert len(text) < 700
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="job.yaml")
    msg = str(info.value)
    assert info.value.field == "config" and "alias" in msg and "line" in msg
    assert len(msg) < 400 and "\n" not in msg


def test_config_error_message_holds_at_most_200_characters_of_the_value():
    huge = "x" * 1_000_000
    msg = str(ConfigError("steps", huge, "must be an integer"))
    assert len(msg) < 300 and msg.startswith("steps: invalid value 'xxx") and msg.endswith("must be an integer")
    with pytest.raises(ConfigError) as info:
        parse_config(f"steps: {huge}\n")
    assert len(str(info.value)) < 300
    assert str(ConfigError("steps", -1, "must be >= 0")) == "steps: invalid value -1: must be >= 0"


@pytest.mark.parametrize("text", ["steps: " + "[" * 5000 + "\n", "params: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n"])
def test_deeply_nested_yaml_is_one_line(text):
    # PyYAML's composer recurses once per level: RecursionError, not a YAMLError.
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="job.yaml")
    assert info.value.field == "config" and "\n" not in str(info.value)


@pytest.mark.parametrize("text, words", [
    ("seed: " + "9" * 5000 + "\n", "4300 digits"),  # int() refuses more than 4300 digits
    ("name: 2024-13-45\n", "month must be in 1..12"),  # YAML reads it as a date
])
def test_value_yaml_cannot_convert_is_one_line(text, words):
    # Both are a plain ValueError from inside PyYAML, not a YAMLError.
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="job.yaml")
    assert info.value.field == "config" and words in str(info.value) and len(str(info.value)) < 400


def test_cli_non_utf8_job_file_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe steps: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "accelpact_slurm.cli.run", str(bad), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accelpact-run: error: config:") and "UTF-8" in lines[0]


def test_a_job_without_snapshots_gets_a_start_up_note_naming_the_field_and_the_cost():
    from accelpact_slurm.core.config import relaunch_resumes, snapshot_note

    note = snapshot_note(JobConfig(steps=40))
    assert note and "no snapshots are taken" in note and "checkpoint.every_steps" in note and "40" in note
    assert snapshot_note(parse_config("checkpoint: {every_steps: 5}")) is None
    assert snapshot_note(JobConfig(steps=0)) is None  # nothing to redo
    assert relaunch_resumes(5) == "it reloads the newest verified snapshot"
    assert relaunch_resumes(0).startswith("it starts again from update 1") and "every_steps is 0" in relaunch_resumes(0)
