"""The test-only fault switches read from the environment: what each start gets, and a clear error for a bad value."""

import pytest

from accelpact_slurm.core.errors import ConfigError
from accelpact_slurm.core.faults import PACE, TestFaults


def test_pace_slows_the_first_start_only():
    assert TestFaults.from_environ({PACE: "0.2"}).pace_s == 0.2
    assert TestFaults.from_environ({PACE: "0.2", "SLURM_RESTART_COUNT": "1"}).pace_s == 0.0
    assert TestFaults.from_environ({}).pace_s == 0.0


@pytest.mark.parametrize("bad", ["fast", "-1", "nan", "inf"])
def test_a_bad_pace_names_the_switch_and_the_value(bad):
    with pytest.raises(ConfigError) as err:
        TestFaults.from_environ({PACE: bad})
    assert PACE in str(err.value) and bad in str(err.value) and "seconds" in str(err.value)


def test_the_daemon_kill_point_names_phase_step_and_node_on_the_first_start_only():
    from accelpact_slurm.core.faults import CKPTD_KILL_AT

    assert TestFaults.from_environ({CKPTD_KILL_AT: "renamed:6:node2"}).ckptd_kill_at == ("renamed", 6, "node2")
    assert TestFaults.from_environ({CKPTD_KILL_AT: "renamed:6"}).ckptd_kill_at == ("renamed", 6, None)
    assert TestFaults.from_environ({CKPTD_KILL_AT: "renamed:6", "SLURM_RESTART_COUNT": "1"}).ckptd_kill_at is None
    with pytest.raises(ConfigError) as err:
        TestFaults.from_environ({CKPTD_KILL_AT: "renamed:six"})
    assert CKPTD_KILL_AT in str(err.value) and "six" in str(err.value)
