"""A snapshot asked for (the job's end, ``run.save()``) waits for a staging slot instead of skipping.

On a loaded node the daemon, whose writers yield the CPU, may still hold both slots (the two snapshots before) when
the job ends; a due snapshot then skips (training goes on), but the final one must wait for a slot, or the job ends
without a verified snapshot of its last update.  The daemon here is a stand-in for its answers only: busy for the
first asks, silent once, then released.
"""

from __future__ import annotations

from ckpt_service.client import SLOTS, SnapshotClient


def _client(answers):
    """A client whose two slots hold snapshots 8 and 12, and whose daemon gives ``answers`` in turn."""
    c = object.__new__(SnapshotClient)
    c._slot_step = [8, 12] + [None] * (SLOTS - 2)
    asked = []

    def released(slot, wait_s):
        asked.append((slot, wait_s))
        return answers.pop(0) if answers else (False, None)

    c._released = released
    return c, asked


def test_a_due_snapshot_skips_when_both_slots_stay_busy():
    c, _ = _client([(False, None), (False, None), (False, None)])
    slot, why = c._free_slot(0.0)
    assert slot is None and "still writing snapshot 8" in why


def test_an_asked_for_snapshot_waits_past_busy_and_silent_answers_until_a_slot_is_released():
    """Negative control: without ``patient_s`` the same answers give no slot (the test above)."""
    answers = [(False, None), (False, None), (False, None),  # both busy, then the wait on the older one
               (False, "not answering for 1.0 s"),  # silent once
               (False, None), (True, None)]  # then the newer slot's snapshot is released
    c, asked = _client(answers)
    slot, why = c._free_slot(0.0, patient_s=30.0)
    assert (slot, why) == (1, None), asked
    assert len(asked) == 6


def test_an_asked_for_snapshot_gives_up_at_its_deadline():
    c, asked = _client([])
    slot, why = c._free_slot(0.0, patient_s=0.3)
    assert slot is None and "still writing" in why and asked
