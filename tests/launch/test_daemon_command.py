"""The daemon's command line carries what the shared-tier rotation needs; ``accelpact-ckptd`` fills the gaps
from Slurm's environment (the sbatch template passes neither flag) and the job file."""

from __future__ import annotations

import pytest

from accelpact_slurm.cli.ckptd import build_parser, placement
from accelpact_slurm.launch.ranks import daemon_command


def test_daemon_command_passes_node_count_and_cadence():
    cmd = daemon_command("job.yaml", "/run", "node2", 1, "42", restart=0, drain_s=30.0, num_nodes=4, every_steps=10)
    args = build_parser().parse_args(cmd[3:])  # after: python -m accelpact_slurm.cli.ckptd
    assert (args.node, args.node_index, args.num_nodes, args.every_steps) == ("node2", 1, 4, 10)
    bare = build_parser().parse_args(daemon_command("job.yaml", "/run", "n", 0, "42", restart=0, drain_s=1.0)[3:])
    assert bare.num_nodes is None and bare.every_steps is None


@pytest.mark.parametrize("flags, environ, expect", [
    ((1, 4), {}, (1, 4)),                                                    # flags win
    ((None, None), {"SLURM_JOB_ID": "7", "SLURM_NODEID": "2", "SLURM_JOB_NUM_NODES": "3"}, (2, 3)),
    ((None, None), {"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURM_NNODES": "5"}, (0, 5)),
    ((1, None), {}, (1, 2)),                                                 # embedded default: the job file's
    ((None, None), {"SLURM_JOB_ID": "7"}, (None, None)),                     # unknown: every node copies
    ((None, None), {"SLURM_JOB_ID": "7", "SLURM_NODEID": "x"}, (None, None)),
])
def test_placement_flag_then_slurm_then_job_file(flags, environ, expect):
    assert placement(*flags, 2, environ) == expect
