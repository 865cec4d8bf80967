"""The control plane's agreements on a real ``TCPStore``, one thread (and one store client) per rank."""

from __future__ import annotations

import secrets
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from accelpact_slurm.core.errors import ControlPlaneTimeout
from accelpact_slurm.runtime.transport import store_wire as w
from accelpact_slurm.runtime.transport.control import ControlPlane
from accelpact_slurm.runtime.transport.store import JobStore, binding, host_store, port_candidates

WORLD = 3


@pytest.fixture(params=["every-member-reads", "through-the-lead"])
def planes(request, monkeypatch):
    """Both ways a round goes: every member reading every value (few members), through the round's lead (many)."""
    monkeypatch.setattr(ControlPlane, "LEAD_FROM", 10**9 if request.param == "every-member-reads" else 1)
    host = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=20))
    clients = [dist.TCPStore("127.0.0.1", host.port, WORLD, is_master=False, timeout=timedelta(seconds=20))
               for _ in range(WORLD)]
    yield [ControlPlane(c, rank=r, world_size=WORLD, timeout_s=10) for r, c in enumerate(clients)]


def on_every_rank(planes, fn):
    """``fn(plane)`` on one thread per rank; the results (or exceptions) in rank order."""
    out: list = [None] * len(planes)

    def run(r):
        try:
            out[r] = fn(planes[r])
        except Exception as exc:  # returned for the test to look at
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(planes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_all_gather_returns_every_value_in_rank_order_round_after_round(planes):
    def rounds(p):
        return [p.all_gather("vote", {"r": p.rank, "n": n}) for n in range(5)]

    for got in on_every_rank(planes, rounds):
        assert got == [[{"r": r, "n": n} for r in range(WORLD)] for n in range(5)]


def test_a_missing_rank_is_named_at_the_deadline_and_the_store_keeps_its_timeout(planes):
    def two_of_three(p):
        if p.rank == 2:
            return None
        return p.all_gather("release", 1, timeout_s=0.5)

    t0 = time.monotonic()
    got = on_every_rank(planes, two_of_three)
    assert time.monotonic() - t0 < 10
    for r in (0, 1):
        assert isinstance(got[r], ControlPlaneTimeout), got[r]
        assert "no answer from rank(s) [2]" in str(got[r]) and "after 0.5 s" in str(got[r])
        assert planes[r].base_store.timeout == timedelta(seconds=20)


def test_a_contribution_ends_the_others_wait_at_once(planes):
    """A rank about to fail stop puts its reason into the round and does not wait; the others read it there."""
    def release(p):
        if p.rank == 1:
            p.contribute("release", {"ok": False, "why": "validation failed"})
            return "left"
        return p.all_gather("release", {"ok": True})

    t0 = time.monotonic()
    got = on_every_rank(planes, release)
    assert time.monotonic() - t0 < 5
    assert got[1] == "left"
    assert got[0] == got[2] == [{"ok": True}, {"ok": False, "why": "validation failed"}, {"ok": True}]
    # The round counts as the contributing rank's call: the next round pairs up again.
    assert on_every_rank(planes, lambda p: p.all_gather("release", p.rank)) == [[0, 1, 2]] * WORLD


def test_a_lead_that_contributes_and_leaves_still_ends_the_others_wait_at_once(planes):
    """The round's lead (rank 0) will not gather: the others read every member's value themselves."""
    def release(p):
        if p.rank == 0:
            p.contribute("release", {"ok": False, "why": "rank 0 failed"})
            return "left"
        return p.all_gather("release", {"ok": True}, timeout_s=5)

    t0 = time.monotonic()
    got = on_every_rank(planes, release)
    assert time.monotonic() - t0 < 4
    assert got[0] == "left"
    assert got[1] == got[2] == [{"ok": False, "why": "rank 0 failed"}, {"ok": True}, {"ok": True}]


# ------------------------------------------------------------------ what a round costs the store


class Counting(JobStore):
    """The project's store client, counting its requests: (operation, keys it names)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []
        self.read_bytes = 0

    def _call(self, op, items, timeout_s=None, meanwhile=None):
        keys = (len(items) // 2 if op in (w.SET, w.MULTI_SET) else 1 if op == w.CAS
                else len(items) - 1 if op == w.SET_GET else len(items))  # SET_GET: its key and the keys it reads
        self.calls.append((w.OPS[op], keys))
        out = super()._call(op, items, timeout_s, meanwhile)
        if w.OPS[op] in ("get", "multi_get", "set_multi_get"):
            got = out if isinstance(out, (list, tuple)) else [out]
            self.read_bytes += sum(len(x) for x in got if isinstance(x, (bytes, bytearray)))
        return out


@pytest.fixture
def counted(monkeypatch):
    """A served job store and, per rank, a control plane over a counting client of its own; every round through
    its lead (as from ``ControlPlane.LEAD_FROM`` members on)."""
    monkeypatch.setattr(ControlPlane, "LEAD_FROM", 1)
    key = secrets.token_bytes(32)
    bind_to = binding("77", 0)
    ports = port_candidates(key, "77")
    server = host_store("127.0.0.1", ports, key, bind_to)
    made: list[Counting] = []

    def planes(world: int) -> list[ControlPlane]:
        made.extend(Counting("127.0.0.1", ports, key, bind_to, r, timedelta(seconds=20)) for r in range(world))
        return [ControlPlane(c, rank=r, world_size=world, timeout_s=10) for r, c in enumerate(made[-world:])]

    yield planes, made
    for c in made:
        c.close()
    server.close()


def test_a_round_costs_every_member_but_the_lead_a_constant_number_of_one_key_requests(counted):
    """N = 8 members, 6 rounds of a vote: past the first rounds (with their cleanup running), each member but the
    lead sends 2 requests a round of one key each (its value, the result), and one delete of its stale keys every
    ``CLEANUP_BATCH`` rounds; the lead reads the other N-1 in one request.  The earlier algorithm (every member
    reads every member's key: ``all_read_all``) fails this."""
    make, clients = counted
    world = 8
    planes = make(world)
    for p in planes:
        p.CLEANUP_BATCH = 2  # a delete every other round here
    rounds = 6

    def votes(p):
        return [p.all_gather("vote", {"r": p.rank, "n": n}) for n in range(rounds)]

    for got in on_every_rank(planes, votes):
        assert got == [[{"r": r, "n": n} for r in range(world)] for n in range(rounds)]
    for r, c in enumerate(clients):
        if r:
            ops = [op for op, _k in c.calls]
            assert ops.count("set") == rounds and ops.count("multi_get") == rounds, (r, c.calls)
            assert ops.count("delete_key") == (rounds - 2) // 2, (r, c.calls)  # rounds 2.. leave one key each
            assert max(k for op, k in c.calls if op != "delete_key") == 1, (r, c.calls)
            assert all(k == 2 for op, k in c.calls if op == "delete_key"), (r, c.calls)
        else:
            reads = [k for op, k in c.calls if op in ("get", "multi_get")]
            assert reads == [world - 1] * rounds, c.calls
            assert len(c.calls) <= 4 * rounds
    # The store keeps a bounded number of rounds of keys: two, and the batch not yet deleted.
    assert clients[0].num_keys() <= (2 + 2) * (world + 1)


def test_the_earlier_algorithm_reads_every_members_key_on_every_member(counted):
    """The control for the test above: the same rounds with ``all_read_all`` read N keys on every member."""
    make, clients = counted
    planes = make(4)
    for p in planes:
        p.all_read_all = True
    on_every_rank(planes, lambda p: [p.all_gather("vote", p.rank) for _ in range(3)])
    for c in clients:  # one request a round: its own key set and the 4 members' read (1 + 4 keys named)
        assert [(op, k) for op, k in c.calls if op != "delete_key"] == [("set_multi_get", 5)] * 3


def test_a_round_below_lead_from_costs_every_member_one_request(monkeypatch):
    """Below ``LEAD_FROM`` members every member reads every value; with the job's store it sets its own in the same
    request (``set_multi_get``): a round costs a member one round trip, not two (control: without the call on the
    store, a set and a read).  A repair's release and every update's vote are such rounds."""
    key = secrets.token_bytes(32)
    bind_to = binding("78", 0)
    ports = port_candidates(key, "78")
    server = host_store("127.0.0.1", ports, key, bind_to)
    clients = [Counting("127.0.0.1", ports, key, bind_to, r, timedelta(seconds=20)) for r in range(4)]
    try:
        planes = [ControlPlane(c, rank=r, world_size=4, timeout_s=10) for r, c in enumerate(clients)]
        got = on_every_rank(planes, lambda p: [p.all_gather("vote", {"r": p.rank, "n": n}) for n in range(3)])
        assert all(g == [[{"r": r, "n": n} for r in range(4)] for n in range(3)] for g in got)
        for c in clients:
            assert [op for op, _k in c.calls] == ["set_multi_get"] * 3, c.calls
        monkeypatch.delattr(JobStore, "set_multi_get")  # the control plane then takes the two requests
        for c in clients:
            c.calls.clear()
        on_every_rank(planes, lambda p: p.all_gather("vote", p.rank))
        for c in clients:
            assert [op for op, _k in c.calls] == ["set", "multi_get"], c.calls
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_new_generation_costs_no_request_and_its_leftovers_go_with_the_next_batch(counted):
    """``set_generation`` (on the repair's critical path) sends nothing; the last generation's stale keys are
    deleted with the member's next cleanup request."""
    make, clients = counted
    planes = make(2)
    for p in planes:
        p.CLEANUP_BATCH = 2
    on_every_rank(planes, lambda p: [p.all_gather("vote", p.rank) for _ in range(3)])  # round 0 stale on rank 1
    stale = "cp/g0/vote#0/1"
    assert clients[0].check([stale])
    before = [len(c.calls) for c in clients]
    for p in planes:
        p.set_generation(p.generation + 1)
    assert [len(c.calls) for c in clients] == before
    assert clients[0].check([stale])  # still there: nothing was sent
    on_every_rank(planes, lambda p: [p.all_gather("vote", p.rank) for _ in range(3)])
    assert not clients[0].check([stale])  # gone with rank 1's first batch of the new generation


def test_a_reduced_round_costs_every_member_but_the_lead_bytes_that_do_not_grow_with_the_members(counted):
    """all_reduce (the vote): the lead reads the N values and combines them once; every other member reads only
    the combined result, a few bytes whatever N.  An all_gather of the same values reads them all on every member
    (the control)."""
    make, clients = counted
    world = 12
    planes = make(world)
    padding = "x" * 1000  # a vote-sized value and then some

    def count(values):
        return {"n": len(values), "ranks": sum(v["r"] for v in values)}

    got = on_every_rank(planes, lambda p: p.all_reduce("vote", {"r": p.rank, "pad": padding}, count))
    assert got == [{"n": world, "ranks": sum(range(world))}] * world
    lead_bytes, member_bytes = clients[0].read_bytes, [c.read_bytes for c in clients[1:]]
    assert lead_bytes >= (world - 1) * 1000, lead_bytes
    assert max(member_bytes) < 200, member_bytes
    before = [c.read_bytes for c in clients]
    on_every_rank(planes, lambda p: p.all_gather("vote-all", {"r": p.rank, "pad": padding}))
    assert min(c.read_bytes - b for c, b in zip(clients[1:], before[1:])) >= world * 1000


def test_all_reduce_gives_every_member_the_same_combined_value_both_ways(planes):
    got = on_every_rank(planes, lambda p: [p.all_reduce("sum", p.rank + n, lambda vs: {"total": sum(vs)})
                                           for n in range(3)])
    assert got == [[{"total": 3 * n + 3} for n in range(3)]] * len(planes)


@pytest.mark.parametrize("store", ["job-store", "tcpstore"])
def test_a_members_own_work_runs_once_its_value_is_in_and_before_it_waits(store, monkeypatch):
    """``meanwhile`` (the repair's walk during the vote) runs after the rank's value reached the store: rank 0's work
    waits, with a deadline, until rank 1 has left the round, which it can only do once rank 0's value is in.  Run
    before the send (the control), rank 1 would wait for rank 0 and the work would reach its deadline.  With the
    job's store it runs while the one request is in flight; with a plain store between the set and the read.  A
    failing ``meanwhile`` is raised after the round, which completes on every member, and the next round works."""
    if store == "job-store":
        key = secrets.token_bytes(32)
        bind_to = binding("79", 0)
        ports = port_candidates(key, "79")
        server = host_store("127.0.0.1", ports, key, bind_to)
        clients = [JobStore("127.0.0.1", ports, key, bind_to, r, timedelta(seconds=20)) for r in range(2)]
    else:
        server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=20))
        clients = [dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=timedelta(seconds=20))
                   for _ in range(2)]
    left = threading.Event()
    seen: list = []
    try:
        planes = [ControlPlane(c, rank=r, world_size=2, timeout_s=10) for r, c in enumerate(clients)]

        def work():
            seen.append(left.wait(10))  # rank 1 left the round: rank 0's value was in before this ran

        def rank(p):
            if p.rank == 0:
                got = p.all_reduce("vote", 3, sum, meanwhile=work)
            else:
                got = p.all_reduce("vote", 4, sum)
                left.set()
            return got

        assert on_every_rank(planes, rank) == [7, 7]
        assert seen == [True]

        def boom():
            raise ValueError("the walk failed")

        def failing(p):
            return p.all_reduce("vote", p.rank, sum, meanwhile=boom if p.rank == 0 else None)

        got = on_every_rank(planes, failing)
        assert isinstance(got[0], ValueError) and str(got[0]) == "the walk failed", got
        assert got[1] == 1
        assert on_every_rank(planes, lambda p: p.all_gather("after", p.rank)) == [[0, 1], [0, 1]]
    finally:
        if store == "job-store":
            for c in clients:
                c.close()
            server.close()
