"""The detector learns how long a collective takes from its waits (its link bounds): a collective issued early and
waited for later (the repair's validation all-reduce, issued before the invariant scan) is timed from its wait once
its caller says so (``Detector.timed_from_now``), else the caller's own work in between would widen the bound.
A stop found in a wait of the training code's thread goes to the run's stop hook (``Detector.stop_hook``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from accelpact_slurm.core.errors import FailStop
from accelpact_slurm.runtime.detection import liveness as lv
from accelpact_slurm.runtime.detection.collectives import Detector, WatchedWork, _Group


class _Completed:
    """The work of a collective that completed while its caller was busy."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _sample(say_from_now: bool) -> float:
    det = Detector(0, lambda: (None, None), {}, lv.LocalState(), None, None, lambda: (0, {}),
                   SimpleNamespace(link_floor_s=0.5, collective_s=5.0, heartbeat_s=10.0))
    ww = WatchedWork(_Completed(), det, _Group(object(), "replicate", [0, 1]), 0, 8)
    ww._t0 -= 0.3  # issued 0.3 s ago; the caller walked the framework's objects meanwhile
    if say_from_now:
        det.timed_from_now(ww)
    ww.wait()
    (samples,) = det.bounds._samples.values()
    return samples[-1]


def test_a_collective_waited_for_after_the_callers_own_work_is_timed_from_its_wait():
    assert _sample(True) < 0.1
    assert _sample(False) >= 0.3  # the control: timed from its issue, the caller's 0.3 s counted in


class _Stopping:
    """The work of a collective whose member the detector found dead."""

    def wait(self, timeout=None) -> bool:
        raise FailStop("rank 1 died", cause="dead-rank")

    def is_completed(self) -> bool:
        return True


class _Unwind(BaseException):
    """What the run's hook raises in the stop's place (``Stopped``)."""


def test_a_stop_in_the_training_threads_collective_goes_to_the_stop_hook_and_elsewhere_stays_a_fail_stop():
    det = Detector(0, lambda: (None, None), {}, lv.LocalState(), None, None, lambda: (0, {}),
                   SimpleNamespace(link_floor_s=0.5, collective_s=5.0, heartbeat_s=10.0))
    seen = []

    def hook(stop):
        seen.append(stop.cause)
        raise _Unwind()

    def wait():
        WatchedWork(_Stopping(), det, _Group(object(), "shard", [0, 1]), 0, 8).wait()

    det.stop_hook = (threading.get_ident(), hook)
    with pytest.raises(_Unwind):  # the control: without the hook (None) this is the FailStop below
        wait()
    assert seen == ["dead-rank"]
    caught = []
    other = threading.Thread(target=lambda: caught.append(pytest.raises(FailStop, wait)))
    other.start()
    other.join(10)
    assert len(caught) == 1 and seen == ["dead-rank"]  # another thread's wait: the FailStop, no hook
    det.stop_hook = None
    with pytest.raises(FailStop):
        wait()
