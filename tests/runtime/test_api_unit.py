"""The public API's objects on their own (no job): the redo signal and the live groups."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from accelpact_slurm.core.config import parse_config
from accelpact_slurm.runtime.job.api import Job
from accelpact_slurm.runtime.job.phases import Redo


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


def _run_at_the_end_of_an_update(decided):
    """A Run and an Update as they stand when the update's block ends (only what _finish reads before it
    decides what the end means)."""
    from accelpact_slurm.runtime.job.api import Run, Update

    run = Run.__new__(Run)
    run.job = SimpleNamespace(_rt=None)
    ended = []
    run._tracker = SimpleNamespace(phase="backward", end=lambda: ended.append(True))
    run._current = None
    update = Update.__new__(Update)
    update.step, update._decided = 5, decided
    return run, update, ended


def test_a_redo_signal_the_script_caught_is_named_not_committed():
    """The vote discarded update 5 and optimizer.step() raised Redo, but the script caught it (``except
    BaseException``) and its block ended normally: the update must not commit; the error says what to change."""
    from accelpact_slurm.core.errors import UsageError

    run, update, ended = _run_at_the_end_of_an_update("redo")
    with pytest.raises(UsageError, match=r"optimizer.step\(\).*Redo caught by the script in update 5.*catch Exception"):
        run._finish(update, None)
    assert ended == [True]
    run, update, _ = _run_at_the_end_of_an_update("redo")
    assert run._finish(update, Redo()) is True  # the signal let through: the batch runs again


def _run_between_updates(job_file: str, *, step: int = 3, inside: int | None = None, closed: bool = False):
    """A Run as ``run.save()`` sees it before it takes anything: its job's configuration, its frontier, the
    update whose block is open (None between updates), whether it was closed."""
    from accelpact_slurm.runtime.job.api import Run, Update

    run = Run.__new__(Run)
    run.job = SimpleNamespace(config=parse_config(job_file))
    run.step, run._closed, run._current = step, closed, None
    if inside is not None:
        run._current = Update.__new__(Update)
        run._current.step = inside
    return run


SNAPSHOTS_ON = "name: t\nentry: m:f\ncheckpoint: {every_steps: 10}\n"


@pytest.mark.parametrize("job_file, kw, value, fix", [
    (SNAPSHOTS_ON, {"inside": 4}, "called inside update 4 (its with run.update() block is still open)",
     "call run.save() between updates, after the with block has closed"),
    ("name: t\nentry: m:f\n", {}, "a job without snapshots (checkpoint.every_steps is 0)",
     "set checkpoint.every_steps: N in the job file's checkpoint section"),
    (SNAPSHOTS_ON, {"closed": True}, "called after run.close()", "before the run is closed"),
    (SNAPSHOTS_ON, {"step": 0}, "called before the first update", "after an update has committed"),
])
def test_run_save_refuses_in_one_line_naming_the_call_what_was_wrong_and_the_fix(job_file, kw, value, fix):
    """Refused before anything is taken or any rank waits: no collective starts (every rank refuses alike)."""
    from accelpact_slurm.core.errors import UsageError

    run = _run_between_updates(job_file, **kw)
    with pytest.raises(UsageError) as got:
        run.save()
    msg = str(got.value)
    assert msg.startswith(f"run.save(): invalid value {value!r}: ") and fix in msg and "\n" not in msg, msg


def test_inside_an_update_is_named_before_a_job_without_snapshots():
    """The call's place is the script's first mistake to fix, whatever the job file says."""
    from accelpact_slurm.core.errors import UsageError

    with pytest.raises(UsageError, match="called inside update 2"):
        _run_between_updates("name: t\nentry: m:f\n", inside=2).save()
