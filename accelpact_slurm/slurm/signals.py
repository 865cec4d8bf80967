"""Pre-timeout and preemption signals: handlers only set a flag.

Slurm sends ``USR2`` before the time limit (``--signal=B:USR2@N`` in the
template; the batch shell forwards it to every task).  CAUTION: NCCL may catch
USR1, hence USR2.  The training loop reads the flag at the next committed
boundary, where every rank agrees on it through the vote, takes a snapshot,
waits until it is committed, and requeues.
"""

from __future__ import annotations

import os
import signal
import threading

_requested = threading.Event()
_signum: list[int] = []


def _handler(signum, _frame) -> None:  # only sets a flag: no I/O, no locks
    _signum.append(signum)
    _requested.set()


def install(signals: tuple[int, ...] = (signal.SIGUSR2,)) -> None:
    """Install the flag-setting handler (main thread only); call before anything slow."""
    for s in signals:
        signal.signal(s, _handler)


def request(reason_signum: int = signal.SIGUSR2) -> None:
    """Ask for a snapshot-then-requeue from code (submitit's checkpoint hook, tests)."""
    _signum.append(reason_signum)
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def reason() -> str:
    if not _signum:
        return "none"
    try:
        return signal.Signals(_signum[-1]).name
    except ValueError:
        return str(_signum[-1])


READY_DIR = ".ready"


def request_file(run_dir: str, restart: int) -> str:
    """Where the batch script records a pre-timeout USR2 that arrived before every task could take it."""
    return os.path.join(run_dir, f".stop-requested-{restart}")


def mark_ready(run_dir: str, restart: int, rank: int) -> None:
    """After :func:`install`: tell the batch script this task takes USR2 now, then pick up a request it
    recorded meanwhile.

    The batch script writes the request file first and forwards the signal only once every task is
    ready; a task writes its marker first and reads the request file after, so a USR2 reaches every
    start either as a signal or through the file (one rank's flag stops all of them: the vote).
    """
    d = os.path.join(run_dir, READY_DIR)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"{restart}-{rank}"), "w", encoding="utf-8") as fh:
        fh.write(f"{os.getpid()}\n")
    if os.path.exists(request_file(run_dir, restart)):
        request(signal.SIGUSR2)


def clear() -> None:
    _requested.clear()
    _signum.clear()
