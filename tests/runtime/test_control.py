"""The control plane's agreements on a real ``TCPStore``, one thread (and one store client) per rank."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from accelpact_slurm.core.errors import ControlPlaneTimeout
from accelpact_slurm.runtime.control import ControlPlane

WORLD = 3


@pytest.fixture
def planes():
    host = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=20))
    clients = [dist.TCPStore("127.0.0.1", host.port, WORLD, is_master=False, timeout=timedelta(seconds=20))
               for _ in range(WORLD)]
    yield [ControlPlane(c, rank=r, world_size=WORLD, timeout_s=10) for r, c in enumerate(clients)]


def on_every_rank(planes, fn):
    """``fn(plane)`` on one thread per rank; the results (or exceptions) in rank order."""
    out: list = [None] * len(planes)

    def run(r):
        try:
            out[r] = fn(planes[r])
        except Exception as exc:  # returned for the test to look at
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(planes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_all_gather_returns_every_value_in_rank_order_round_after_round(planes):
    def rounds(p):
        return [p.all_gather("vote", {"r": p.rank, "n": n}) for n in range(5)]

    for got in on_every_rank(planes, rounds):
        assert got == [[{"r": r, "n": n} for r in range(WORLD)] for n in range(5)]


def test_a_missing_rank_is_named_at_the_deadline_and_the_store_keeps_its_timeout(planes):
    def two_of_three(p):
        if p.rank == 2:
            return None
        return p.all_gather("release", 1, timeout_s=0.5)

    t0 = time.monotonic()
    got = on_every_rank(planes, two_of_three)
    assert time.monotonic() - t0 < 10
    for r in (0, 1):
        assert isinstance(got[r], ControlPlaneTimeout), got[r]
        assert "no answer from rank(s) [2]" in str(got[r]) and "after 0.5 s" in str(got[r])
        assert planes[r].base_store.timeout == timedelta(seconds=20)


def test_a_contribution_ends_the_others_wait_at_once(planes):
    """A rank about to fail stop puts its reason into the round and does not wait; the others read it there."""
    def release(p):
        if p.rank == 1:
            p.contribute("release", {"ok": False, "why": "validation failed"})
            return "left"
        return p.all_gather("release", {"ok": True})

    t0 = time.monotonic()
    got = on_every_rank(planes, release)
    assert time.monotonic() - t0 < 5
    assert got[1] == "left"
    assert got[0] == got[2] == [{"ok": True}, {"ok": False, "why": "validation failed"}, {"ok": True}]
    # The round counts as the contributing rank's call: the next round pairs up again.
    assert on_every_rank(planes, lambda p: p.all_gather("release", p.rank)) == [[0, 1, 2]] * WORLD
