"""Fault-injection points of the checkpoint service, driven by a :class:`~accelpact_slurm.core.faults.TestFaults`.

The switches are read from the environment once, by :mod:`accelpact_slurm.core.faults`; this module only
acts on the object it is given (``NO_FAULTS`` does nothing).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from accelpact_slurm.core.errors import EXIT_REQUEUE
from accelpact_slurm.core.faults import NO_FAULTS, TestFaults
from accelpact_slurm.core.safeopen import open_writable

log = logging.getLogger(__name__)

PHASES = ("staging", "writing", "written", "renamed")
PAUSE_LIMIT_S = 600.0


def pause_point(phase: str, ndir: str, step: int | None = None, faults: TestFaults = NO_FAULTS) -> None:
    """Block here when the test asked to pause at ``phase`` (of ``step``, if it named one)."""
    want = faults.pause_at
    if want is None or want[0] != phase or (want[1] is not None and step is not None and want[1] != step):
        return
    marker = os.path.join(ndir, f".paused-{phase}")
    fd, _st = open_writable(marker, mode=0o644)  # never through a link (core.safeopen)
    os.ftruncate(fd, 0)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    log.warning("fault injection: paused at %s (marker %s)", phase, marker)
    threading.Event().wait(PAUSE_LIMIT_S)


def kill_point(phase: str, node: str, step: int, faults: TestFaults = NO_FAULTS) -> None:
    """The daemon SIGKILLs itself here when the test named this phase, step and node (a daemon that dies between
    two of its writes: after its commit rename, before its state and index say so)."""
    want = faults.ckptd_kill_at
    if want is None or want[0] != phase or want[1] != step or want[2] not in (None, node):
        return
    log.warning("fault injection: the daemon of %s kills itself at %s of step %d", node, phase, step)
    os.kill(os.getpid(), signal.SIGKILL)


def slow_verify(node: str, faults: TestFaults = NO_FAULTS) -> None:
    """Hold this verification when the test named this node."""
    if faults.slow_verify and faults.slow_verify[0] == node:
        log.warning("fault injection: verification on %s held %s s", node, faults.slow_verify[1])
        threading.Event().wait(faults.slow_verify[1])


def exit_after_verified(client: Any, step: int, faults: TestFaults = NO_FAULTS) -> None:
    """Every rank exits 75 once snapshot ``step`` is settled (a decided stop without a requeue request)."""
    if faults.exit_after_verified != step:
        return
    state = client.wait(step, client.cfg.timeouts.startup_s)
    client.rt.control.barrier("ckpt-exit-after-verified", timeout_s=client.cfg.timeouts.startup_s)
    log.warning("fault injection: exiting after snapshot %d (%s)", step, state)
    if client.events is not None:  # a decided stop (exit 75 without a requeue request), not a crash
        client.events.emit("fail_stop", reason=f"fault injection: exit after snapshot {step} ({state})",
                           exit_code=EXIT_REQUEUE, phase="committed", frontier=step, decision_s=None,
                           decision="restart", key=None)
    raise SystemExit(EXIT_REQUEUE)


def corrupt_capture(client: Any, plan: Any, slot: int, step: int, faults: TestFaults = NO_FAULTS) -> None:
    """Change this rank's staged weights of snapshot ``step`` (as a wrong capture mapping would)."""
    if faults.corrupt_capture != (step, client.rt.rank):
        return
    for e, _b, view in plan.regions(client.slots[slot].buf):
        if e.key[0] == "model":
            view.add_(1.0)
    log.warning("fault injection: staged weights of rank %d changed", client.rt.rank)


def kill_after_staged(client: Any, step: int, faults: TestFaults = NO_FAULTS) -> None:
    """This rank SIGKILLs itself once it handed snapshot ``step`` over (the daemon has the descriptor)."""
    if faults.kill_after_staged != (step, client.rt.rank):
        return
    client.join_handover()
    log.warning("fault injection: rank %d kills itself after staging step %d", client.rt.rank, step)
    os.kill(os.getpid(), signal.SIGKILL)
