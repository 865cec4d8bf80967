"""Pre-timeout and preemption signals: handlers only set a flag.

Slurm sends ``USR2`` before the time limit (``--signal=B:USR2@N`` in the
template; the batch shell forwards it to every task).  CAUTION: NCCL may catch
USR1, hence USR2.  The training loop reads the flag at the next committed
boundary, where every rank agrees on it through the vote, takes a snapshot,
waits until it is committed, and requeues.
"""

from __future__ import annotations

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


def clear() -> None:
    _requested.clear()
    _signum.clear()
