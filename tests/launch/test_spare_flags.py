"""``--spare-nodes K`` and ``topology.spare_nodes``: the flag wins over the file, a bad value is one line naming the
field, and the launchers that do not start spares yet refuse them before anything starts.  Pure (no rank spawned)."""

from __future__ import annotations

import argparse

import pytest

from accelpact_slurm.cli import node as node_cli
from accelpact_slurm.cli import submit as submit_cli
from accelpact_slurm.core.errors import EXIT_USAGE, ConfigError
from accelpact_slurm.launch import core
from accelpact_slurm.launch.ranks import spare_args, spare_environ
from tests.conftest import job_text


def _job(tmp_path, spares=None):
    text = job_text()
    if spares is not None:
        text = text.replace("topology:", f"topology:\n  spare_nodes: {spares}", 1)
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def _cfg(*argv):
    return core.job_config(core.add_job_flags(argparse.ArgumentParser()).parse_args(list(argv)))


def test_the_flag_wins_over_the_file_which_wins_over_the_default(tmp_path):
    assert _cfg(_job(tmp_path)).topology.spare_nodes == 0  # the default: no spares
    job = _job(tmp_path, 1)
    assert _cfg(job).topology.spare_nodes == 1
    assert _cfg(job, "--spare-nodes", "2").topology.spare_nodes == 2
    assert _cfg(job, "--spare-nodes", "0").topology.spare_nodes == 0
    with pytest.raises(ConfigError) as info:
        _cfg(job, "--spare-nodes", "-1")
    assert str(info.value).startswith("topology.spare_nodes: invalid value -1:") and "\n" not in str(info.value)


def test_submit_and_the_template_refuse_spares_before_anything_starts(tmp_path, capsys):
    """Negative control: the same job file with --spare-nodes 0 passes both checks."""
    job = _job(tmp_path, 1)
    assert submit_cli.main([job, "--local"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("accelpact-submit: error: topology.spare_nodes:") and "\n" not in err
    assert node_cli.main(["gpus", "--job-file", job]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("hsdp.sbatch: error: topology.spare_nodes:") and "sbatch template" in err
    assert submit_cli.effective_config(submit_cli.build_parser().parse_args([job, "--spare-nodes", "0"]))
    assert node_cli.main(["gpus", "--job-file", _job(tmp_path, 0)]) == 0


def test_a_spare_sees_the_rendezvous_and_no_allocation():
    env = spare_environ({"SLURM_JOB_ID": "9", "HOME": "/h"}, data_port=11, control_port=12)
    assert "SLURM_JOB_ID" not in env and env["HOME"] == "/h"
    assert (env["ACCELPACT_MASTER_PORT"], env["ACCELPACT_EMULATED"]) == ("11", "1")
    args = spare_args("/j.yaml", "/r", ["--steps", "3"], job_id="local-1", step="0", restart=2, node=2,
                      local_rank=1, hostname="node3")
    from accelpact_slurm.cli.spare import build_parser

    parsed = build_parser().parse_args(args)
    assert (parsed.job_id, parsed.step, parsed.restart, parsed.node, parsed.local_rank, parsed.steps) == (
        "local-1", "0", 2, 2, 1, 3)
