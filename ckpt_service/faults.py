"""Fault-injection points of the checkpoint service, driven by a :class:`~accelpact_slurm.core.faults.TestFaults`.

The switches are read from the environment once, by :mod:`accelpact_slurm.core.faults`; this module only
acts on the object it is given (``NO_FAULTS`` does nothing).
"""

from __future__ import annotations

import logging
import os
import threading

from accelpact_slurm.core.faults import NO_FAULTS, TestFaults

log = logging.getLogger(__name__)

PHASES = ("staging", "writing", "written", "renamed")
PAUSE_LIMIT_S = 600.0


def pause_point(phase: str, ndir: str, step: int | None = None, faults: TestFaults = NO_FAULTS) -> None:
    """Block here when the test asked to pause at ``phase`` (of ``step``, if it named one)."""
    want = faults.pause_at
    if want is None or want[0] != phase or (want[1] is not None and step is not None and want[1] != step):
        return
    marker = os.path.join(ndir, f".paused-{phase}")
    with open(marker, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    log.warning("fault injection: paused at %s (marker %s)", phase, marker)
    threading.Event().wait(PAUSE_LIMIT_S)


def slow_verify(node: str, faults: TestFaults = NO_FAULTS) -> None:
    """Hold this verification when the test named this node."""
    if faults.slow_verify and faults.slow_verify[0] == node:
        log.warning("fault injection: verification on %s held %s s", node, faults.slow_verify[1])
        threading.Event().wait(faults.slow_verify[1])
