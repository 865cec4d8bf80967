"""The OOM naming's pure parts and file readers (the real OOM kill, end to end: tests/e2e/test_oom.py), and the
launcher's rule for a deterministic failure that recurs (:func:`accelpact_slurm.slurm.requeue.repeated_failure`)."""

from __future__ import annotations

from accelpact_slurm.runtime.detection import oom
from accelpact_slurm.slurm.requeue import repeated_failure


def test_the_count_is_read_from_v2_memory_events_and_v1_oom_control(tmp_path):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert (oom.oom_kills(str(v2)), oom.oom_kills(str(v1)), oom.oom_kills(str(tmp_path))) == (2, 3, None)


def test_a_count_that_rose_since_the_last_record_is_an_oom_kill_and_is_worded_with_the_ranks_memory(tmp_path):
    (tmp_path / "memory.oom_control").write_text("oom_kill 1\n")
    (tmp_path / "memory.limit_in_bytes").write_text(str(256 * 2**20))
    record = {"u": 6, "ph": "committed", "mem": {"cg": str(tmp_path), "ooms": 0, "rss": 300 * 1024}}  # no pid:
    info = oom.after_death(record)  # the kernel's log is not consulted
    assert info["oom_kill"] == [0, 1] and info["limit_bytes"] == 256 * 2**20 and "kernel" not in info
    text = oom.describe(info)
    assert text.startswith("killed by the kernel's OOM killer: out of memory (memory cgroup")
    assert "limit 256 MiB" in text and "peak RSS 300 MiB" in text and "last heartbeat: update 6, committed" in text
    assert oom.after_death({**record, "mem": {**record["mem"], "ooms": 1}}) is None  # no new kill: a crash
    assert oom.after_death({"pid": 1}) is None


def test_own_memory_names_this_process_peak_rss():
    mem = oom.own_memory()
    assert mem["rss"] > 1000  # KiB
    assert ("cg" in mem) == (oom.memory_cgroup() is not None)


def _stop(restart, update, culprit=3, cause="out-of-memory"):
    return {"event": "fail_stop", "restart": restart, "cause": cause, "culprit": culprit, "frontier": None,
            "oom_at": {"update": update, "phase": "committed"}, "reason": f"rank {culprit} died: OOM"}


def test_the_same_oom_kill_at_the_same_place_in_two_starts_in_a_row_is_repeated():
    assert "the same failure (out-of-memory) on rank 3 in update 6 (committed) ended starts 0 and 1" in \
        repeated_failure([_stop(0, 6), _stop(1, 6)], 1)
    assert repeated_failure([_stop(0, 6), _stop(1, 11)], 1) is None  # it moved on: progress
    assert repeated_failure([_stop(0, 6), _stop(1, 6, culprit=2)], 1) is None  # another rank
    assert repeated_failure([_stop(0, 6, cause="dead-rank"), _stop(1, 6, cause="dead-rank")], 1) is None
    assert repeated_failure([_stop(0, 6)], 0) is None
