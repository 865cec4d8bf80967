"""The dead-peer check's pure decision (:func:`accelpact_slurm.runtime.detection.peers.judge_peers`) and its naming.

End to end (a whole node SIGKILLed in each collective phase, with the negative control): tests/e2e/test_dead_peer.py.
"""

from __future__ import annotations

import json

from accelpact_slurm.runtime.detection import liveness as lv
from accelpact_slurm.runtime.detection.peers import gone_names, judge_peers


def seen(n, at, **extra):
    raw = json.dumps({"n": n, **extra}).encode()
    return lv.Seen(json.loads(raw), raw, at)


def test_alive_once_every_record_moved_since_the_first_read():
    base = {1: seen(5, 0.0).raw, 2: seen(7, 0.0).raw}
    assert judge_peers([1, 2], {1: seen(6, 0.3), 2: seen(7, 0.0)}, base, 0.3, heartbeat_s=3) is None  # 2: not yet
    v = judge_peers([1, 2], {1: seen(6, 0.3), 2: seen(8, 0.4)}, base, 0.4, heartbeat_s=3)
    assert v.kind == "alive"


def test_a_record_first_seen_after_the_error_is_not_proof_of_life():
    """The record read first is the baseline: a rank dead before the error shows the same record from then on."""
    first = {3: seen(9, 1.0)}
    assert judge_peers([3], first, {3: first[3].raw}, 1.0, heartbeat_s=3) is None
    v = judge_peers([3], first, {3: first[3].raw}, 4.1, heartbeat_s=3)
    assert v.kind == "gone" and v.verdicts[0].kind == lv.HUNG and v.verdicts[0].rank == 3


def test_a_dead_mark_decides_at_once_and_a_stopped_rank_is_adopted_or_present():
    dead = seen(4, 0.0, dead={"by": 2, "how": "its process ended"})
    v = judge_peers([3, 1], {3: dead, 1: seen(2, 0.1)}, {3: dead.raw, 1: b"x"}, 0.1, heartbeat_s=3)
    assert v.kind == "gone" and "rank 3 died" in v.verdicts[0].reason
    stopped = seen(3, 0.0, stop={"cause": "training-code", "reason": "boom", "exit_code": 76, "rank": 1})
    v = judge_peers([1], {1: stopped}, {1: stopped.raw}, 0.0, heartbeat_s=3)
    assert v.kind == "stopped" and v.verdicts[0].exit_code == 76
    assert judge_peers([1], {1: stopped}, {1: stopped.raw}, 0.0, heartbeat_s=3, adopt=False).kind == "alive"


def test_a_node_all_of_whose_ranks_are_gone_is_named_lost():
    vs = [lv.Verdict(lv.HUNG, 3, "rank 3 sent no heartbeat"), lv.Verdict(lv.DEAD, 2, "rank 2 died")]
    where, how, ranks, lost = gone_names(vs, 2)
    assert (where, ranks, lost) == ("node 1 lost (every rank of it gone: 2, 3)", [2, 3], [1])
    assert how == "rank 2 died; rank 3 sent no heartbeat"
    where, _how, ranks, lost = gone_names(vs[:1], 2)
    assert (where, ranks, lost) == ("rank(s) [3] gone (node 1)", [3], [])
