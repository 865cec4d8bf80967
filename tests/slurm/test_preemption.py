"""A preemption's SIGTERM: which signals ask for snapshot-then-requeue, and when rank 0 may requeue after one.

The decisions are pure; the handler and the requeue request run for real (a child process that gets SIGTERM,
a stand-in ``scontrol`` on PATH that answers like the controller and records what it was asked).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from accelpact_slurm.core.events import EventLog, read_events
from accelpact_slurm.slurm.requeue import request_requeue, requeue_after_sigterm
from accelpact_slurm.slurm.signals import stop_signals
from tests.conftest import REPO


def test_sigterm_asks_for_a_snapshot_only_in_a_real_slurm_task():
    assert stop_signals(emulated=False) == (signal.SIGUSR2, signal.SIGTERM)
    assert stop_signals(emulated=True) == (signal.SIGUSR2,)  # the embedded default: SIGTERM still stops the job


@pytest.mark.parametrize("state, go", [
    ("RUNNING", True),       # a preemption's first SIGTERM (or scancel --signal=TERM): the job still runs
    (None, True),            # no answer: keep the preempted job's work
    ("COMPLETING", False),   # scancel, the time limit, a requeue already under way
    ("PENDING", False),      # requeued already (by Slurm at the end of the grace time, or by someone)
    ("REQUEUED", False),
    ("CANCELLED", False),
])
def test_requeue_after_sigterm_only_while_the_job_runs(state, go):
    decision, reason = requeue_after_sigterm(state)
    assert decision is go and reason
    if not go:
        assert state in reason and "not requeued" in reason


_CHILD = """
import os, signal, sys, time
from accelpact_slurm.slurm import signals
signals.install(signals.stop_signals(emulated=sys.argv[1] == "1"))
os.kill(os.getpid(), signal.SIGTERM)
deadline = time.monotonic() + 10
while not signals.requested() and time.monotonic() < deadline:
    time.sleep(0.01)
signals.request(signal.SIGUSR2)  # the vote may add the pre-timeout warning
print(signals.requested(), signals.reason(), ",".join(signals.received()), flush=True)
"""


@pytest.mark.parametrize("emulated", [False, True])
def test_sigterm_sets_the_flag_in_a_slurm_task_and_kills_on_the_embedded_default(emulated):
    proc = subprocess.run([sys.executable, "-c", _CHILD, "1" if emulated else "0"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    if emulated:
        assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.split() == ["True", "SIGUSR2", "SIGTERM,SIGUSR2"]


def _fake_scontrol(tmp_path, state: str) -> dict[str, str]:
    """A ``scontrol`` that answers ``show job`` with ``state`` and records every call in ``calls.txt``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f"""#!/bin/sh
echo "$*" >> "{tmp_path}/calls.txt"
if [ "$1" = show ]; then echo "JobId=$4 JobName=x JobState={state} Reason=None"; fi
exit 0
""")
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("state, asked", [("RUNNING", True), ("COMPLETING", False)])
def test_rank_0_asks_the_controller_before_a_requeue_after_sigterm(tmp_path, state, asked):
    """Negative control: without ``after_sigterm`` the request goes out whatever the state (Slurm would accept it
    for a cancelled, completing job and bring it back)."""
    env = _fake_scontrol(tmp_path, state)
    log = EventLog(tmp_path / "e.jsonl")
    ok = request_requeue("42", "SIGTERM received", log, env, emulated=False, after_sigterm=True)
    log.close()
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[0] == "show job -o 42"
    assert ok is asked and (("requeue 42" in calls) is asked)
    (e,) = read_events(tmp_path / "e.jsonl")
    if asked:
        assert (e["event"], e["by"], e["accepted"]) == ("requeue", "scontrol", True)
    else:
        assert e["event"] == "warning" and "COMPLETING" in e["reason"] and "not requeued" in e["reason"]

    (tmp_path / "calls.txt").unlink()
    assert request_requeue("42", "SIGUSR2 received", None, env, emulated=False)  # no SIGTERM: no question asked
    assert (tmp_path / "calls.txt").read_text().splitlines() == ["requeue 42"]
