"""The public API's objects on their own (no job): the redo signal and the live groups."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from accelpact_slurm.core.config import parse_config
from accelpact_slurm.runtime.api import Job
from accelpact_slurm.runtime.phases import Redo


def test_a_scripts_except_exception_cannot_swallow_the_redo_signal():
    with pytest.raises(Redo):
        try:
            raise Redo()
        except Exception:  # what a script wraps around optimizer.step()
            pytest.fail("Redo was caught by `except Exception`")
    assert issubclass(Redo, BaseException) and not issubclass(Redo, Exception)


def _runtime():
    layout = SimpleNamespace(world_size=4, num_nodes=2, ranks_per_node=2)
    return SimpleNamespace(rank=1, node=0, local_rank=1, layout=layout, device="cpu", mesh=object(),
                           shard_group="shard-0", replicate_group="replicate-0")


def test_job_groups_are_the_live_groups_after_a_repair_replaced_them():
    rt = _runtime()
    job = Job(parse_config("name: t\nentry: m:f\n"), rt, "/nonexistent", None, out=None)
    assert job.groups == ("shard-0", "replicate-0")
    rt.replicate_group, rt.shard_group = "replicate-1", "shard-1"  # what Runtime.adopt does after an L1 repair
    assert job.groups == ("shard-1", "replicate-1")
