"""A rank's Python stacks on demand: how a hung rank is made to say where it hangs before it is killed.

Who calls: :mod:`.wiring` installs the handler on every rank; a node peer of a hung rank
(:meth:`accelpact_slurm.runtime.detection.collectives.Detector.end_hung_peer`) and the embedded default's launcher
(:mod:`accelpact_slurm.launch.local`) dump the stacks of the ranks they end.  (Re-exported by :mod:`.liveness`.)
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Iterable

log = logging.getLogger(__name__)

#: The signal on which every rank dumps its Python stacks (faulthandler) into its log.  Not USR1 (NCCL may catch
#: it), not USR2 (the pre-timeout warning): a real-time signal nothing else uses.
DUMP_SIGNAL = signal.SIGRTMIN + 4
#: How long a node peer gives a hung rank, woken by SIGCONT, to write its stacks before it is killed.
DUMP_GRACE_S = 1.0

def dump_stacks(pids: Iterable[int], grace_s: float = DUMP_GRACE_S) -> list[int]:
    """Make these processes (this node's) write their Python stacks into their logs; returns those signalled.

    ``DUMP_SIGNAL`` (their faulthandler writes every thread's stack, from the signal handler), then SIGCONT (a
    stopped process takes its pending signals when it resumes, the dump first thing), then up to ``grace_s`` until
    each runs again and has had a moment for it.
    """
    sent = []
    for pid in pids:
        try:
            os.kill(pid, DUMP_SIGNAL)
            os.kill(pid, signal.SIGCONT)
            sent.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(_state(p) == "T" for p in sent):  # until they run again
        threading.Event().wait(0.005)
    # The pending DUMP_SIGNAL is taken before a process returns to user code: its handler writes the stacks first
    # (a millisecond); a resumed process is given no more than that, for it is not to run on.
    threading.Event().wait(max(0.0, min(0.02, end - time.monotonic())))
    return sent


def dump_and_kill(pid: int, grace_s: float = DUMP_GRACE_S) -> str:
    """Make a hung rank (same node) write its Python stacks into its log (:func:`dump_stacks`), then kill it."""
    if not dump_stacks([pid], grace_s):
        return "already gone, or not ours to signal"
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "stacks dumped; it exited"
    return "stacks dumped, then killed"


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def install_dump_handler() -> None:
    """Make this process dump its Python stacks (every thread) to stderr, its log, on :data:`DUMP_SIGNAL`."""
    try:
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (ValueError, RuntimeError, AttributeError, OSError) as exc:  # no stderr fd (an embedding host)
        log.info("stack dumps on signal %d unavailable: %s", DUMP_SIGNAL, exc)
