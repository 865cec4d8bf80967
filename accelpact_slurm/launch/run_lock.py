"""One job per run directory: an ``flock`` on ``RUN_DIR/.accelpact-lock`` that names the job holding it.

Two jobs on one run directory would share its daemons, staging slots, event log and summary (the second job's
daemons refuse the locked node directories, its ranks then train through the first job's, both logs interleave).
So the second job stops before any of its ranks starts, naming the run directory and the holder
(:class:`RunDirInUse`, exit 2).

The holder, for as long as the job may write there: the embedded default's launcher (across its relaunches); in an
allocation (sbatch template, submitit), global rank 0's task; every other rank only refuses a lock of another job.
The lock records the holder's job id, host and pid; one held under the same job id is never refused (a requeued
start whose predecessor has not quite ended, an embedded rank under its launcher).  The kernel releases ``flock``
when the holder ends (``kill -9`` included): no stale lock.  The lock is opened only after the run directory's
owner-and-mode check and never through a link (:mod:`accelpact_slurm.core.safeopen`: a planted link would have the
job truncate the file it names); either stops the start in one line, exit 2.

File systems: ``flock`` works locally and on NFS (emulated with byte-range locks, visible to every client); on
Lustre only with the ``flock`` mount option (``localflock`` is node-local: two jobs whose rank 0 sit on different
nodes would both take it).  Where locks are refused (ENOLCK, ENOSYS, EOPNOTSUPP) the job goes on with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from typing import Any

from accelpact_slurm.core.errors import ConfigError
from accelpact_slurm.core.safeopen import NotRegular, check_dir, open_writable, read_regular

log = logging.getLogger(__name__)

LOCK_FILE = ".accelpact-lock"
#: How long a holder retries while another rank of its job tests the lock (a shared lock held for an instant).
RETRY_S = 1.0
#: How long a lock held under an unreadable record is taken for one whose holder is still writing it.
RECORD_S = 5.0
#: The most read of the lock's record (a job id, a host name, a pid and a time: well under a kilobyte).
RECORD_LIMIT = 4096
_UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class RunDirInUse(ConfigError):
    """Another job holds the run directory's lock.  Same shape as :class:`ConfigError` (``field, value, fix``)."""


class RunDirLock:
    """A held run-directory lock; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, path: str, fd: int, record: dict[str, Any]) -> None:
        self.path = path
        self.record = record
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops the flock

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.release()


def lock_path(run_dir: str) -> str:
    return os.path.join(run_dir, LOCK_FILE)


def holder(run_dir: str) -> dict[str, Any] | None:
    """The record of the lock's last holder (``job_id``, ``host``, ``pid``, ``since``); None when unreadable."""
    try:
        rec = json.loads(read_regular(lock_path(run_dir), RECORD_LIMIT) or b"null")
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def describe(rec: dict[str, Any] | None) -> str:
    if not rec:
        return "another job (its record is not readable yet)"
    since = rec.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"job {rec.get('job_id')} (host {rec.get('host')}, pid {rec.get('pid')}{when})"


def claim(run_dir: str, job_id: str, *, hold: bool) -> RunDirLock | None:
    """Make sure no other job uses ``run_dir``; with ``hold``, take its lock for this process's lifetime.

    Returns the held :class:`RunDirLock` (``hold`` and the lock was free), else None: the lock is held under
    ``job_id`` already (this job's launcher or an earlier start of it), it is free (``hold`` False: this job's
    holder takes it), or the file system cannot lock (a warning says so).

    Raises:
        RunDirInUse: another job holds it; the message names the run directory and that job, on one line.
    """
    os.makedirs(run_dir, exist_ok=True)
    check_dir(run_dir)  # a directory others may write could hold their link or FIFO at the lock's name
    path = lock_path(run_dir)
    try:  # never through a link (it would truncate the file it names): created O_EXCL, or our regular file
        fd, _st = open_writable(path, mode=0o600)
    except NotRegular as exc:
        raise ConfigError("run dir", run_dir, f"its lock {exc.strerror}: remove it (rm {path}) if no job of "
                                              f"yours runs there") from None
    # a holder retries for RETRY_S: another rank of its own job may be testing the lock (a shared lock, an instant)
    t0 = time.monotonic()
    deadline = t0 + (RETRY_S if hold else 0.0)
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if hold else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                rec = holder(run_dir)
                if rec is not None and str(rec.get("job_id")) == str(job_id):
                    os.close(fd)
                    log.info("run directory %s is held by this job already (%s)", run_dir, describe(rec))
                    return None
                # an unreadable record: the holder has just taken the lock and is writing it (give it RECORD_S)
                if time.monotonic() < deadline or (rec is None and time.monotonic() < t0 + RECORD_S):
                    time.sleep(0.05)
                    continue
                os.close(fd)
                raise RunDirInUse("run dir", run_dir, f"in use by {describe(rec)}: one job per run directory; "
                                                      f"wait for that job to end, or use another run "
                                                      f"directory") from None
            os.close(fd)
            if exc.errno in _UNSUPPORTED:
                log.warning("cannot lock %s (%s): this file system has no flock; one job per run directory is "
                            "not enforced here", path, exc.strerror or exc)
                return None
            raise ConfigError("run dir", run_dir, f"cannot lock {path}: {exc.strerror or exc}") from None
    if not hold:
        os.close(fd)  # free: this job's holder (rank 0) takes it
        return None
    record = {"job_id": str(job_id), "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return RunDirLock(path, fd, record)
