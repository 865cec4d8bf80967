"""Skip, never queue (ckpt_service/client.py): a snapshot that falls due on the cadence while the daemon still holds
both staging slots is skipped at once, saying the daemon is behind; a snapshot someone asked for waits for a slot.

The client's slot bookkeeping runs against a daemon that answers every request as a stand-in (the requests are
the ones the real daemon answers: ``released`` with a wait).  The whole path, ranks and a real daemon that
stops answering, is ``tests/e2e/test_stopped_daemon.py``."""

from __future__ import annotations

import types

import pytest

from ckpt_service import client as client_mod
from ckpt_service.client import SLOTS, SnapshotClient


class _Daemon:
    """Answers ``released`` from a set of released steps; records each request's wait."""

    def __init__(self, released=()):
        self.released = set(released)
        self.waits: list[float] = []

    def request(self, msg, timeout_s=None):
        assert msg["op"] == "released"
        self.waits.append(msg["timeout"])
        return {"released": msg["step"] in self.released}


def _client(daemon, held):
    c = object.__new__(SnapshotClient)
    c._slot_step = list(held) + [None] * (SLOTS - len(held))
    c._silent_since = None
    c.answer_s = 1.0
    c._request = daemon.request
    c._daemon_failed = lambda: None
    return c


def test_both_slots_held_skips_at_once_and_says_the_daemon_is_behind():
    daemon = _Daemon()
    slot, why = _client(daemon, [4, 6])._free_slot(0.0)
    assert slot is None and client_mod.BEHIND in why
    assert "still writing snapshot 4 from slot 0, snapshot 6 waiting for it" in why and "waited" not in why
    assert daemon.waits and all(w == 0.0 for w in daemon.waits)  # it never waited for the daemon


def test_a_snapshot_someone_asked_for_waits_for_a_slot():
    """The negative control of the test above: given a wait, the client asks the daemon to hold the answer until
    the slot is released (the old rule for every snapshot: a daemon behind stalled training)."""
    daemon = _Daemon()
    slot, why = _client(daemon, [4, 6])._free_slot(7.5)
    assert slot is None and "waited 7.5 s" in why
    assert 7.5 in daemon.waits


@pytest.mark.parametrize("held, released, want", [
    ([4, 6], {4}, 0),        # the older snapshot's slot is released: reused
    ([4, 6], {6}, 1),
    ([4], set(), 1),          # one slot still unused
    ([], set(), 0),
])
def test_a_released_or_unused_slot_is_taken_without_waiting(held, released, want):
    daemon = _Daemon(released)
    slot, why = _client(daemon, held)._free_slot(0.0)
    assert (slot, why) == (want, None)
    assert all(w == 0.0 for w in daemon.waits)


def test_the_cadence_skips_at_once_while_asked_for_snapshots_wait(monkeypatch):
    """``after_commit`` (the cadence) stages with no wait; ``settle`` (``run.save()``, the final snapshot) and
    ``snapshot_and_wait`` (before a requeue) with the default, ``timeouts.control_s``."""
    seen = []
    c = object.__new__(SnapshotClient)
    c.every, c.faults, c.taken = 2, client_mod.NO_FAULTS, set()
    c.cfg = types.SimpleNamespace(timeouts=types.SimpleNamespace(control_s=30.0))
    monkeypatch.setattr(SnapshotClient, "snapshot", lambda self, step, wait_s=None: seen.append((step, wait_s)))
    c.after_commit(4)
    c.settle(5, 1.0)
    c.snapshot_and_wait(7, 1.0)
    assert seen == [(4, 0.0), (5, None), (7, None)]
