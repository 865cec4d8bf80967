"""L2 reload: offer, re-check, agree, load; the replay check on the first update after a load; reject and fall back.

Three layers:

- pure decisions (:func:`plan`, :func:`agree`, :func:`checker_ranks`, :func:`same_bits`,
  :func:`replay.judge`, :func:`replay.find_reference`) and the agreement loop :func:`reload` against a
  fake control plane (threads, one per rank, every wait with a deadline);
- the files: offers, the rejection record (state beside the data, event, index), the collective entry
  :func:`restore` on one rank, the publish race;
- end to end, real ranks and daemons on the embedded default (``examples/decoder/job.yaml`` shortened to
  12 updates, a snapshot every 5): a baseline; the newest snapshot corrupted between starts (and its
  negative control without the re-check); a consistent corruption only the replay check sees; an L2
  restart that must resume bitwise (and its negative control without the extra state).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import types

import pytest

from accelpact_slurm.runtime import replay
from accelpact_slurm.runtime.restore import (StateIO, agree, checker_ranks, make_offer, plan, reject_copy, reload,
                                             restore, same_bits, settle_pending)
from ckpt_service.auth import load_or_create_key, sign
from ckpt_service.index import publish_index, read_record, record_state, scan
from ckpt_service.layout import step_dirname

# --------------------------------------------------------------------------- fakes


class Hub:
    """The store behind the fake control planes of ``n`` ranks."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cv = threading.Condition()
        self.values: dict[tuple[str, int], dict[int, object]] = {}
        self.rounds: list[str] = []


class FakeControl:
    """``all_gather`` like :class:`accelpact_slurm.runtime.control.ControlPlane`: JSON values, n-th call per name
    matches."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.seq = hub, rank, {}

    def all_gather(self, name, value, ranks=None, timeout_s=None):
        n = self.seq.get(name, 0)
        self.seq[name] = n + 1
        key = (name, n)
        hub = self.hub
        with hub.cv:
            if key not in hub.values:
                hub.rounds.append(name)
            hub.values.setdefault(key, {})[self.rank] = json.loads(json.dumps(value))
            hub.cv.notify_all()
            if not hub.cv.wait_for(lambda: len(hub.values[key]) == hub.n, timeout=10):
                raise TimeoutError(f"{name}#{n}: only {sorted(hub.values[key])} answered")
            return [hub.values[key][r] for r in range(hub.n)]


class FakeIO:
    """One rank's files and state: scripted check answers, every call recorded."""

    def __init__(self, bad_check=None, load_error=None, reject_error=None) -> None:
        self.bad_check = bad_check or {}  # path -> reason
        self.load_error = load_error
        self.reject_error = reject_error
        self.calls: list[tuple] = []

    def check(self, path):
        self.calls.append(("check", path))
        why = self.bad_check.get(path)
        return (False, why) if why else (True, "ok")

    def load(self, path):
        self.calls.append(("load", path))
        if self.load_error is not None:
            raise self.load_error

    def reject(self, step, path, reason):
        self.calls.append(("reject", step, path, reason))
        if self.reject_error is not None:
            raise self.reject_error


def offer(host, verified, other=()):
    return {"host": host, "verified": sorted([s, p] for s, p in verified.items()),
            "other": sorted([list(o) for o in other])}


def two_nodes(n1, n2, o1=(), o2=()):
    """Ranks 0,1 on node1 and 2,3 on node2; ``n1``/``n2``: {step: path} each node reaches."""
    return [offer("node1", n1, o1)] * 2 + [offer("node2", n2, o2)] * 2


def run_ranks(offers, ios, check=True, allow_errors=False):
    """Run :func:`reload` on one thread per rank; return (outcomes, hub)."""
    hub = Hub(len(offers))
    out: list = [None] * len(offers)

    def body(r):
        try:
            out[r] = reload(r, offers[r], FakeControl(hub, r), ios[r], check=check, timeout_s=10)
        except BaseException as exc:  # surfaced by the assertion below
            out[r] = exc

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}") for r in range(len(offers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank is stuck"
    if not allow_errors:
        assert not any(isinstance(o, BaseException) for o in out), out
    return out, hub


def rejects(ios):
    """``[(rank, step, path, reason)]`` of every recorded rejection."""
    return [(r, *c[1:]) for r, io in enumerate(ios) for c in io.calls if c[0] == "reject"]


N1 = "/n1/step-"  # path prefixes of the two nodes' copies and the shared tier
N2 = "/n2/step-"
SH = "/shared/step-"

# --------------------------------------------------------------------------- pure decisions


def test_plan_orders_common_steps_and_says_why_others_are_not_candidates():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6", 9: N1 + "9"}, {3: N2 + "3", 6: SH + "6"},
                       o2=[(9, "rejected", "replay check failed: replay mismatch at update 10")])
    order, unusable, why = plan(offers)
    assert order == [6, 3] and "newest 6" in why
    assert unusable == {9: "verified on node1 only; node2: rejected (replay check failed: replay mismatch at "
                           "update 10)"}
    order, unusable, _ = plan(two_nodes({3: N1 + "3", 12: N1 + "12"}, {3: N2 + "3"}))
    assert order == [3] and unusable == {12: "verified on node1 only; node2: absent"}


@pytest.mark.parametrize("offers, reason", [
    ([], "no ranks"),
    (two_nodes({}, {}), "no verified snapshot on any rank"),
    (two_nodes({4: N1 + "4"}, {8: N2 + "8"}), "none of the verified step(s) [4, 8] is reachable on every rank"),
])
def test_plan_without_candidates(offers, reason):
    order, _unusable, why = plan(offers)
    assert order == [] and why == reason


def test_plan_names_at_most_four_lacking_hosts():
    offers = [offer("node0", {5: "/a"})] + [offer(f"node{i}", {}) for i in range(1, 7)]
    _order, unusable, _ = plan(offers)
    assert unusable[5].count(": absent") == 4 and unusable[5].endswith("and 2 more host(s)")


def test_agree_combines_answers_and_names_the_failing_hosts():
    hosts = ["node1", "node1", "node2", "node2"]
    assert agree([[True, "ok", "/a"], None, [True, "ok", "/b"], None], hosts) == (True, "2 answer(s), all pass", [])
    ok, why, bad = agree([[False, "x.distcp fails its SHA-256 checksum", "/a"], None, [True, "ok", "/b"], None], hosts)
    assert not ok and why == "node1: x.distcp fails its SHA-256 checksum" and bad == [(0, "/a", bad[0][2])]
    ok, why, bad = agree([[False, "m", "/a"], [False, "m", "/a"], [True, "", "/b"], [True, "", "/b"]], hosts)
    assert why == "node1: m" and [b[0] for b in bad] == [0, 1]  # one line per host and reason


def test_one_checker_per_copy_and_bitwise_loss_equality():
    assert checker_ranks(["/n1/6", "/n1/6", "/sh/6", "/sh/6", "/n3/6"]) == {"/n1/6": 0, "/sh/6": 2, "/n3/6": 4}
    assert same_bits(1.25, 1.25) and not same_bits(1.25, 1.2500000000000002)
    assert not same_bits(0.0, -0.0) and not same_bits(float("nan"), float("nan")) and not same_bits(1.0, None)


# --------------------------------------------------------------------------- the replay check (pure)

REF = {"event": "replay_ref", "snapshot": 6, "step": 7, "loss": 2.25, "fingerprints": ["fa", "fb", "fc", "fd"],
       "layout": [2, 2]}


def test_judge_matches_loss_and_every_ranks_parameters_bitwise():
    verdict, why = replay.judge(REF, 2.25, ["fa", "fb", "fc", "fd"], [2, 2])
    assert verdict == "match" and why == "update 7 reproduced bitwise: loss 2.25, parameters of all 4 ranks"


def test_judge_a_loss_one_ulp_off_is_a_mismatch():
    verdict, why = replay.judge(REF, 2.2500000000000004, ["fa", "fb", "fc", "fd"], [2, 2])
    assert verdict == "mismatch"
    assert why == "replay mismatch at update 7: loss 2.2500000000000004, recorded 2.25"


def test_judge_a_fingerprint_mismatch_names_the_rank():
    verdict, why = replay.judge(REF, 2.25, ["fa", "fb", "XX", "fd"], [2, 2])
    assert verdict == "mismatch" and "rank(s) [2] differ from the recorded ones" in why
    assert why.startswith("replay mismatch at update 7")
    _, why = replay.judge(REF, None, ["fa", "XX", "fc", "XX"], [2, 2])  # no loss reported: parameters still checked
    assert "rank(s) [1, 3]" in why


def test_judge_on_another_layout_compares_the_loss_only():
    verdict, why = replay.judge(REF, 2.25, ["x", "y", "z", "w", "v", "u"], [3, 2])
    assert verdict == "match" and why == "update 7 reproduced bitwise: loss 2.25"
    assert replay.judge(REF, 2.5, ["fa", "fb", "fc", "fd"], [1, 4])[0] == "mismatch"
    verdict, why = replay.judge(dict(REF, loss=None), 2.25, ["fa", "fb", "fc", "fd"], [1, 4])
    assert verdict == "unconfirmed" and "no loss and ran on another layout" in why


def test_judge_without_a_reference_is_unconfirmed():
    verdict, why = replay.judge(None, 2.25, ["fa"], [1, 1])
    assert verdict == "unconfirmed" and "last thing the run did" in why


def test_find_reference_takes_the_newest_record_of_that_snapshot():
    events = [dict(REF, loss=1.0), {"event": "replay_check", "snapshot": 6}, dict(REF, snapshot=3, loss=9.0),
              {"event": "step", "step": 7}, dict(REF, loss=2.0)]
    assert replay.find_reference(events, 6)["loss"] == 2.0
    assert replay.find_reference(events, 3)["loss"] == 9.0
    assert replay.find_reference(events, 9) is None and replay.find_reference([], 6) is None


def test_fingerprint_is_exact_for_the_same_bits():
    import torch

    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3)
    b = torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    assert replay.fingerprint(a) == replay.fingerprint(b)
    with torch.no_grad():
        b.weight[1, 2] = torch.nextafter(b.weight[1, 2], torch.tensor(1.0))  # one ulp
    assert replay.fingerprint(a) != replay.fingerprint(b)


# --------------------------------------------------------------------------- the agreement loop (fake control plane)


def test_newest_common_step_is_loaded_when_every_copy_checks_out():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6", 9: N1 + "9"}, {3: N2 + "3", 6: N2 + "6"})
    ios = [FakeIO() for _ in offers]
    out, hub = run_ranks(offers, ios)
    assert {(o.step, o.path) for o in out[:2]} == {(6, N1 + "6")} and {(o.step, o.path) for o in out[2:]} == \
        {(6, N2 + "6")}
    assert all(o.offered for o in out)
    assert out[0].skipped == [{"step": 9, "reason": "verified on node1 only; node2: absent"}]
    assert "newest snapshot verified on every node" in out[0].reason and "checksums re-read" in out[0].reason
    assert ios[0].calls == [("check", N1 + "6"), ("load", N1 + "6")]
    assert ios[2].calls == [("check", N2 + "6"), ("load", N2 + "6")]
    assert ios[1].calls == [("load", N1 + "6")]  # rank 1 shares rank 0's copy: no re-read
    assert ios[3].calls == [("load", N2 + "6")]
    assert hub.rounds == ["reload-offer", "reload-check"]  # no replay round any more
    assert rejects(ios) == []


def test_a_corrupt_copy_on_one_node_moves_every_rank_to_the_previous_step():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6"}, {3: N2 + "3", 6: N2 + "6"})
    bad = {N1 + "6": "__0_0.distcp fails its SHA-256 checksum (corrupted)"}
    ios = [FakeIO(bad_check=bad) for _ in offers]
    out, hub = run_ranks(offers, ios)
    assert [o.step for o in out] == [3, 3, 3, 3] and [o.path for o in out] == [N1 + "3"] * 2 + [N2 + "3"] * 2
    assert out[3].skipped == [{"step": 6, "reason": "re-check at restart failed: node1: __0_0.distcp fails its "
                                                    "SHA-256 checksum (corrupted)"}]
    assert rejects(ios) == [(0, 6, N1 + "6", "re-check at restart failed: " + bad[N1 + "6"])]  # node2's copy is fine
    assert all(c[0] != "load" or c[1].endswith("-3") for io in ios for c in io.calls)  # nothing loaded before checks
    assert ios[2].calls == [("check", N2 + "6"), ("check", N2 + "3"), ("load", N2 + "3")]
    assert hub.rounds == ["reload-offer", "reload-check", "reload-check"]


def test_a_shared_copy_is_checked_and_rejected_once_for_every_rank_that_reaches_it():
    offers = two_nodes({3: N1 + "3", 6: SH + "6"}, {3: N2 + "3", 6: SH + "6"})
    ios = [FakeIO(bad_check={SH + "6": "manifest lists no .metadata"}) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert [o.step for o in out] == [3] * 4
    assert [c for io in ios for c in io.calls if c[0] == "check" and c[1] == SH + "6"] == [("check", SH + "6")]
    assert rejects(ios) == [(0, 6, SH + "6", "re-check at restart failed: manifest lists no .metadata")]
    assert out[2].skipped == [{"step": 6, "reason": "re-check at restart failed: node1: manifest lists no .metadata"}]


def test_a_rejection_that_cannot_be_written_still_moves_on():
    offers = two_nodes({3: N1 + "3", 6: SH + "6"}, {3: N2 + "3", 6: SH + "6"})
    ios = [FakeIO(bad_check={SH + "6": "corrupted"}, reject_error=PermissionError("read-only")) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert [o.step for o in out] == [3] * 4 and len(rejects(ios)) == 1


def test_every_candidate_rejected_before_loading_starts_fresh():
    offers = two_nodes({3: N1 + "3"}, {3: N2 + "3"})
    ios = [FakeIO(bad_check={N2 + "3": "manifest.json missing or unreadable"}) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert all(o.step is None and o.path is None and o.offered for o in out)
    assert out[0].reason.startswith("every candidate was rejected (")
    assert out[0].skipped == [{"step": 3, "reason": "re-check at restart failed: node2: manifest.json missing or "
                                                    "unreadable"}]
    assert not [c for io in ios for c in io.calls if c[0] == "load"]
    assert rejects(ios) == [(2, 3, N2 + "3", "re-check at restart failed: manifest.json missing or unreadable")]


def test_nothing_to_reload_is_not_an_event():
    ios = [FakeIO() for _ in range(4)]
    out, hub = run_ranks(two_nodes({}, {}), ios)
    assert all(o.step is None and not o.offered and o.skipped == [] for o in out) and hub.rounds == ["reload-offer"]
    assert out[0].reason == "no verified snapshot on any rank" and all(io.calls == [] for io in ios)


def test_steps_verified_on_one_node_only_are_offered_but_not_loaded():
    ios = [FakeIO() for _ in range(4)]
    out, hub = run_ranks(two_nodes({4: N1 + "4"}, {8: N2 + "8"}), ios)
    assert all(o.step is None and o.offered for o in out) and hub.rounds == ["reload-offer"]
    assert [s["step"] for s in out[0].skipped] == [8, 4] and all(io.calls == [] for io in ios)


def test_check_disabled_loads_the_newest_common_step_unchecked():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6"}, {3: N2 + "3", 6: N2 + "6"})
    ios = [FakeIO(bad_check={N1 + "6": "corrupted"}) for _ in offers]
    out, hub = run_ranks(offers, ios, check=False)
    assert [o.step for o in out] == [6] * 4 and ios[0].calls == [("load", N1 + "6")]
    assert "without re-check" in out[0].reason and hub.rounds == ["reload-offer"] and rejects(ios) == []


def test_a_load_that_raises_after_the_check_is_not_a_rejection():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6"}, {3: N2 + "3", 6: N2 + "6"})
    ios = [FakeIO(load_error=RuntimeError("gloo: connection reset")) for _ in offers]
    out, _ = run_ranks(offers, ios, allow_errors=True)
    assert all(isinstance(o, RuntimeError) for o in out)
    assert rejects(ios) == [] and ios[0].calls == [("check", N1 + "6"), ("load", N1 + "6")]  # no retry of 3 either


# --------------------------------------------------------------------------- files, index, the collective entry


class Events:
    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": event, **fields})


def _snapshot(ndir, step, state="verified", payload=None):
    """A snapshot directory; with ``payload`` a ``.metadata`` file whose checksum the manifest holds."""
    d = ndir / step_dirname(step)
    d.mkdir(parents=True)
    files = {}
    if payload is not None:
        (d / ".metadata").write_bytes(payload)
        files[".metadata"] = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    key = load_or_create_key(str(ndir.parent.parent))  # the run directory's key signs the manifest
    (d / "manifest.json").write_text(json.dumps(sign({"step": step, "files": files}, key)))
    record_state(str(d), state)
    return str(d)


def _fake_rt(rank=0, world=1, host="node1"):
    cfg = types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(local_dir=None, shared_dir=None, milestone_every=0),
        timeouts=types.SimpleNamespace(control_s=5.0, startup_s=5.0))
    rt = types.SimpleNamespace(rank=rank, ctx=types.SimpleNamespace(hostname=host),
                               control=FakeControl(Hub(world), rank))
    return rt, cfg


def test_make_offer_reports_verified_copies_and_the_state_of_the_others(tmp_path):
    ndir, sdir = tmp_path / "node", tmp_path / "shared"
    p3 = _snapshot(ndir, 3)
    _snapshot(ndir, 6, "committed")
    p6 = _snapshot(sdir, 6)
    _snapshot(ndir, 9)
    record_state(str(ndir / step_dirname(9)), "rejected", "bit flip")
    got = make_offer("node1", str(ndir), str(sdir))
    assert got == {"host": "node1", "verified": [[3, p3], [6, p6]], "other": [[9, "rejected", "bit flip"]]}


def test_state_io_checks_the_copy_on_disk(tmp_path):
    ndir = tmp_path / "run" / "node-local" / "node1"
    path = _snapshot(ndir, 6, payload=b"metadata bytes")
    io = StateIO(lambda p: None, str(tmp_path / "run"), str(ndir), "node1", 0)
    assert io.check(path) == (True, "1 file(s) match their checksums")
    (ndir / step_dirname(6) / ".metadata").write_bytes(b"metadata bytez")
    assert io.check(path) == (False, ".metadata fails its SHA-256 checksum (corrupted)")
    loaded = []
    StateIO(loaded.append, str(tmp_path), str(ndir), "node1", 0).load(path)
    assert loaded == [path]


def test_reject_records_state_beside_the_data_event_and_index(tmp_path):
    run_dir = tmp_path / "run"
    ndir = run_dir / "node-local" / "node1"
    path = _snapshot(ndir, 6)
    _snapshot(ndir, 3)
    events = Events()
    io = StateIO(lambda p: None, str(run_dir), str(ndir), "node1", 0, events)
    io.reject(6, path, "re-check at restart failed: __0_0.distcp fails its SHA-256 checksum (corrupted)")
    rec = read_record(path)
    assert rec.state == "rejected" and "SHA-256" in rec.reason
    assert [h["state"] for h in json.loads((ndir / step_dirname(6) / "state.json").read_text())["history"]] == \
        ["verified", "rejected"]
    idx = json.loads((run_dir / "ckpt-index" / "node1.json").read_text())
    assert [(s["step"], s["state"]) for s in idx["snapshots"]] == [(3, "verified"), (6, "rejected")]
    (ev,) = events.records
    assert (ev["event"], ev["step"], ev["state"], ev["source"], ev["hostname"], ev["path"]) == \
        ("checkpoint", 6, "rejected", "restore", "node1", path)
    assert "SHA-256" in ev["reason"] and ev["size_bytes"] > 0
    assert make_offer("node1", str(ndir), str(run_dir / "shared-ckpt"))["verified"] == \
        [[3, str(ndir / step_dirname(3))]]  # never offered again


def test_reject_copy_of_the_replay_check_in_the_shared_tier(tmp_path):
    run_dir = tmp_path / "run"
    ndir = run_dir / "node-local" / "node2"
    path = _snapshot(run_dir / "shared-ckpt", 6)
    events = Events()
    reject_copy(6, path, "replay check failed: replay mismatch at update 7", str(run_dir), str(ndir), "node2", 0,
                events, source="replay")
    assert read_record(path).state == "rejected"
    (ev,) = events.records
    assert (ev["state"], ev["source"], ev["hostname"]) == ("rejected", "replay", "node2")
    assert not (run_dir / "ckpt-index").exists()  # a shared copy belongs to no node's index


def test_restore_loads_the_newest_copy_that_checks_out_and_says_so(tmp_path):
    ndir = tmp_path / "node-local" / "node1"
    p3 = _snapshot(ndir, 3, payload=b"three")
    p6 = _snapshot(ndir, 6, payload=b"six")
    (ndir / step_dirname(6) / ".metadata").write_bytes(b"siX")  # corrupted after it was verified
    rt, cfg = _fake_rt()
    events, loaded = Events(), []
    out = restore(rt, cfg, str(tmp_path), loaded.append, events)
    assert (out.step, out.path, loaded) == (3, p3, [p3])
    rej, load = events.records
    assert (rej["event"], rej["step"], rej["source"], rej["path"]) == ("checkpoint", 6, "restore", p6)
    assert read_record(p6).state == "rejected"
    assert (load["event"], load["step"], load["path"], load["checked"]) == ("restart_load", 3, p3, True)
    assert load["skipped"] == [{"step": 6, "reason": "re-check at restart failed: node1: .metadata fails its SHA-256 "
                                                     "checksum (corrupted)"}]


def test_restore_with_every_candidate_rejected_starts_fresh_and_says_why(tmp_path):
    _snapshot(tmp_path / "node-local" / "node1", 6)  # a manifest without .metadata
    rt, cfg = _fake_rt()
    events, loaded = Events(), []
    out = restore(rt, cfg, str(tmp_path), loaded.append, events)
    assert out.step is None and out.offered and loaded == []
    load = events.records[-1]
    assert load["event"] == "restart_load" and load["step"] is None and load["skipped"][0]["step"] == 6


def test_restore_unchecked_loads_the_corrupted_copy(tmp_path):
    ndir = tmp_path / "node-local" / "node1"
    _snapshot(ndir, 3, payload=b"three")
    p6 = _snapshot(ndir, 6, payload=b"six")
    (ndir / step_dirname(6) / ".metadata").write_bytes(b"siX")
    rt, cfg = _fake_rt()
    events, loaded = Events(), []
    assert restore(rt, cfg, str(tmp_path), loaded.append, events, check=False).step == 6 and loaded == [p6]
    (load,) = events.records
    assert load["checked"] is False and load["skipped"] == [] and read_record(p6).state == "verified"


def test_restore_writes_no_event_without_snapshots(tmp_path):
    rt, cfg = _fake_rt()
    events = Events()
    out = restore(rt, cfg, str(tmp_path), lambda p: None, events)
    assert (out.step, out.reason, out.offered) == (None, "no verified snapshot on any rank", False)
    assert events.records == []


def test_settle_pending_waits_for_a_newer_committed_snapshot_bounded(tmp_path):
    ndir = tmp_path / "node"
    _snapshot(ndir, 3)
    p6 = _snapshot(ndir, 6, "committed")
    assert settle_pending(str(ndir), 0.2, poll_s=0.05) == [6]  # the deadline: not a candidate, no hang
    timer = threading.Timer(0.2, record_state, args=(p6, "verified"))
    timer.start()
    try:
        assert settle_pending(str(ndir), 10, poll_s=0.05) == []
    finally:
        timer.join()
    _snapshot(ndir, 2, "committed")  # older than the newest verified: nothing to wait for
    assert settle_pending(str(ndir), 10, poll_s=0.05) == []


def test_a_publish_from_an_older_scan_cannot_undo_a_rejection(tmp_path):
    """The daemon scans, the restorer rejects and publishes, the daemon publishes its older scan last."""
    ndir = tmp_path / "node"
    path = _snapshot(ndir, 6)
    stale = scan(str(ndir))
    reject_copy(6, path, "bit flip", str(tmp_path), str(ndir), "node1", 0)
    publish_index(str(tmp_path), "node1", stale)
    idx = json.loads((tmp_path / "ckpt-index" / "node1.json").read_text())
    assert [(s["state"], s["reason"]) for s in idx["snapshots"]] == [("rejected", "bit flip")]
    fake = dataclasses.replace(stale[0], path=str(tmp_path / "gone"))
    publish_index(str(tmp_path), "node1", [fake])  # a record of no directory is published as given
    assert json.loads((tmp_path / "ckpt-index" / "node1.json").read_text())["snapshots"][0]["state"] == "verified"
