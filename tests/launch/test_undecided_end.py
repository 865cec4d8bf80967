"""The embedded default's launcher writes a start's ``fail_stop`` when no rank could: what it says must be true.

Real processes crash with an uncaught exception (Python's exit 1, a traceback at the end of their log) or are
SIGKILLed; :func:`accelpact_slurm.launch.local.record_undecided_end` names the exception each crashed rank's log
ends with, and the frontier the event log holds.
"""

from __future__ import annotations

import json
import subprocess
import sys

from accelpact_slurm.core.events import read_events
from accelpact_slurm.launch.local import record_undecided_end

_RAISE = "raise RuntimeError('Missing key in checkpoint state_dict: model.features.0.1.running_mean.')"


def _crash(log, code: str) -> int:
    with open(log, "ab") as fh:
        fh.write(b"[accelpact] job 9: an earlier start's line\n")
        fh.flush()
        return subprocess.run([sys.executable, "-c", code], stdout=fh, stderr=subprocess.STDOUT, timeout=60).returncode


def test_the_launchers_stop_names_the_crash_and_the_logs_frontier(tmp_path):
    """Negative control: the old reason ("every rank ended without a decision ...: killed, or crashed", nothing of
    the exception) and ``frontier`` None although update 9 was committed.
    """
    events = tmp_path / "events.jsonl"
    events.write_text("".join(json.dumps({"ts": float(i), "event": "step", "job_id": "9", "restart": 0, "rank": 0,
                                          "step": i}) + "\n" for i in range(1, 10)))
    logs = {r: str(tmp_path / f"rank-{r}.log") for r in range(3)}
    codes = [_crash(logs[0], _RAISE), _crash(logs[1], _RAISE)]
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    codes.append(killed.wait(timeout=60))
    assert codes == [1, 1, -9]
    record_undecided_end(str(tmp_path), "9", 1, 75, codes, logs)
    stop = list(read_events(str(events)))[-1]
    assert (stop["event"], stop["restart"], stop["by"], stop["cause"]) == ("fail_stop", 1, "launcher", "launcher")
    assert stop["frontier"] == 9
    assert stop["reason"] == ("every rank ended without a decision (exit codes [1, 1, -9]): rank(s) 0, 1 crashed: "
                              "RuntimeError: Missing key in checkpoint state_dict: model.features.0.1.running_mean.")
    # A start that decided writes nothing more.
    record_undecided_end(str(tmp_path), "9", 1, 75, codes, logs)
    assert len(list(read_events(str(events)))) == 10


def test_without_a_traceback_or_a_step_the_stop_says_only_what_is_known(tmp_path):
    logs = {0: str(tmp_path / "rank-0.log")}
    codes = [_crash(logs[0], "import sys; print('RuntimeError: printed, not raised'); sys.exit(1)")]
    record_undecided_end(str(tmp_path), "9", 0, 75, codes, logs)
    (stop,) = read_events(str(tmp_path / "events.jsonl"))
    assert stop["frontier"] is None
    assert stop["reason"] == "every rank ended without a decision (exit codes [1]): killed, or crashed"


def test_a_fifo_or_a_link_at_a_ranks_log_is_not_read(tmp_path):
    """The crash's line is read from the run directory's logs: a FIFO there must not block the launcher, a link
    must not be followed.  Negative control: a plain ``open`` of the FIFO blocks (the test's timeout ends it)."""
    import os

    fifo, link, target = tmp_path / "rank-0.log", tmp_path / "rank-1.log", tmp_path / "elsewhere.log"
    os.mkfifo(fifo)
    target.write_text("Traceback (most recent call last):\nRuntimeError: read through a link\n")
    link.symlink_to(target)
    record_undecided_end(str(tmp_path), "9", 0, 75, [1, 1], {0: str(fifo), 1: str(link)})
    (stop,) = read_events(str(tmp_path / "events.jsonl"))
    assert stop["reason"] == "every rank ended without a decision (exit codes [1, 1]): killed, or crashed"
