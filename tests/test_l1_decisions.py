"""Pure decisions of L1: the vote, the envelope lookup, the reference scan."""

from __future__ import annotations

import pytest

from accelpact_slurm.runtime import envelope as env_mod
from accelpact_slurm.runtime.guard import CONTINUE, Vote, affected_ranks, decide_votes
from accelpact_slurm.runtime.topology import Layout

KEY = env_mod.Key("torch-x/gloo", "cpu:2x2:fsdp1-device_mesh", "committed")


def qualified(trials=3, successes=3, actions=("preserve",)):
    return env_mod.Envelope([env_mod.Entry(KEY, actions, {"trials": trials, "successes": successes, "date": "d"})])


def lookup_with(envelope):
    return lambda phase: env_mod.decide(envelope, env_mod.Key(KEY.platform, KEY.profile, phase))


def votes(*specs):
    return [Vote(r, f, fault, "boom" if fault else None, 1.0) for r, (f, fault) in enumerate(specs)]


def test_no_fault_continues():
    assert decide_votes(votes((3, None), (3, None)), lookup_with(qualified()))[0] == CONTINUE


def test_boundary_fault_preserves_only_where_qualified():
    v = votes((3, None), (3, "committed"), (3, None), (3, "committed"))
    assert decide_votes(v, lookup_with(qualified()))[0] == "preserve"
    action, reason = decide_votes(v, lookup_with(env_mod.Envelope([])))
    assert action == "restart" and "no envelope entry" in reason


@pytest.mark.parametrize("envelope, words", [
    (qualified(trials=2, successes=2), "2/2"),
    (qualified(trials=5, successes=4), "4/5"),
    (qualified(actions=("restart",)), "does not qualify preserve"),
])
def test_weak_evidence_means_restart(envelope, words):
    action, reason = env_mod.decide(envelope, KEY)
    assert action == "restart" and words in reason


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_uncommitted_faults_restart_even_when_qualified(phase):
    v = votes((3, None), (3, phase))
    action, reason = decide_votes(v, lookup_with(qualified()))
    assert action == "restart" and phase in reason


def test_mixed_phases_restart():
    v = votes((3, "committed"), (3, "backward"))
    assert decide_votes(v, lookup_with(qualified()))[0] == "restart"


def test_frontier_mismatch_names_both_frontiers():
    v = votes((15, None), (15, None), (16, None), (15, None))
    action, reason = decide_votes(v, lookup_with(qualified()))
    assert action == "restart"
    assert "F=15" in reason and "F=16" in reason and "rank 2" in reason


def test_affected_ranks_are_the_faulty_replication_groups():
    layout = Layout(num_nodes=2, ranks_per_node=2)
    v = votes((3, None), (3, "committed"), (3, None), (3, "committed"))
    assert affected_ranks(v, layout.replicate_ranks, layout.local_of) == [1, 3]
    layout3 = Layout(num_nodes=3, ranks_per_node=2)
    v = votes(*[(3, "committed" if r == 4 else None) for r in range(6)])
    assert affected_ranks(v, layout3.replicate_ranks, layout3.local_of) == [0, 2, 4]


def test_envelope_round_trip(tmp_path):
    env = qualified()
    path = tmp_path / "env.yaml"
    env_mod.save(env, str(path))
    again = env_mod.load(str(path))
    assert again.find(KEY).evidence["trials"] == 3
    assert env_mod.load(str(tmp_path / "missing.yaml")).entries == []


def test_shipped_envelope_has_qualified_cpu_gloo_entries():
    shipped = env_mod.load()
    committed = [e for e in shipped.entries if e.key.phase == "committed" and e.key.platform.endswith("/gloo")]
    profiles = {e.key.profile.split(":")[-1] for e in committed if "preserve" in e.actions}
    assert {"fsdp1-device_mesh", "fsdp1-group_pair", "fsdp2-device_mesh"} <= profiles
    for e in committed:
        assert e.evidence["successes"] == e.evidence["trials"] >= env_mod.MIN_TRIALS
