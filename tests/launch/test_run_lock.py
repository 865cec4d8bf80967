"""The run directory's lock: one job per run directory, the same job (a requeue, its own ranks) never refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from accelpact_slurm.core.errors import ConfigError
from accelpact_slurm.launch.run_lock import RunDirInUse, claim, holder
from tests.conftest import REPO


def test_a_second_job_is_refused_in_one_line_naming_the_holder(tmp_path):
    first = claim(str(tmp_path), "1001", hold=True)
    assert first is not None and first.held and holder(str(tmp_path))["job_id"] == "1001"
    for hold in (True, False):  # the other job's rank 0 and its other ranks
        with pytest.raises(RunDirInUse) as err:
            claim(str(tmp_path), "2002", hold=hold)
        text = str(err.value)
        assert "\n" not in text and str(tmp_path) in text and "job 1001" in text and f"pid {os.getpid()}" in text
        assert isinstance(err.value, ConfigError)  # accelpact-run exits 2 on it
    first.release()
    assert claim(str(tmp_path), "2002", hold=True).held  # free once the first job is gone


def test_the_same_job_is_not_refused(tmp_path):
    """A requeue (same job id, new start) while a process of its earlier start still holds the lock, or a rank
    under its own launcher: never refused, and the holder keeps the lock."""
    first = claim(str(tmp_path), "1001", hold=True)
    assert claim(str(tmp_path), "1001", hold=True) is None  # the requeued start's rank 0
    assert claim(str(tmp_path), "1001", hold=False) is None  # its other ranks
    with pytest.raises(RunDirInUse):
        claim(str(tmp_path), "2002", hold=False)  # still held
    first.release()


def test_a_rank_that_checks_while_its_holder_writes_the_record_is_not_refused(tmp_path, monkeypatch):
    """A requeued start: rank 0 has just taken the lock and not yet written its record when rank 2 checks.  The
    check waits (bounded) for the record instead of taking the holder for another job (it did: every rank of the
    requeued start then waited on rank 2's rendezvous until its timeout)."""
    import fcntl

    from accelpact_slurm.launch import run_lock

    fd = os.open(run_lock.lock_path(str(tmp_path)), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held, record still empty
    real = run_lock.holder
    calls = []

    def holder_while_written(run_dir):
        calls.append(1)
        if len(calls) == 1:  # the first read finds the file empty; the holder writes its record right after
            os.pwrite(fd, b'{"job_id": "1001", "host": "node1", "pid": 1, "since": 0}\n', 0)
            return None
        return real(run_dir)

    monkeypatch.setattr(run_lock, "holder", holder_while_written)
    try:
        assert claim(str(tmp_path), "1001", hold=False) is None
        assert len(calls) >= 2
    finally:
        os.close(fd)


def test_ranks_that_only_check_leave_a_free_lock_free(tmp_path):
    assert claim(str(tmp_path), "1001", hold=False) is None
    assert claim(str(tmp_path), "2002", hold=True).held  # nothing was left held by the check


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    """kill -9 of the holder: the kernel releases the flock; the next job takes the run directory at once."""
    code = ("import sys; from accelpact_slurm.launch.run_lock import claim; "
            f"lock = claim({str(tmp_path)!r}, 'dead-job', hold=True); print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse, match="job dead-job"):
            claim(str(tmp_path), "next-job", hold=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    lock = claim(str(tmp_path), "next-job", hold=True)
    assert lock.held and holder(str(tmp_path))["job_id"] == "next-job"
