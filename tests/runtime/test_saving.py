"""The verdict of a snapshot asked for (``run.save()``, the job's end) from every rank's answer.  Pure."""

from __future__ import annotations

from accelpact_slurm.runtime.state.saving import verdict


def _answer(node, state, why="", host=None):
    return {"node": node, "host": host or f"node{node + 1}", "state": state, "why": why}


def test_verified_only_when_every_rank_of_every_node_heard_verified():
    doc = verdict([_answer(0, "verified"), _answer(0, "verified"), _answer(1, "verified"), _answer(1, "verified")])
    assert doc == {"verified": True, "states": {"node1": "verified", "node2": "verified"},
                   "reason": "verified on every node (2)"}


def test_a_node_is_as_good_as_its_worst_rank_and_the_reason_names_it():
    doc = verdict([_answer(0, "verified"), _answer(0, "verified"),
                   _answer(1, "verified"), _answer(1, None, "no answer from the checkpoint daemon on node2: gone")])
    assert doc["verified"] is False
    assert doc["states"] == {"node1": "verified", "node2": None}
    assert doc["reason"] == "node2: no final state: no answer from the checkpoint daemon on node2: gone"


def test_every_lacking_node_is_named():
    doc = verdict([_answer(0, "rejected", "x.distcp fails its SHA-256 checksum (corrupted)"),
                   _answer(1, "failed", "No space left on device")])
    assert not doc["verified"]
    assert doc["reason"] == ("node1: rejected: x.distcp fails its SHA-256 checksum (corrupted); "
                             "node2: failed: No space left on device")


def _rank(answers_of_others=()):
    """Rank 0 of a world whose other ranks answered ``answers_of_others``: the control plane's round returns every
    rank's answer in rank order."""
    import io
    from types import SimpleNamespace

    gathered = {}

    def all_gather(name, value, timeout_s=None):
        gathered["name"], gathered["timeout_s"] = name, timeout_s
        return [value, *answers_of_others]

    rt = SimpleNamespace(rank=0, node=0, ctx=SimpleNamespace(hostname="node1", restart_count=1),
                         control=SimpleNamespace(all_gather=all_gather))
    cfg = SimpleNamespace(timeouts=SimpleNamespace(startup_s=120.0, control_s=30.0))
    return rt, cfg, io.StringIO(), gathered


class _Events:
    def __init__(self):
        self.emitted = []

    def emit(self, kind, **fields):
        self.emitted.append((kind, fields))


def test_a_step_this_start_loaded_is_neither_taken_nor_waited_for():
    from accelpact_slurm.runtime.state.saving import settle

    class NoClient:  # the reload chose the step verified on every rank: asking the daemon would wait for nothing
        def settle(self, step, timeout_s):
            raise AssertionError("the loaded step was snapshotted again")

    rt, cfg, out, gathered = _rank([_answer(1, "verified", host="node2")])
    events = _Events()
    doc = settle(rt, cfg, NoClient(), events, out, 25, "final", loaded=True)
    assert doc["verified"] and doc["step"] == 25 and doc["trigger"] == "final"
    assert gathered == {"name": "saved", "timeout_s": 150.0}
    assert [k for k, _ in events.emitted] == ["saved"]
    assert out.getvalue() == "[accelpact] the final snapshot: update 25 verified on every node (node1, node2)\n"


def test_a_snapshot_not_verified_is_said_in_one_line_and_the_event():
    from accelpact_slurm.runtime.state.saving import settle

    class Client:
        def settle(self, step, timeout_s):
            assert timeout_s == 120.0
            return "verified", "the daemon verified it"

    rt, cfg, out, _ = _rank([_answer(1, "failed", "No space left on device", host="node2")])
    events = _Events()
    doc = settle(rt, cfg, Client(), events, out, 12, "run.save", loaded=False)
    assert doc["verified"] is False
    (line,) = out.getvalue().splitlines()
    assert line == ("[accelpact] warning: run.save() of update 12 is not verified on every node: node2: failed: No "
                    "space left on device; a restart would resume from an older snapshot")
    (kind, fields), = events.emitted
    assert kind == "saved" and fields["verified"] is False and fields["states"] == {"node1": "verified",
                                                                                   "node2": "failed"}
