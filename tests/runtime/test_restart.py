"""Pure L2 decisions: the frontier history of a run and the no-progress rule; the launcher's exit code."""

from __future__ import annotations

import pytest

from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_OK, EXIT_REQUEUE
from accelpact_slurm.launch.local import combine_exit_codes
from accelpact_slurm.slurm.requeue import Attempt, frontier_history, request_requeue, stalled


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
    from accelpact_slurm.core.events import EventLog, read_events

    log = EventLog(tmp_path / "e.jsonl")
    assert request_requeue("1", "why", log, {}, emulated=True)
    log.close()
    (e,) = read_events(tmp_path / "e.jsonl")
    assert (e["event"], e["by"], e["reason"]) == ("requeue", "launcher", "why")


def test_requeue_failure_is_recorded(tmp_path):
    from accelpact_slurm.core.events import EventLog, read_events

    log = EventLog(tmp_path / "e.jsonl")
    ok = request_requeue("999999", "why", log, {"PATH": str(tmp_path)}, emulated=False)  # no scontrol on PATH
    log.close()
    (e,) = read_events(tmp_path / "e.jsonl")
    assert not ok and e["by"] == "scontrol" and e["accepted"] is False and e["detail"]


def _non_lead_fail_stop(port: int, events_path: str) -> None:
    """Rank 1 of 2 stopping for a requeue (runs in a spawned process; fail_stop raises the Stopped that
    exit_stopped ends the process with, as run_rank does)."""
    import datetime
    import sys
    import time

    import torch.distributed as dist

    from accelpact_slurm.runtime.transport.control import ControlPlane
    from accelpact_slurm.core.errors import FailStop
    from accelpact_slurm.core.events import EventLog
    from accelpact_slurm.core.errors import Stopped
    from accelpact_slurm.runtime.job.stopping import exit_stopped, fail_stop

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    control = ControlPlane(store, rank=1, world_size=2, timeout_s=30)
    stop = FailStop("test", EXIT_REQUEUE, phase="committed", frontier=3, decided_at=time.monotonic())
    try:
        fail_stop(stop, EventLog(events_path, rank=1), sys.stdout, lead=False, control=control)
    except Stopped as stopped:
        exit_stopped(stopped)


@pytest.mark.slow
def test_a_rank_leaves_a_requeue_stop_only_after_rank_0_asked_slurm(tmp_path):
    """srun --kill-on-bad-exit TERMs every task once one exits: a non-lead rank that exited first would have rank 0
    (still on its way into fail_stop) killed before it ran scontrol requeue. Negative control: without the wait in
    fail_stop the child exits as soon as it has announced its leave, and the first assertion fails."""
    import datetime
    import multiprocessing as mp

    import torch.distributed as dist

    from accelpact_slurm.runtime.transport.control import ControlPlane

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    lead = ControlPlane(store, rank=0, world_size=2, timeout_s=30)
    child = mp.get_context("spawn").Process(target=_non_lead_fail_stop, args=(store.port, str(tmp_path / "e.jsonl")))
    child.start()
    try:
        lead.store.wait(["leave/fail-stop/1"], datetime.timedelta(seconds=60))  # rank 1 is inside fail_stop
        child.join(timeout=2.0)  # it must still be there: rank 0 has not asked yet
        assert child.exitcode is None, f"rank 1 left (exit {child.exitcode}) before rank 0 asked for the requeue"
        lead.post("fail-stop-requeue-asked")
        child.join(timeout=60)
        assert child.exitcode == EXIT_REQUEUE
    finally:
        if child.is_alive():
            child.kill()
            child.join(timeout=10)


_STOP_WITHOUT_FRONTIER = """
import sys, time
from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, FailStop, Stopped
from accelpact_slurm.core.events import EventLog
from accelpact_slurm.runtime.job.stopping import exit_stopped, fail_stop
log = EventLog(sys.argv[1], rank=0)
for step in range(1, int(sys.argv[2]) + 1):
    log.emit("step", step=step)
try:
    fail_stop(FailStop("no snapshot can be restored: step 10: missing key", EXIT_NO_REQUEUE, cause="checkpoint",
                       phase="start", frontier=None, decided_at=time.monotonic()), log, sys.stdout, lead=True)
except Stopped as stop:
    exit_stopped(stop)
"""


@pytest.mark.parametrize("committed, words", [(13, "fail-stop at F=13 (the log's newest committed update) "
                                                   "(checkpoint): no snapshot can be restored"),
                                              (0, "fail-stop before any committed update (checkpoint): ")])
def test_a_stop_without_a_frontier_names_the_logs_newest_committed_update(tmp_path, committed, words):
    """A stop raised where no update number is at hand (a restore, the control plane) printed ``fail-stop at
    F=None`` although update 13 was committed.  A real rank process stops (``exit_stopped`` with the stop's code).

    Negative control: the old line (``F={info.get('frontier')}``) prints ``F=None`` in both cases.
    """
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    script = tmp_path / "stop.py"
    script.write_text(_STOP_WITHOUT_FRONTIER)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "events.jsonl"), str(committed)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == EXIT_NO_REQUEUE, proc.stdout + proc.stderr
    assert words in proc.stdout and "None" not in proc.stdout, proc.stdout + proc.stderr
