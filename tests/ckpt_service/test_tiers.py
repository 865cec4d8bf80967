"""Pure rules of the shared tier and of agreed retention, and the shared tier's retention on real directories.

- who uploads which snapshot (once per job, the uploader rotating over the nodes);
- which shared copies stay (milestones for good, the newest ``shared_keep`` verified ones);
- the newest step verified on every node, protected by every node's retention;
- the step a restart loads and from where (the rule ``accelpact-status`` shows).
"""

from __future__ import annotations

import json
import os

import pytest

from ckpt_service.index import SHARED_SOURCE, read_indexes, record_state, restart_source
from ckpt_service.layout import daemon_failed_marker, step_dirname
from ckpt_service.retention import Snap, newest_common, plan_retention, plan_shared_retention
from ckpt_service.tiers import prune_shared, should_upload

V, C, R = "verified", "committed", "rejected"


# --------------------------------------------------------------------------- who uploads


def _uploader(step, every=10, k=2, nodes=3, m=0):
    """The node indexes that upload ``step`` (a correct rule names at most one, or all for a milestone)."""
    return [i for i in range(nodes) if should_upload(step, every_steps=every, shared_every=k, milestone_every=m,
                                                     node_index=i, num_nodes=nodes)[0]]


@pytest.mark.parametrize("step, expect", [
    (10, []),        # snapshot 1: not a 2nd one
    (20, [1]),       # snapshot 2: (2 // 2) % 3
    (30, []),
    (40, [2]),       # snapshot 4
    (60, [0]),       # snapshot 6: the rotation wraps
    (80, [1]),
    (25, [1]),       # a snapshot off the cadence (before a requeue): snapshot number 25 // 10 = 2
])
def test_every_kth_snapshot_is_uploaded_by_exactly_one_rotating_node(step, expect):
    assert _uploader(step) == expect


def test_rotation_spreads_the_uploads_over_every_node():
    owners = [_uploader(step, every=5, k=1, nodes=4)[0] for step in range(5, 85, 5)]
    assert sorted(set(owners)) == [0, 1, 2, 3] and all(owners.count(i) == 4 for i in range(4))


def test_milestones_go_up_from_every_node_and_shared_every_0_sends_only_them():
    assert _uploader(30, m=30) == [0, 1, 2]  # every node copies a milestone; the first rename wins
    ok, why = should_upload(20, every_steps=10, shared_every=0, milestone_every=0, node_index=1, num_nodes=2)
    assert not ok and "shared_every is 0" in why


@pytest.mark.parametrize("index, nodes", [(None, 2), (0, None), (3, 2), (-1, 2)])
def test_unknown_placement_falls_back_to_every_node(index, nodes):
    ok, why = should_upload(20, every_steps=10, shared_every=2, milestone_every=0, node_index=index, num_nodes=nodes)
    assert ok and "every node copies it" in why


def test_every_steps_0_counts_every_step():
    assert _uploader(4, every=0, k=2, nodes=2) == [0] and _uploader(6, every=0, k=2, nodes=2) == [1]
    assert _uploader(5, every=0, k=2, nodes=2) == []


# --------------------------------------------------------------------------- the shared tier's retention


def _shared_deleted(snaps, keep=2, m=0):
    return [s for s, _ in plan_shared_retention([Snap(*x) for x in snaps], keep, m)[0]]


@pytest.mark.parametrize("snaps, keep, m, expect", [
    ([], 2, 0, []),
    ([(2, V), (4, V)], 2, 0, []),
    ([(2, V), (4, V), (6, V)], 2, 0, [2]),
    ([(2, V), (4, V), (6, V)], 1, 0, [2, 4]),
    ([(2, V), (4, V), (6, V), (8, V), (10, V)], 1, 4, [2, 6]),  # milestones 4 and 8 stay for good
    ([(4, V), (8, V), (10, V)], 1, 4, []),                  # 4 and 8 milestones, 10 the newest verified
    ([(2, V), (4, V), (6, R)], 1, 0, [2]),                  # a newer rejected copy stays visible
    ([(2, R), (4, V), (6, V)], 1, 0, [2, 4]),
    ([(2, V), (4, V), (6, C)], 1, 0, [2]),                  # a copy still being recorded stays
    ([(2, C), (4, R)], 1, 0, []),                           # nothing verified: nothing goes
])
def test_shared_retention(snaps, keep, m, expect):
    assert _shared_deleted(snaps, keep, m) == expect


def test_shared_retention_never_deletes_the_newest_verified_and_guards_shared_keep():
    for keep in (1, 2, 5):
        snaps = [Snap(s, V) for s in range(2, 40, 2)]
        assert 38 not in _shared_deleted([(s.step, s.state) for s in snaps], keep)
    deletions, why = plan_shared_retention([Snap(2, V), Snap(4, V)], 1)
    assert deletions == [(2, "outside the newest 1 verified shared copies and not a milestone")] and "keep 1" in why
    with pytest.raises(ValueError, match="shared_keep must be >= 1"):
        plan_shared_retention([], 0)


def _shared_tier(root, steps, state=V):
    for step in steps:
        d = root / step_dirname(step)
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"created": float(step), "files": {}}))
        record_state(str(d), state)
    return str(root)


def test_prune_renames_aside_then_removes_and_keeps_milestones(tmp_path):
    shared = _shared_tier(tmp_path / "shared", [2, 4, 6, 8, 10])
    (tmp_path / "shared" / ".del-step-0000000001-node9-1").mkdir()  # left by a daemon killed mid-removal
    done = prune_shared(shared, 1, 4, "node1")
    assert [s for s, _ in done] == [2, 6]
    assert sorted(os.listdir(shared)) == [step_dirname(s) for s in (4, 8, 10)]  # nothing half-deleted left


def test_prune_skips_a_snapshot_another_daemon_took_first(tmp_path, monkeypatch):
    """Two daemons prune at once: both plan to delete step 2; the one whose rename comes second skips it."""
    shared = _shared_tier(tmp_path / "shared", [2, 4, 6])
    import ckpt_service.tiers as tiers

    real_scan = tiers.scan

    def raced_scan(path, milestone_every=0):
        recs = real_scan(path, milestone_every)
        os.rename(os.path.join(path, step_dirname(2)), os.path.join(path, ".del-step-0000000002-node2-7"))
        return recs  # the other daemon renamed step 2 away after this one listed it

    monkeypatch.setattr(tiers, "scan", raced_scan)
    assert prune_shared(shared, 2, 0, "node1") == []
    assert sorted(os.listdir(shared)) == [step_dirname(4), step_dirname(6)]


# --------------------------------------------------------------------------- agreed retention (pure)


@pytest.mark.parametrize("per_node, step, words", [
    ({}, None, "no node has published an index"),
    ({"node1": [1, 2, 3, 4, 5], "node2": [1, 2]}, 2, "step 2 is the newest step verified on every one of 2"),
    ({"node1": [4, 5], "node2": [1, 2]}, None, "no step is verified on every node"),
    ({"node1": [4, 5], "node2": []}, None, "no verified step on node2"),
    ({"node1": [2, 4], "node2": [2, 4], "node3": [4]}, 4, "step 4"),
])
def test_newest_common(per_node, step, words):
    got, why = newest_common(per_node)
    assert got == step and words in why


def _deleted(snaps, keep=2, m=0, protect=()):
    return [s for s, _ in plan_retention([Snap(*x) for x in snaps], keep, m, protect=protect)[0]]


def test_retention_keeps_the_protected_common_step():
    # node1 keeps verifying while node2's disk is full since step 3: node1 must keep step 2.
    snaps = [(2, V), (3, V), (4, V), (5, V)]
    assert _deleted(snaps) == [2, 3]
    assert _deleted(snaps, protect=(2,)) == [3]
    assert _deleted([(2, R), (3, V), (4, V), (5, V)], protect=(2,)) == [2, 3]  # a rejected step is no common step
    assert _deleted(snaps, protect=(9,)) == [2, 3]  # a step this node does not hold changes nothing


def test_read_indexes_skips_its_own_and_the_daemon_failed_markers(tmp_path):
    idx = tmp_path / "ckpt-index"
    idx.mkdir()
    for node, steps in (("node1", [1, 2]), ("node2", [2])):
        (idx / f"{node}.json").write_text(json.dumps({"node": node, "snapshots": [{"step": s, "state": V}
                                                                                  for s in steps]}))
    with open(daemon_failed_marker(str(tmp_path), "node3"), "w") as fh:
        json.dump({"node": "node3", "restart": 0, "reason": "read-only"}, fh)
    (idx / "node4.json").write_text('{"node": "node4", "snap')  # unreadable: skipped
    got = read_indexes(str(tmp_path), exclude="node1")
    assert list(got) == ["node2"] and got["node2"][0]["step"] == 2


# --------------------------------------------------------------------------- the step a restart loads


def _recs(*pairs):
    return [{"step": s, "state": st} for s, st in pairs]


@pytest.mark.parametrize("per_source, step, source, words", [
    ({}, None, None, "no snapshot on any node or in the shared tier"),
    ({"node1": _recs((4, C)), SHARED_SOURCE: _recs((2, R))}, None, None, "none of 2 snapshot(s)"),
    ({"node1": _recs((4, V), (8, V)), "node2": _recs((4, V), (8, V)), SHARED_SOURCE: _recs((8, V))}, 8, "node1",
     "(on node1, node2 and in the shared tier); every node loads its own copy"),
    # node2's disk filled at step 5: node1's 8 is loaded, node2 gets it through a copy made at the restart
    ({"node1": _recs((4, V), (8, V)), "node2": _recs((4, V)), SHARED_SOURCE: []}, 8, "node1",
     "node2 loads it through a copy node1 makes in the shared tier"),
    # both nodes lost their disks: the shared tier's copy
    ({"node1": [], "node2": [], SHARED_SOURCE: _recs((6, V), (8, R))}, 6, SHARED_SOURCE,
     "node1, node2 load it through the shared tier's copy"),
    # a newer verified copy in the shared tier than on any node (a node's copy was rejected at its restart)
    ({"node1": _recs((4, V), (8, R)), SHARED_SOURCE: _recs((8, V))}, 8, SHARED_SOURCE, "(in the shared tier)"),
])
def test_restart_source(per_source, step, source, words):
    got, src, why = restart_source(per_source)
    assert (got, src) == (step, source) and words in why, why
