"""Spare nodes' pure parts: numbering, the assignment record, the hand-over's compare-and-set (on a fake store with
the job's store's semantics), the pool from events, and the launchers that refuse spares for now.  Pure."""

from __future__ import annotations

import json

import pytest

from accelpact_slurm.core.errors import ConfigError
from accelpact_slurm.core.spares import (END_RECORD, Assignment, announce_end, assign_key, assign_spare,
                                         check_spares_started, free_spare_nodes, is_end, ready_key, spare_hostname,
                                         spare_id, spare_nodes, spare_pool)


class FakeStore:
    """The job's store's semantics for the calls the pool uses (``store_server``: CAS from absent on ``b""``)."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, key):
        return self.d[key]

    def set(self, key, value):
        self.d[key] = value if isinstance(value, bytes) else str(value).encode()

    def compare_set(self, key, expected, desired):
        expected = expected if isinstance(expected, bytes) else expected.encode()
        desired = desired if isinstance(desired, bytes) else desired.encode()
        cur = self.d.get(key)
        if (cur is None and expected == b"") or cur == expected:
            self.d[key] = desired
            return desired
        return expected if cur is None else cur


def test_numbering_follows_the_training_nodes():
    assert spare_nodes(2, 2) == [2, 3] and spare_nodes(2, 0) == []
    assert [spare_id(n, l, 2, 2) for n in (2, 3) for l in (0, 1)] == [0, 1, 2, 3]
    assert spare_hostname(2) == "node3"
    assert ready_key(2, 1) == "spare/ready/2/1" and assign_key(3) == "spare/assign/3"


def test_assignment_round_trip_and_checks():
    a = Assignment(generation=1, dead_node=1, spare_node=2, ranks=(2, 3), frontier=7)
    assert Assignment.from_json(a.to_json()) == a
    assert json.loads(a.to_json())["schema"] == "accelpact-spare-assign/1"
    assert a.check(2, 2, 1)[0]
    assert not a.check(2, 2, 0)[0]  # no spare node 2 in a job without spares
    assert "not node 1's ranks" in Assignment(generation=1, dead_node=1, spare_node=2, ranks=(3, 2),
                                              frontier=7).check(2, 2, 1)[1]
    assert "no training node" in Assignment(generation=1, dead_node=2, spare_node=2, ranks=(4, 5),
                                            frontier=7).check(2, 2, 1)[1]
    for bad in (b"{}", b'{"schema":"accelpact-spare-assign/1","generation":true}', b"[1]"):
        with pytest.raises(ValueError):
            Assignment.from_json(bad)
    assert is_end(END_RECORD) and not is_end(a.to_json()) and not is_end(b"not json")


def test_a_spare_node_is_handed_one_place_once_and_none_after_the_end():
    """Of two healers only one gets the spare node; after the job's end none does.  Negative control: a node
    whose processes are not all ready is not offered as free."""
    store = FakeStore()
    store.set(ready_key(2, 0), b"{}")
    assert free_spare_nodes(store, nodes=2, ranks_per_node=2, spare_count=2) == []  # the control: half warm
    for node in (2, 3):
        for local in (0, 1):
            store.set(ready_key(node, local), b"{}")
    assert free_spare_nodes(store, nodes=2, ranks_per_node=2, spare_count=2) == [2, 3]
    a = Assignment(generation=1, dead_node=0, spare_node=2, ranks=(0, 1), frontier=4)
    assert assign_spare(store, a, nodes=2, ranks_per_node=2, spare_count=2)[0]
    again, why = assign_spare(store, Assignment(generation=2, dead_node=1, spare_node=2, ranks=(2, 3), frontier=5),
                              nodes=2, ranks_per_node=2, spare_count=2)
    assert not again and "handed a place already" in why
    assert Assignment.from_json(store.get(assign_key(2))) == a
    assert free_spare_nodes(store, nodes=2, ranks_per_node=2, spare_count=2) == [3]
    announce_end(store, nodes=2, spare_count=2)
    assert Assignment.from_json(store.get(assign_key(2))) == a  # an assignment is kept
    late, why = assign_spare(store, Assignment(generation=2, dead_node=1, spare_node=3, ranks=(2, 3), frontier=5),
                             nodes=2, ranks_per_node=2, spare_count=2)
    assert not late and "ended" in why
    wrong, why = assign_spare(FakeStore(), Assignment(generation=1, dead_node=0, spare_node=5, ranks=(0, 1),
                                                      frontier=1), nodes=2, ranks_per_node=2, spare_count=2)
    assert not wrong and "no spare node" in why


def _ev(kind, restart=0, **fields):
    return {"event": kind, "restart": restart, **fields}


def test_the_pool_from_events():
    start = _ev("job_start", config={"topology": {"spare_nodes": 2, "ranks_per_node": 2}})
    procs = [_ev("process", role="spare", node=n, local_rank=l, pid=100 + n * 2 + l) for n in (2, 3) for l in (0, 1)]
    ready = [_ev("spare_ready", node=n, local_rank=l) for n in (2, 3) for l in (0, 1)]
    assert spare_pool([start, *procs]) == {"restart": 0, "configured": 2, "per_node": 2,
                                           "nodes": {"2": "starting", "3": "starting"}, "free": 0, "used": 0,
                                           "starting": 2, "ended": 0, "heals": [], "refused": []}
    pool = spare_pool([start, *procs, *ready[:3]])
    assert pool["nodes"] == {"2": "free", "3": "starting"} and pool["free"] == 1
    taken = _ev("spare_assigned", node=2, local_rank=0)
    pool = spare_pool([start, *procs, *ready, taken])
    assert (pool["free"], pool["used"]) == (1, 1) and pool["nodes"]["2"] == "used"
    ended = [_ev("spare_end", node=n, local_rank=l) for n in (2, 3) for l in (0, 1)]
    pool = spare_pool([start, *procs, *ready, taken, *ended])
    assert pool["nodes"] == {"2": "used", "3": "ended"}
    # a relaunch starts new spares: the newest start's pool, alone
    pool = spare_pool([start, *procs, *ready, taken, *ended, _ev("process", 1, role="spare", node=2, local_rank=0)])
    assert pool["restart"] == 1 and pool["nodes"] == {"2": "starting"}
    # a job without spares has no pool; a rank's process event is no spare
    assert spare_pool([_ev("job_start", config={"topology": {"spare_nodes": 0}}),
                       _ev("process", role="rank", node=0, local_rank=0, rank=0)]) is None


def test_launchers_that_do_not_start_spares_refuse_them():
    check_spares_started(0, "accelpact-submit")
    with pytest.raises(ConfigError) as info:
        check_spares_started(1, "the sbatch template")
    msg = str(info.value)
    assert msg.startswith("topology.spare_nodes: invalid value 1:") and "--spare-nodes 0" in msg and "\n" not in msg


def test_decide_heal_takes_one_whole_node_and_a_free_spare():
    from accelpact_slurm.core.spares import decide_heal

    a, why = decide_heal([3, 2], nodes=2, ranks_per_node=2, free_nodes=[3, 2], frontier=4, generation=1)
    assert a is not None and (a.dead_node, a.spare_node, a.ranks, a.frontier, a.generation) == (1, 2, (2, 3), 4, 1)
    assert a.check(2, 2, 2)[0] and "spare node 2 takes node 1" in why


def test_negative_controls_decide_heal_refuses_what_a_spare_cannot_heal():
    from accelpact_slurm.core.spares import decide_heal

    kw = dict(nodes=3, ranks_per_node=2, frontier=4, generation=1)
    assert decide_heal([], free_nodes=[3], **kw) == (None, "no rank is dead")
    assert "span nodes" in decide_heal([2, 4], free_nodes=[3], **kw)[1]
    assert "only a whole node" in decide_heal([2], free_nodes=[3], **kw)[1]
    assert "no training node" in decide_heal([6, 7], free_nodes=[3], **kw)[1]
    assert decide_heal([0, 1], free_nodes=[3], **kw)[0].dead_node == 0  # node 0 too: the store has a standby
    assert "no spare node is free" in decide_heal([4, 5], free_nodes=[], **kw)[1]
    assert decide_heal([4, 5], free_nodes=[3], **kw)[0] is not None


def test_the_pool_keeps_every_heal_and_every_refusal():
    """Negative control: a heal one of whose pairs failed its certificate is not certified."""
    from accelpact_slurm.core.spares import spare_pool

    start = {"event": "job_start", "restart": 0, "config": {"topology": {"spare_nodes": 1, "ranks_per_node": 2}}}
    heal = {"event": "heal", "restart": 0, "generation": 1, "dead_node": 1, "spare_node": 2, "frontier": 3}
    ok = [{**heal, "role": r, "certified": True, "seconds": {"total": t}} for r, t in (("source", 1.5), ("spare", 0.1))]
    pool = spare_pool([start, *ok, {"event": "heal_refused", "restart": 0, "reason": "no heal: no spare node is free"}])
    assert pool["heals"] == [{"restart": 0, "generation": 1, "dead_node": 1, "spare_node": 2, "frontier": 3,
                              "certified": True, "seconds": 1.5}]
    assert pool["refused"] == [{"restart": 0, "reason": "no heal: no spare node is free"}]
    bad = spare_pool([start, ok[0], {**ok[1], "certified": False}])
    assert bad["heals"][0]["certified"] is False
