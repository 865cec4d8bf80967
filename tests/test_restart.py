"""Pure L2 decisions: the frontier history of a run and the no-progress rule; the launcher's exit code."""

from __future__ import annotations

import pytest

from accelpact_slurm.errors import EXIT_NO_REQUEUE, EXIT_OK, EXIT_REQUEUE
from accelpact_slurm.launcher import combine_exit_codes
from accelpact_slurm.restart import Attempt, frontier_history, request_requeue, stalled


def ev(kind, restart, **fields):
    return {"event": kind, "restart": restart, **fields}


def test_history_takes_loads_steps_and_repairs():
    events = [
        ev("job_start", 0), ev("step", 0, step=1), ev("step", 0, step=2), ev("repair", 0, frontier=3),
        ev("fail_stop", 0), ev("job_start", 1), ev("restart_load", 1, step=2), ev("step", 1, step=3),
        ev("job_start", 2), ev("restart_load", 2, step=None), {"event": "step", "restart": "x", "step": 9},
    ]
    assert frontier_history(events) == [Attempt(0, 0, 3), Attempt(1, 2, 3), Attempt(2, 0, 0)]


@pytest.mark.parametrize("reached, k, stop", [
    ([0, 0, 0, 0], 3, True),       # faults before every commit: the first start and 3 restarts
    ([0, 0, 0], 3, False),         # not enough restarts yet
    ([5, 5, 5, 6], 3, False),      # the last restart advanced
    ([5, 8, 8, 8, 8], 3, True),    # advanced once, then stuck for 3
    ([5, 8, 8, 8, 8], 4, False),
    ([3, 2, 1, 3], 3, True),       # never past the best before the window
])
def test_stalled(reached, k, stop):
    history = [Attempt(i, 0, r) for i, r in enumerate(reached)]
    decision, reason = stalled(history, k)
    assert decision is stop
    if stop:
        assert f"{k} consecutive restarts" in reason


@pytest.mark.parametrize("codes, expected", [
    ([0, 0, 0, 0], EXIT_OK),
    ([0, EXIT_REQUEUE, None, 0], EXIT_REQUEUE),
    ([EXIT_REQUEUE, EXIT_NO_REQUEUE], EXIT_NO_REQUEUE),
    ([-9, 0], EXIT_REQUEUE),  # a crashed rank is a fail-stop
    ([2, EXIT_REQUEUE], 2),
])
def test_combine_exit_codes(codes, expected):
    assert combine_exit_codes(codes) == expected


def test_requeue_on_the_embedded_default_is_the_launchers(tmp_path):
    from accelpact_slurm.events import EventLog, read_events

    log = EventLog(tmp_path / "e.jsonl")
    assert request_requeue("1", "why", log, {}, emulated=True)
    log.close()
    (e,) = read_events(tmp_path / "e.jsonl")
    assert (e["event"], e["by"], e["reason"]) == ("requeue", "launcher", "why")


def test_requeue_failure_is_recorded(tmp_path):
    from accelpact_slurm.events import EventLog, read_events

    log = EventLog(tmp_path / "e.jsonl")
    ok = request_requeue("999999", "why", log, {"PATH": str(tmp_path)}, emulated=False)  # no scontrol on PATH
    log.close()
    (e,) = read_events(tmp_path / "e.jsonl")
    assert not ok and e["by"] == "scontrol" and e["accepted"] is False and e["detail"]
