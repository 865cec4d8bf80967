"""How a stopped rank ends (:mod:`accelpact_slurm.runtime.job.stopping`): a real process raises its stop into a script
that blocks, catches it or has a stop hook that never returns, and must still exit with the stop's code, in time.

Each case runs in a fresh interpreter: ``exit_stopped`` ends the process with ``os._exit``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from accelpact_slurm.core.errors import EXIT_NO_REQUEUE
from accelpact_slurm.runtime.job.stopping import STOP_GRACE_S, STOP_HOOKS_S
from tests.conftest import REPO

SCRIPT = """
import json, logging, os, sys, threading, time
from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_REQUEUE, FailStop, Stopped
from accelpact_slurm.core.events import EventLog
from accelpact_slurm.runtime.job import stopping

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
mode, marks = sys.argv[1], sys.argv[2]
log = EventLog(os.path.join(marks, "events.jsonl"), rank=0)

def stop(code=EXIT_NO_REQUEUE, why="the training code raised"):
    stopping.fail_stop(FailStop(why, code, cause="training-code", phase="script", frontier=None,
                                decided_at=time.monotonic()), log, sys.stdout, lead=True)

def hook(stop):
    with open(os.path.join(marks, "hook.json"), "w") as fh:
        json.dump({"exit_code": stop.exit_code, "reason": stop.reason}, fh)

stopping.on_stop(hook)
if mode == "hung-hook":
    stopping.on_stop(lambda stop: threading.Event().wait())  # the script's hook never returns
try:
    if mode == "hung-hook":
        stop()
    try:
        stop()
    except BaseException:  # the script catches its stop
        pass
    if mode == "again":
        stop(EXIT_REQUEUE, "a second stop")  # and stops again, e.g. an error in its own finally
    threading.Event().wait()  # or blocks, e.g. in a collective whose peers are gone
except Stopped as stopped:
    stopping.exit_stopped(stopped)
"""


def _stop(tmp_path, mode):
    script = tmp_path / "stop.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), mode, str(tmp_path)], capture_output=True, text=True,
                          timeout=STOP_GRACE_S + STOP_HOOKS_S + 30, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    hook = tmp_path / "hook.json"
    return proc, time.monotonic() - t0, json.loads(hook.read_text()) if hook.exists() else None


def test_a_stop_hook_that_never_returns_is_left_behind_at_its_deadline(tmp_path):
    """The first hook runs; the second never returns: the rank exits with the stop's code once the hooks'
    deadline passed, and its log says so.

    Negative control: ``exit_stopped`` joining the hooks' thread without the deadline: the process never exits
    (the subprocess's deadline fails the test)."""
    proc, took, hook = _stop(tmp_path, "hung-hook")
    assert proc.returncode == EXIT_NO_REQUEUE, proc.stdout + proc.stderr
    assert hook == {"exit_code": EXIT_NO_REQUEUE, "reason": "the training code raised"}
    assert STOP_HOOKS_S <= took < STOP_HOOKS_S + 20
    assert f"the stop hooks did not return within {STOP_HOOKS_S:g} s; the rank exits 76 without them" in proc.stderr


def test_a_script_that_catches_its_stop_and_blocks_still_exits_after_the_grace(tmp_path):
    """The script catches ``Stopped`` (``except BaseException``) and blocks: the grace's timer ends the rank with
    the stop's code, its hooks run first, and its log says why.

    Negative control: ``fail_stop`` without the grace's timer: the process blocks for ever (the subprocess's
    deadline fails the test)."""
    proc, took, hook = _stop(tmp_path, "block")
    assert proc.returncode == EXIT_NO_REQUEUE, proc.stdout + proc.stderr
    assert hook is not None and hook["exit_code"] == EXIT_NO_REQUEUE
    assert STOP_GRACE_S <= took < STOP_GRACE_S + 20
    assert f"the script did not unwind within {STOP_GRACE_S:g} s of its stop; the rank exits 76" in proc.stderr


def test_a_second_stop_raises_the_first_one_again(tmp_path):
    """A script that caught its stop and stops again (its ``finally`` raised): one decision per rank, the first
    one (76, not the second's 75), one ``fail_stop`` event, the hooks run once with it.

    Negative control: without the re-raise at the top of ``fail_stop``, the second stop decides again, writes into
    the event log the first one closed, and the rank dies of that ``ValueError`` (exit 1, not 76)."""
    from accelpact_slurm.core.events import read_events

    proc, _, hook = _stop(tmp_path, "again")
    assert proc.returncode == EXIT_NO_REQUEUE, proc.stdout + proc.stderr
    assert hook == {"exit_code": EXIT_NO_REQUEUE, "reason": "the training code raised"}
    stops = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "fail_stop"]
    assert [e["exit_code"] for e in stops] == [EXIT_NO_REQUEUE], stops


@pytest.mark.parametrize("hook", [None, 3])
def test_job_on_stop_refuses_what_it_cannot_call(hook):
    from accelpact_slurm.core.errors import UsageError
    from accelpact_slurm.runtime.job.api import Job

    with pytest.raises(UsageError, match="job.on_stop: invalid value .*: pass a function taking one argument"):
        Job.on_stop(object.__new__(Job), hook)  # type: ignore[arg-type]
