"""The Slurm tests' retry under a dev-cluster daemon's crash (tests/slurm_cluster.py): once more, in a fresh
directory, only when the watchdog had to start a daemon again while the test ran."""

from __future__ import annotations

import pytest

from tests.slurm_cluster import Cluster, Watchdog, _watchdogs, rerun_after_a_crash


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(state_dir=tmp_path / "state", env={})
    _watchdogs[c.state_dir] = Watchdog(c)  # never started: the test plays its restarts
    yield c
    del _watchdogs[c.state_dir]


def test_a_test_failed_under_a_daemon_restart_runs_once_more_in_a_fresh_directory(cluster, tmp_path):
    seen = []

    @rerun_after_a_crash
    def body(slurm_cluster, tmp_path):
        seen.append(tmp_path)
        (tmp_path / "mine").write_text("x")  # each try starts from an empty directory: no leftovers to trip on
        if len(seen) == 1:
            _watchdogs[slurm_cluster.state_dir].restarts.append("slurmd-node2 not running: started again")
            raise AssertionError("the job died with its node's slurmd")

    body(slurm_cluster=cluster, tmp_path=tmp_path)
    assert seen == [tmp_path / "try-0", tmp_path / "try-1"]


def test_negative_control_a_failure_without_a_restart_is_the_tests_own(cluster, tmp_path):
    seen = []

    @rerun_after_a_crash
    def body(slurm_cluster, tmp_path):
        seen.append(tmp_path)
        raise AssertionError("a real failure")

    with pytest.raises(AssertionError, match="a real failure"):
        body(slurm_cluster=cluster, tmp_path=tmp_path)
    assert seen == [tmp_path / "try-0"]
