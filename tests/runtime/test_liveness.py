"""The detector's pure verdicts, and its heartbeat and round watching on a real ``TCPStore``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from accelpact_slurm.core.errors import FailStop
from accelpact_slurm.runtime.detection import liveness as lv
from accelpact_slurm.runtime.detection.collectives import LinkBounds, stop_from_round
from accelpact_slurm.runtime.transport.control import STOP_KEY, ControlPlane, poisoned

G = "g-rep"
HB = 10.0
FRESH = 1.5
POS = (0, {"vote": 4})  # this rank entered 4 vote rounds of generation 0


def seen(record, changed_at=0.0):
    return lv.Seen(record, json.dumps(record).encode() if record is not None else None, changed_at)


def rec(wait=None, done=None, stop=None, dead=None, n=1):
    r = {"n": n, "w": wait, "d": done or {}, "stop": stop, "u": 7, "ph": "backward"}
    if dead:
        r["dead"] = dead
    return r


def judge(others, now=1.0, episode=None, bound=0.5, members=(0, 1, 2), seq=5):
    return lv.judge_collective(0, list(members), G, seq, others, now, episode or lv.Episode(started=0.0),
                               bound_s=bound, heartbeat_s=HB, fresh_s=FRESH, position=POS)


# ------------------------------------------------------------------ verdicts on a collective


def test_a_member_computing_is_a_straggler_and_the_wait_goes_on():
    others = {1: seen(rec()), 2: seen(rec(wait=["d", G, 5]))}
    ep = lv.Episode(started=0.0)
    for now in (0.1, 1.0, 5.0):  # however long (up to the backend's own timeout)
        others = {1: seen(rec(n=int(now * 10)), changed_at=now), 2: seen(rec(wait=["d", G, 5]), changed_at=now)}
        assert judge(others, now=now, episode=ep) is None


def test_every_member_alive_in_the_same_collective_past_the_bound_is_a_broken_link():
    ep = lv.Episode(started=0.0)
    inside = lambda t: {1: seen(rec(wait=["d", G, 5], n=int(t * 10)), t), 2: seen(rec(wait=["d", G, 5]), t)}
    assert judge(inside(0.1), now=0.1, episode=ep) is None  # first seen all in
    assert judge(inside(0.5), now=0.5, episode=ep) is None  # within the bound
    v = judge(inside(0.7), now=0.7, episode=ep)
    assert v is not None and v.kind == lv.LINK and not v.fails_stop and "broken link" in v.reason


def test_all_in_needs_every_member_fresh_a_silent_one_is_not_a_link_fault():
    ep = lv.Episode(started=0.0)
    # rank 2's record says it waits in the collective, but it has not moved for 5 s: not alive, not "all in"
    for now in (0.1, 0.9, 2.0):
        others = {1: seen(rec(wait=["d", G, 5], n=int(now * 10)), now), 2: seen(rec(wait=["d", G, 5]), now - 5.0)}
        assert judge(others, now=now, episode=ep) is None


def test_a_member_in_a_control_plane_round_this_rank_has_not_reached_left_the_collective():
    v = judge({1: seen(rec(wait=["c", 0, "vote", 4])), 2: seen(rec())})
    assert v.kind == lv.LEFT and "'vote'" in v.reason and not v.fails_stop
    # the same record, but of a round this rank already passed (a record that lags): says nothing
    assert judge({1: seen(rec(wait=["c", 0, "vote", 3])), 2: seen(rec())}) is None
    assert judge({1: seen(rec(wait=["c", 1, "vote", 0])), 2: seen(rec())}).kind == lv.LEFT  # a newer generation


def test_another_ranks_notice_of_this_update_gives_the_collective_up_and_no_other_notice_does():
    """The job's notice (a collective of this generation's update 7 given up by rank 3, in another group): every
    rank waiting in a collective of that update gives it up at its next look, though its own members only compute.
    A notice of another generation or update, or this rank's own, says nothing; a dead member still fails stop."""
    computing = {1: seen(rec()), 2: seen(rec(wait=["d", G, 5]))}
    notice = lv.encode_notice(0, 7, 3, "g-other", 12, "link")

    def with_notice(raw, others=computing, update=7):
        return lv.judge_collective(0, [0, 1, 2], G, 5, others, 1.0, lv.Episode(started=0.0), bound_s=0.5,
                                   heartbeat_s=HB, fresh_s=FRESH, position=POS, notice=raw, update=update)

    v = with_notice(notice)
    assert v.kind == lv.LEFT and v.noticed and v.rank == 3 and not v.fails_stop
    assert "rank 3 gave up update 7's collective 12 of group g-other (link)" in v.reason
    assert with_notice(None) is None and with_notice(b"") is None  # no notice yet (rank 0 creates it empty)
    assert with_notice(lv.encode_notice(1, 7, 3, "g", 1, "x")) is None  # another generation (after a repair)
    assert with_notice(notice, update=8) is None  # an earlier update's
    assert with_notice(lv.encode_notice(0, 7, 0, "g", 1, "x")) is None  # its own
    dead = {1: seen(rec(dead={"by": 2, "how": "its process ended"})), 2: seen(rec())}
    assert with_notice(notice, others=dead).kind == lv.DEAD


def test_a_member_that_completed_the_collective_is_no_verdict():
    """On a loaded node the waiting rank's backend thread may not have run yet: only the backend's timeout decides."""
    ep = lv.Episode(started=0.0)
    for now in (0.1, 0.5, 2.0):
        assert judge({1: seen(rec(done={G: 6}), now), 2: seen(rec(), now)}, now=now, episode=ep) is None


@pytest.mark.parametrize("record, kind, fails", [
    (rec(dead={"by": 2, "how": "its process ended"}), lv.DEAD, True),
    (rec(stop={"cause": "training-code", "reason": "ValueError at x.py:3", "exit_code": 76, "rank": 1}), lv.STOPPED,
     True),
])
def test_dead_and_stopped_members_fail_the_wait_stop(record, kind, fails):
    v = judge({1: seen(record, changed_at=0.9), 2: seen(rec(), 0.9)})
    assert v.kind == kind and v.fails_stop is fails and v.rank == 1


def test_a_stopped_member_passes_on_its_culprit_and_exit_code():
    stop = {"cause": "hung-rank", "reason": "rank 3 sent no heartbeat", "exit_code": 75, "rank": 3}
    v = judge({1: seen(rec(stop=stop), 0.9), 2: seen(rec(), 0.9)})
    assert (v.rank, v.exit_code, v.cause) == (3, 75, "hung-rank") and "rank 3 sent no heartbeat" in v.reason


def test_a_member_silent_for_heartbeat_s_is_hung():
    assert judge({1: seen(rec(), changed_at=0.0), 2: seen(rec(), 10.0)}, now=HB - 0.1) is None
    v = judge({1: seen(rec(), changed_at=0.0), 2: seen(rec(), 10.0)}, now=HB + 0.1)
    assert v.kind == lv.HUNG and v.rank == 1 and v.fails_stop and "no heartbeat for 10.1 s" in v.reason


def test_a_round_fails_only_on_missing_members_that_will_never_come():
    now = 20.0
    fine = {1: seen(rec(wait=["d", G, 5]), now), 2: seen(rec(), now)}
    assert lv.judge_control([1, 2], fine, now, heartbeat_s=HB) is None
    dead = {**fine, 2: seen(rec(dead={"by": 3, "how": "its process ended"}), now)}
    assert lv.judge_control([1, 2], dead, now, heartbeat_s=HB).kind == lv.DEAD
    assert lv.judge_control([1], dead, now, heartbeat_s=HB) is None  # rank 2 already joined: not its business
    # one that finished its loop is on its way to the job's last rounds: waited for, not stopped on
    done = {**fine, 2: seen(rec(stop={"cause": "completed", "reason": "the job finished", "exit_code": 0}), now)}
    assert lv.judge_control([1, 2], done, now, heartbeat_s=HB) is None


def test_the_learned_bound_starts_at_the_ceiling_follows_the_job_and_widens_after_a_link_verdict():
    b = LinkBounds(floor_s=0.5, ceiling_s=5.0)
    assert b.bound("replicate") == 5.0  # nothing learned yet: the backend's ceiling
    for _ in range(20):
        b.add("replicate", 0.01)
    assert b.bound("replicate") == 0.5  # 4 x 10 ms is below the floor
    b.add("replicate", 0.3)
    assert b.bound("replicate") == pytest.approx(1.2)
    b.widen("replicate")
    assert b.bound("replicate") == pytest.approx(2.4)
    for _ in range(3):
        b.widen("replicate")
    assert b.bound("replicate") == 5.0 and b.bound("shard") == 5.0


def test_a_bound_learned_on_small_collectives_does_not_bound_a_large_one():
    """The guard's 8-byte all-reduce says nothing of a 100 MB all-gather: until collectives of that size (or larger)
    have completed, the ceiling; a larger one's duration bounds a smaller one."""
    b = LinkBounds(floor_s=0.5, ceiling_s=5.0)
    for _ in range(10):
        b.add("replicate", 0.01, nbytes=8)
    assert b.bound("replicate", 8) == 0.5 and b.bound("replicate", 100 << 20) == 5.0
    for _ in range(3):
        b.add("replicate", 0.4, nbytes=100 << 20)
    assert b.bound("replicate", 100 << 20) == pytest.approx(1.6)
    assert b.bound("replicate", 1 << 20) == pytest.approx(1.6)  # bounded by the larger ones
    assert b.bound("replicate", 1 << 30) == 5.0  # nothing that large yet


def test_a_stop_put_in_a_members_place_reads_back_as_the_fail_stop_it_says():
    raw = json.dumps({STOP_KEY: {"kind": lv.DEAD, "rank": 3, "reason": "rank 3 died", "exit_code": None,
                                 "cause": None}}).encode()
    stop = poisoned(raw)
    err = stop_from_round(stop, "vote")
    assert isinstance(err, FailStop) and err.cause == "dead-rank" and err.exit_code == 75
    assert err.context["rank"] == 3 and "'vote'" in err.reason
    assert poisoned(json.dumps({"F": 3, "fault": None}).encode()) is None


# ------------------------------------------------------------------ on a real store


@pytest.fixture
def store():
    host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    clients = []

    def client():
        c = dist.TCPStore("127.0.0.1", host.port, 1, is_master=False, timeout=timedelta(seconds=20))
        clients.append(c)
        return c

    yield client


def wait_until(pred, timeout_s=10.0, what="the condition"):
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.01)  # polling against a deadline


def test_the_heartbeat_advances_off_the_calling_thread_and_says_what_the_rank_waits_in(store):
    state = lv.LocalState(update=3, phase="forward")
    pub = lv.Publisher(store(), 1, state, interval_s=0.05)
    pub.start()
    reader = lv.Observer(store())
    try:
        first = reader.look([1])[1].record["n"]
        wait_until(lambda: reader.look([1])[1].record["n"] >= first + 3, what="three heartbeats")
        state.wait = ["d", G, 9]
        assert pub.publish_now()
        assert reader.look([1])[1].record["w"] == ["d", G, 9]
    finally:
        pub.close()


def test_the_death_of_a_node_peer_is_published_within_a_fraction_of_a_second(store):
    """A real process, killed with SIGKILL: its node peer's pidfd sees it end, and every reader sees ``dead``.
    Negative control: the same peer, not watched, stays alive in its record (only its heartbeat would tell)."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    victim_state = lv.LocalState()
    victim = lv.Publisher(store(), 2, victim_state, interval_s=60.0)  # its record, as its own thread left it
    victim.start()
    victim.close()
    watcher = lv.Publisher(store(), 3, lv.LocalState(), interval_s=0.05)
    watcher.start()
    reader = lv.Observer(store())
    try:
        assert reader.look([2])[2].record.get("dead") is None
        watcher.watch_peers({2: peer.pid})
        n = watcher.n
        wait_until(lambda: watcher.n >= n + 2, what="two rounds of the watcher with the peer watched")
        assert reader.look([2])[2].record.get("dead") is None  # alive and watched: nothing happens
        os.kill(peer.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: reader.look([2])[2].record.get("dead"), timeout_s=5.0, what="the death")
        assert time.monotonic() - t0 < 5.0
        assert reader.look([2])[2].record["dead"]["by"] == 3 and watcher.dead == {2: "its process ended"}
    finally:
        watcher.close()
        peer.kill()
        peer.wait()


@pytest.mark.parametrize("lead_from", [1, 10**9], ids=["through-the-lead", "every-member-reads"])
def test_a_round_a_dead_member_will_never_join_ends_at_once_on_every_waiting_rank(store, lead_from, monkeypatch):
    """Ranks 0 and 1 wait in a vote rank 2 never joins: rank 2's record says dead, so the liveness thread of each
    waiter puts a stop in rank 2's place and both reads end with the fail-stop, long before the 20 s deadline.
    Negative control: the same round, blind (no detector), runs into its deadline."""
    monkeypatch.setattr(ControlPlane, "LEAD_FROM", lead_from)
    for r in range(3):
        lv.Publisher(store(), r, lv.LocalState(), interval_s=60.0).start()
    dead = {"dead": {"by": 1, "how": "its process ended"}, "n": 99}
    store().set(lv.record_key(2), json.dumps(dead))

    class Watch:  # what the control plane needs of the detector
        def __init__(self, pub):
            self.pub = pub

        def round_begins(self, *args):
            return self.pub.round_begins(*args)

        def round_ends(self, token):
            self.pub.round_ends(token)

    planes = []
    for r in (0, 1):
        cp = ControlPlane(store(), rank=r, world_size=3, timeout_s=20)
        pub = lv.Publisher(store(), r, lv.LocalState(), interval_s=0.05, heartbeat_s=HB)
        pub.start()
        cp.watch = Watch(pub)
        planes.append((cp, pub))
    out: dict[int, object] = {}

    def vote(i):
        try:
            out[i] = planes[i][0].all_gather("vote", {"F": 3})
        except FailStop as exc:
            out[i] = exc

    t0 = time.monotonic()
    threads = [threading.Thread(target=vote, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert time.monotonic() - t0 < 10
        for i in (0, 1):
            assert isinstance(out[i], FailStop) and out[i].cause == "dead-rank" and out[i].context["rank"] == 2
        blind = ControlPlane(store(), rank=0, world_size=3, timeout_s=0.5)
        with pytest.raises(Exception, match="no answer from rank"):
            blind.all_gather("other", 1)
    finally:
        for _cp, pub in planes:
            pub.close()


@pytest.mark.parametrize("lead_from", [1, 10**9], ids=["through-the-lead", "every-member-reads"])
def test_a_round_whose_lead_is_dead_ends_at_once_on_every_other_member(store, lead_from, monkeypatch):
    """The round's lead (rank 0, which gathers the values and posts the result) is dead and never joins; ranks 1
    and 2 wait for its result.  Their liveness threads watch the lead: both reads end with the fail-stop naming
    rank 0, long before the 20 s deadline.  (The store here is not rank 0's process, so its death alone would
    not end the round.)  Negative control: the same round, blind, runs into its deadline and names rank 0."""
    monkeypatch.setattr(ControlPlane, "LEAD_FROM", lead_from)
    for r in range(3):
        lv.Publisher(store(), r, lv.LocalState(), interval_s=60.0).start()
    store().set(lv.record_key(0), json.dumps({"dead": {"by": 1, "how": "its process ended"}, "n": 99}))

    class Watch:
        def __init__(self, pub):
            self.pub = pub

        def round_begins(self, *args):
            return self.pub.round_begins(*args)

        def round_ends(self, token):
            self.pub.round_ends(token)

    planes, pubs = {}, []
    for r in (1, 2):
        cp = ControlPlane(store(), rank=r, world_size=3, timeout_s=20)
        pub = lv.Publisher(store(), r, lv.LocalState(), interval_s=0.05, heartbeat_s=HB)
        pub.start()
        pubs.append(pub)
        cp.watch = Watch(pub)
        planes[r] = cp
    out: dict[int, object] = {}

    def vote(r):
        try:
            out[r] = planes[r].all_gather("vote", {"F": 3})
        except FailStop as exc:
            out[r] = exc

    t0 = time.monotonic()
    threads = [threading.Thread(target=vote, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert time.monotonic() - t0 < 10
        for r in (1, 2):
            assert isinstance(out[r], FailStop) and out[r].cause == "dead-rank" and out[r].context["rank"] == 0
        blind = ControlPlane(store(), rank=1, world_size=3, timeout_s=0.5)
        with pytest.raises(Exception, match=r"no answer from rank\(s\) \[0, 2\]"):
            blind.all_gather("other", 1)
    finally:
        for pub in pubs:
            pub.close()


def test_a_short_round_costs_the_liveness_thread_no_look_and_a_long_one_is_looked_at(store):
    """Every waiting rank's liveness thread looks at a round's missing members once it has lasted FIRST_LOOK_S
    (about five store requests per rank): a vote that ends sooner, the common case of a guarded update, is not
    looked at.  At 20 ms the looks cost ~3% of every guarded update on the development machine (``make bench``,
    part recovery, the detector on / off in one job).  That the rank waits in the round is still published after
    PUBLISH_S (one write: a member still inside a collective reads it and gives the collective up, "left").
    Negative control: with the old first look (20 ms) the short round below is looked at."""
    assert lv.FIRST_LOOK_S >= 0.1 and lv.PUBLISH_S <= 0.05
    other = lv.Publisher(store(), 1, lv.LocalState(), interval_s=60.0)  # the member the round waits for: its record
    other.start()
    pub = lv.Publisher(store(), 0, lv.LocalState(), interval_s=60.0, heartbeat_s=HB)
    pub.start()
    reader = lv.Observer(store())
    try:
        wait_until(lambda: pub.n >= 1, what="the first heartbeat")
        short = pub.round_begins("cp/g0", 0, "vote", 0, ["vote#0/0", "vote#0/1"], [0, 1])
        wait_until(lambda: ((reader.look([0])[0].record or {}).get("w") or [None])[0] == "c", timeout_s=5.0,
                   what="the record saying rank 0 waits in the round")
        threading.Event().wait(0.08)  # the round's own length (the stimulus): past the old first look, under this one
        pub.round_ends(short)
        assert short.published and short.looks == 0
        long = pub.round_begins("cp/g0", 0, "vote", 1, ["vote#1/0", "vote#1/1"], [0, 1])
        wait_until(lambda: long.looks >= 1, timeout_s=5.0, what="the look at a round that lasts")
        pub.round_ends(long)
    finally:
        pub.close()
        other.close()
