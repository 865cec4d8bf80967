"""Instrumentation hooks: what a measurement of a running job may reach beyond the training API.

The benchmarks (``benchmarks/``) time the job's own pieces in place, inside the job's ranks: they delimit timed
segments with the control plane's barriers, take a snapshot at an update of their choosing, switch the detector
or the control plane's store between two modes, and time the guard's boundary all-reduce.  These functions are
their one way in: nothing outside the product reaches it by a private name (``tests/test_bench_layout.py``).
None changes what the job computes; they are not part of the training API's stability promise.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelpact_slurm.runtime.job.api import Job, Run


def runtime(job: Job) -> Any:
    """The rank's runtime (``runtime.topology.Runtime``): its control plane (``.control``), detector
    (``.detector``), layout and groups.  Assigning ``.control`` another ``ControlPlane`` moves the guard's vote
    onto it from the next update."""
    return job._rt


def snapshot_client(run: Run) -> Any:
    """The run's snapshot client (``ckpt_service.client.SnapshotClient``): ``snapshot(step)`` takes one now (rank
    0's ``snapshot`` event holds what it blocked for, piece by piece), ``wait(step, timeout_s)`` its verdict."""
    return run._snapshots


@contextlib.contextmanager
def timed_boundary(run: Run, into: Callable[[float], None]) -> Iterator[None]:
    """Inside the block, every boundary all-reduce of the run's guard hands its seconds to ``into``."""
    guard = run._guard
    inner = guard._boundary_collective

    def timed(frontier: int) -> None:
        t0 = time.monotonic()
        try:
            inner(frontier)
        finally:
            into(time.monotonic() - t0)

    guard._boundary_collective = timed  # type: ignore[method-assign]  # undone below
    try:
        yield
    finally:
        del guard._boundary_collective  # the instance's wrapper: back to the class's method
