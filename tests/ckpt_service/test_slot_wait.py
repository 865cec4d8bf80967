"""A snapshot asked for (the job's end, ``run.save()``) waits for a staging slot instead of skipping.

On a loaded node the daemon, whose writers yield the CPU, may still hold both slots (the two snapshots before) when
the job ends; a due snapshot then skips (training goes on), but the final one must wait for a slot, or the job ends
without a verified snapshot of its last update.  The daemon here is a stand-in for its answers only: busy for the
first asks, then released, or silent.
"""

from __future__ import annotations

from ckpt_service.client import SLOTS, SnapshotClient


def _client(answers):
    """A client whose two slots hold snapshots 8 and 12, and whose daemon gives ``answers`` in turn (busy when
    they run out); an answer ``(False, why)`` is a silent daemon."""
    c = object.__new__(SnapshotClient)
    c._slot_step = [8, 12] + [None] * (SLOTS - 2)
    c._silent_since = None
    asked = []

    def released(slot, wait_s):
        asked.append((slot, wait_s))
        ok, silent = answers.pop(0) if answers else (False, None)
        if silent is not None:
            c._silent_since = 0.0
        return ok, silent

    c._released = released
    return c, asked


def test_a_due_snapshot_skips_when_both_slots_stay_busy():
    c, _ = _client([(False, None), (False, None), (False, None)])
    slot, why = c._free_slot(0.0)
    assert slot is None and "still writing snapshot 8" in why


def test_an_asked_for_snapshot_waits_while_the_daemon_says_it_still_writes():
    """Negative control: without ``patient_s`` the same answers give no slot (the test above)."""
    answers = [(False, None)] * 6 + [(False, None), (True, None)]  # busy for two passes, then 12's slot released
    c, asked = _client(answers)
    slot, why = c._free_slot(0.0, patient_s=30.0)
    assert (slot, why) == (1, None), asked
    assert len(asked) == 8


def test_a_silent_daemon_is_not_waited_for():
    """A daemon that does not answer (stopped; a healed node's daemon left behind) skips the snapshot at once, as a
    due one does: waiting would hold every rank of the job in the snapshot's exchange."""
    c, asked = _client([(False, None), (False, "not answering for 1.0 s")])
    slot, why = c._free_slot(0.0, patient_s=30.0)
    assert slot is None and "not answering" in why and len(asked) == 2


def test_an_asked_for_snapshot_gives_up_at_its_deadline():
    c, asked = _client([])
    slot, why = c._free_slot(0.0, patient_s=0.3)
    assert slot is None and "still writing" in why and asked
