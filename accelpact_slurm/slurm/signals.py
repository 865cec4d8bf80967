"""Pre-timeout and preemption signals: handlers only set a flag.

Slurm sends ``USR2`` before the time limit (``--signal=B:USR2@N`` in the template; the batch shell forwards it to
every task).  CAUTION: NCCL may catch USR1, hence USR2.  A preemption with a grace time (``GraceTime``,
``PreemptMode= REQUEUE``) sends SIGCONT and SIGTERM to every task of every step (not to the batch shell), then SIGTERM
to everything and SIGKILL after ``KillWait``; with ``SlurmctldParameters=preempt_send_user_signal`` our USR2 comes
instead of the first SIGTERM.  So in a real Slurm task SIGTERM takes the USR2 path too (:func:`stop_signals`).

The loop reads the flag at the next committed boundary, where every rank agrees on it through the vote, snapshots,
waits until the snapshot is committed, and requeues.  After a SIGTERM rank 0 requeues only while the job still runs:
a job Slurm is already ending (``scancel``, a requeue, the time limit, the grace time's end, which requeues a
preempted job by itself) is not requeued by us (:func:`accelpact_slurm.slurm.requeue.requeue_after_sigterm`).

Who calls: the launch core's rank start installs the handlers first thing (:func:`install` with
:func:`stop_signals`); the guard reads :func:`requested` into every vote; the requeue stop gathers :func:`received`.
"""

from __future__ import annotations

import os
import signal

from accelpact_slurm.core.safeopen import open_writable

#: Every signal (or request) that asked for the stop, in order; non-empty means requested.  A plain list, not a
#: ``threading.Event``: a handler runs in the main thread between two bytecodes, and ``Event.set`` takes a lock the
#: main thread may be holding at that moment (in ``clear``, or in a wait on the same event): it would wait forever.
_signum: list[int] = []


def _handler(signum, _frame) -> None:  # only sets a flag: no I/O, no locks
    _signum.append(signum)  # list.append: atomic, takes no lock


def stop_signals(emulated: bool) -> tuple[int, ...]:
    """The signals that ask for a snapshot-then-requeue (pure).

    USR2 always.  SIGTERM too in a real Slurm task, where it is a preemption's notice (and otherwise
    the job's end, which the requeue stop tells apart).  On the embedded default and submitit's local
    executor (``emulated``) SIGTERM is left as it is (the default action; submitit's own handler): the
    embedded default's launcher forwards the user's SIGTERM to stop the job, not to requeue it.
    """
    return (signal.SIGUSR2,) if emulated else (signal.SIGUSR2, signal.SIGTERM)


def install(signals: tuple[int, ...] = (signal.SIGUSR2,)) -> None:
    """Install the flag-setting handler (main thread only); call before anything slow."""
    for s in signals:
        signal.signal(s, _handler)


def request(reason_signum: int = signal.SIGUSR2) -> None:
    """Ask for a snapshot-then-requeue from code (submitit's checkpoint hook, tests)."""
    _signum.append(reason_signum)


def requested() -> bool:
    return bool(_signum)


def reason() -> str:
    if not _signum:
        return "none"
    try:
        return signal.Signals(_signum[-1]).name
    except ValueError:
        return str(_signum[-1])


def received() -> list[str]:
    """Every signal that asked for the stop so far, by name, sorted (the requeue stop gathers them from all ranks)."""
    names = set()
    for signum in list(_signum):
        try:
            names.add(signal.Signals(signum).name)
        except ValueError:
            names.add(str(signum))
    return sorted(names)


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
    fd, _st = open_writable(os.path.join(d, f"{restart}-{rank}"), mode=0o644)  # never through a link
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    if os.path.exists(request_file(run_dir, restart)):
        request(signal.SIGUSR2)


def clear() -> None:
    _signum.clear()
