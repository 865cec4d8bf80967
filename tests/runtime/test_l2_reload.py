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
import os
import threading
import types

import pytest

from accelpact_slurm.runtime.state import replay
from accelpact_slurm.runtime.state.restore import (StateIO, agree, checker_ranks, make_offer, plan, reject_copy, reload,
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
    """``all_gather`` like :class:`accelpact_slurm.runtime.transport.control.ControlPlane`: JSON values, n-th call per
    name matches."""

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

    def __init__(self, bad_check=None, load_error=None, reject_error=None, share_error=None) -> None:
        self.node = N1  # this rank's node directory (set by :func:`run_ranks` from the offer's host)
        self.bad_check = bad_check or {}  # path -> reason
        self.load_error = load_error
        self.reject_error = reject_error
        self.share_error = share_error
        self.calls: list[tuple] = []

    def share(self, step, path):
        self.calls.append(("share", step, path))
        if self.share_error:
            return False, self.share_error, None
        return True, "copied", SH + str(step)

    def path_of(self, step, where):
        return (SH if where == "shared" else self.node) + str(step), "inside"

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
    """``verified``: {step: path}; the offer names each copy by its place, as :func:`make_offer` does."""
    return {"host": host, "verified": sorted([s, "shared" if p.startswith(SH) else "node"] for s, p in verified.items()),
            "other": sorted([list(o) for o in other])}


def two_nodes(n1, n2, o1=(), o2=()):
    """Ranks 0,1 on node1 and 2,3 on node2; ``n1``/``n2``: {step: path} each node reaches."""
    return [offer("node1", n1, o1)] * 2 + [offer("node2", n2, o2)] * 2


def run_ranks(offers, ios, check=True, allow_errors=False, copy=True):
    """Run :func:`reload` on one thread per rank; return (outcomes, hub)."""
    hub = Hub(len(offers))
    out: list = [None] * len(offers)
    for r, o in enumerate(offers):
        ios[r].node = N2 if o["host"] == "node2" else N1

    def body(r):
        try:
            out[r] = reload(r, offers[r], FakeControl(hub, r), ios[r], check=check, copy=copy, timeout_s=10)
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


def test_plan_orders_every_verified_step_and_names_the_ranks_that_lack_it():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6", 9: N1 + "9"}, {3: N2 + "3", 6: SH + "6"},
                       o2=[(9, "rejected", "re-check at restart failed")])
    order, lacking, why = plan(offers)
    assert order == [9, 6, 3] and lacking == {9: [2, 3], 6: [], 3: []}
    assert why == "3 verified step(s), newest 9 (lacking on node2: copied through the shared tier); newest on every rank 6"
    order, lacking, why = plan(two_nodes({4: N1 + "4"}, {8: N2 + "8"}))
    assert order == [8, 4] and lacking == {8: [0, 1], 4: [2, 3]} and "newest on every rank" not in why


@pytest.mark.parametrize("offers, reason", [
    ([], "no ranks"),
    (two_nodes({}, {}), "no verified snapshot on any rank"),
])
def test_plan_without_candidates(offers, reason):
    order, _lacking, why = plan(offers)
    assert order == [] and why == reason


def test_plan_names_at_most_four_lacking_hosts():
    offers = [offer("node0", {5: "/a"})] + [offer(f"node{i}", {}) for i in range(1, 7)]
    _order, lacking, why = plan(offers)
    assert lacking[5] == [1, 2, 3, 4, 5, 6] and "node1, node2, node3, node4 and 2 more host(s)" in why


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

FP = replay.FP_VERSION
REF = {"event": "replay_ref", "snapshot": 6, "step": 7, "loss": 2.25, "fingerprints": [FP + x for x in ("fa", "fb", "fc", "fd")],
       "layout": [2, 2]}


def test_judge_matches_loss_and_every_ranks_parameters_bitwise():
    verdict, why = replay.judge(REF, 2.25, REF["fingerprints"], [2, 2])
    assert verdict == "match" and why == "update 7 reproduced bitwise: loss 2.25, parameters of all 4 ranks"


def test_judge_a_loss_one_ulp_off_is_a_mismatch():
    verdict, why = replay.judge(REF, 2.2500000000000004, ["fa", "fb", "fc", "fd"], [2, 2])
    assert verdict == "mismatch"
    assert why == "replay mismatch at update 7: loss 2.2500000000000004, recorded 2.25"


def test_judge_a_fingerprint_mismatch_names_the_rank():
    verdict, why = replay.judge(REF, 2.25, [FP + x for x in ("fa", "fb", "XX", "fd")], [2, 2])
    assert verdict == "mismatch" and "rank(s) [2] differ from the recorded ones" in why
    assert why.startswith("replay mismatch at update 7")
    _, why = replay.judge(REF, None, [FP + x for x in ("fa", "XX", "fc", "XX")], [2, 2])  # no loss: parameters still checked
    assert "rank(s) [1, 3]" in why


def test_judge_on_another_layout_of_the_same_world_compares_the_loss_only():
    verdict, why = replay.judge(REF, 2.25, ["x", "y", "z", "w"], [4, 1])
    assert verdict == "match" and why == "update 7 reproduced bitwise: loss 2.25"
    assert replay.judge(REF, 2.5, ["fa", "fb", "fc", "fd"], [1, 4])[0] == "mismatch"
    verdict, why = replay.judge(dict(REF, loss=None), 2.25, ["fa", "fb", "fc", "fd"], [1, 4])
    assert verdict == "unconfirmed" and "no loss and ran on another layout" in why


def test_judge_on_another_world_size_is_unconfirmed_not_a_mismatch():
    """Resumed on 1 x 2 after 2 x 2: the update is another computation (another global batch); a loss that
    differs must not reject a good snapshot."""
    verdict, why = replay.judge(REF, 2.5, ["x", "y"], [1, 2])
    assert verdict == "unconfirmed" and "recorded with 4 ranks and ran again with 2" in why


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


def test_fingerprint_sees_a_swap_inside_a_chunk_and_a_change_past_the_first_chunk():
    import torch

    n = replay._CHUNK + 1000  # two chunks
    a = torch.nn.Linear(n, 1, bias=False)
    b = torch.nn.Linear(n, 1, bias=False)
    b.load_state_dict(a.state_dict())
    assert replay.fingerprint(a) == replay.fingerprint(b) and replay.fingerprint(a).startswith(replay.FP_VERSION)
    with torch.no_grad():
        b.weight[0, 3], b.weight[0, 7] = b.weight[0, 7].clone(), b.weight[0, 3].clone()  # same sum, other order
    assert replay.fingerprint(a) != replay.fingerprint(b)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b.weight[0, n - 1] = torch.nextafter(b.weight[0, n - 1], torch.tensor(1.0))
    assert replay.fingerprint(a) != replay.fingerprint(b)


def test_a_fingerprint_of_another_kind_is_not_compared():
    """A reference recorded by an earlier way of computing fingerprints: the loss still decides, never the fps."""
    ref = {"step": 11, "loss": 2.5, "layout": [2, 2], "fingerprints": ["abc"] * 4}
    verdict, why = replay.judge(ref, 2.5, [replay.FP_VERSION + "x"] * 4, [2, 2])
    assert verdict == "match" and "parameters" not in why
    assert replay.judge(dict(ref, loss=None), None, [replay.FP_VERSION + "x"] * 4, [2, 2])[0] == "unconfirmed"


# --------------------------------------------------------------------------- the agreement loop (fake control plane)


def test_newest_common_step_is_loaded_when_every_copy_checks_out():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6"}, {3: N2 + "3", 6: N2 + "6"})
    ios = [FakeIO() for _ in offers]
    out, hub = run_ranks(offers, ios)
    assert {(o.step, o.path) for o in out[:2]} == {(6, N1 + "6")} and {(o.step, o.path) for o in out[2:]} == \
        {(6, N2 + "6")}
    assert all(o.offered and o.copied is None for o in out) and out[0].skipped == []
    assert "newest snapshot verified on every node" in out[0].reason and "checksums re-read" in out[0].reason
    assert ios[0].calls == [("check", N1 + "6"), ("load", N1 + "6")]
    assert ios[2].calls == [("check", N2 + "6"), ("load", N2 + "6")]
    assert ios[1].calls == [("load", N1 + "6")]  # rank 1 shares rank 0's copy: no re-read
    assert ios[3].calls == [("load", N2 + "6")]
    assert hub.rounds == ["reload-offer", "reload-check", "reload-fit", "reload-load"]  # no copy round when every rank reaches the step
    assert rejects(ios) == []


def test_a_step_one_node_lacks_is_copied_once_checked_on_arrival_and_loaded_by_every_rank():
    """The node-loss path: node2's directory is gone; node1's rank 0 copies 9 to the shared tier, the copy
    is re-read, node2's ranks load it.  Negative control: ``copy=False`` (the old rule) falls back to 6."""
    offers = two_nodes({3: N1 + "3", 6: N1 + "6", 9: N1 + "9"}, {3: N2 + "3", 6: N2 + "6"})
    ios = [FakeIO() for _ in offers]
    out, hub = run_ranks(offers, ios)
    assert [(o.step, o.path) for o in out] == [(9, N1 + "9")] * 2 + [(9, SH + "9")] * 2
    assert [c for io in ios for c in io.calls if c[0] == "share"] == [("share", 9, N1 + "9")]
    assert ios[0].calls == [("share", 9, N1 + "9"), ("check", N1 + "9"), ("load", N1 + "9")]
    assert ios[2].calls == [("check", SH + "9"), ("load", SH + "9")]  # the arrival re-read
    assert hub.rounds == ["reload-offer", "reload-copy", "reload-check", "reload-fit", "reload-load"]
    assert out[3].copied == {"from": "node1", "to": SH + "9", "hosts": ["node2"], "why": "copied"}
    assert "verified on node1, copied to the shared tier for node2" in out[0].reason
    ios = [FakeIO() for _ in offers]
    out, hub = run_ranks(offers, ios, copy=False)
    assert [o.step for o in out] == [6] * 4 and "copying is disabled" in out[0].skipped[0]["reason"]


def test_a_failed_copy_moves_every_rank_to_the_next_candidate():
    offers = two_nodes({6: N1 + "6", 9: N1 + "9"}, {6: N2 + "6"})
    ios = [FakeIO(share_error="No space left on device") for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert [o.step for o in out] == [6] * 4 and out[2].copied is None
    assert out[0].skipped == [{"step": 9, "reason": "verified on node1 only, and the copy to the shared tier "
                                                    "failed: No space left on device"}]


def test_a_copy_that_fails_its_arrival_check_is_rejected_and_the_next_step_taken():
    offers = two_nodes({6: N1 + "6", 9: N1 + "9"}, {6: N2 + "6"})
    ios = [FakeIO(bad_check={SH + "9": "__0_0.distcp fails its SHA-256 checksum"}) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert [o.step for o in out] == [6] * 4
    assert rejects(ios) == [(2, 9, SH + "9", "re-check at restart failed: __0_0.distcp fails its SHA-256 checksum")]


def test_a_corrupt_copy_on_one_node_is_replaced_by_a_copy_of_the_other_nodes():
    """node1's 6 fails its re-check, node2's passes: node2's is copied to the shared tier for node1 (checked on
    arrival); nothing is loaded before every copy checked out, and 3 is never needed."""
    offers = two_nodes({3: N1 + "3", 6: N1 + "6"}, {3: N2 + "3", 6: N2 + "6"})
    bad = {N1 + "6": "__0_0.distcp fails its SHA-256 checksum (corrupted)"}
    ios = [FakeIO(bad_check=bad) for _ in offers]
    out, hub = run_ranks(offers, ios)
    assert [(o.step, o.path) for o in out] == [(6, SH + "6")] * 2 + [(6, N2 + "6")] * 2
    assert rejects(ios) == [(0, 6, N1 + "6", "re-check at restart failed: " + bad[N1 + "6"])]  # node2's copy is fine
    assert ios[2].calls == [("check", N2 + "6"), ("share", 6, N2 + "6"), ("load", N2 + "6")]
    assert ios[0].calls == [("check", N1 + "6"), ("reject", 6, N1 + "6", "re-check at restart failed: " + bad[N1 + "6"]),
                            ("check", SH + "6"), ("load", SH + "6")]
    assert hub.rounds == ["reload-offer", "reload-check", "reload-copy", "reload-check", "reload-fit", "reload-load"]
    assert out[0].copied["after"] == "re-check at restart failed: node1: " + bad[N1 + "6"]
    assert "copied to the shared tier for node1 (after re-check at restart failed" in out[0].reason
    ios = [FakeIO(bad_check=bad) for _ in offers]
    out, _ = run_ranks(offers, ios, copy=False)  # without copies: the previous step every rank reaches
    assert [o.step for o in out] == [3] * 4 and out[3].skipped == [
        {"step": 6, "reason": "re-check at restart failed: node1: " + bad[N1 + "6"]}]


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
    ios = [FakeIO(bad_check={N2 + "3": "manifest.json missing or unreadable", N1 + "3": "corrupted"}) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert all(o.step is None and o.path is None and o.offered for o in out)
    assert out[0].reason.startswith("every candidate was rejected (")
    assert out[0].skipped == [{"step": 3, "reason": "re-check at restart failed: node1: corrupted; node2: "
                                                    "manifest.json missing or unreadable"}]
    assert not [c for io in ios for c in io.calls if c[0] == "load"]
    assert rejects(ios) == [(0, 3, N1 + "3", "re-check at restart failed: corrupted"),
                            (2, 3, N2 + "3", "re-check at restart failed: manifest.json missing or unreadable")]


def test_nothing_to_reload_is_not_an_event():
    ios = [FakeIO() for _ in range(4)]
    out, hub = run_ranks(two_nodes({}, {}), ios)
    assert all(o.step is None and not o.offered and o.skipped == [] for o in out) and hub.rounds == ["reload-offer"]
    assert out[0].reason == "no verified snapshot on any rank" and all(io.calls == [] for io in ios)


def test_steps_verified_on_one_node_only_load_the_newest_through_a_copy():
    ios = [FakeIO() for _ in range(4)]
    out, hub = run_ranks(two_nodes({4: N1 + "4"}, {8: N2 + "8"}), ios)
    assert [(o.step, o.path) for o in out] == [(8, SH + "8")] * 2 + [(8, N2 + "8")] * 2
    assert hub.rounds == ["reload-offer", "reload-copy", "reload-check", "reload-fit", "reload-load"] and ios[2].calls[0] == ("share", 8, N2 + "8")


def test_check_disabled_loads_the_newest_common_step_unchecked():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6"}, {3: N2 + "3", 6: N2 + "6"})
    ios = [FakeIO(bad_check={N1 + "6": "corrupted"}) for _ in offers]
    out, hub = run_ranks(offers, ios, check=False)
    assert [o.step for o in out] == [6] * 4 and ios[0].calls == [("load", N1 + "6")]
    assert "without re-check" in out[0].reason and hub.rounds == ["reload-offer", "reload-fit", "reload-load"] and rejects(ios) == []


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
    assert got == {"host": "node1", "verified": [[3, "node"], [6, "shared"]], "other": [[9, "rejected", "bit flip"]]}
    assert p3.startswith(str(ndir)) and p6.startswith(str(sdir))


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


def test_state_io_share_copies_atomically_records_the_copy_and_replaces_a_rejected_one(tmp_path):
    run = tmp_path / "run"
    ndir, sdir = run / "node-local" / "node1", run / "shared-ckpt"
    path = _snapshot(ndir, 6, payload=b"metadata bytes")
    old = _snapshot(sdir, 6, payload=b"stale bytes")
    record_state(old, "rejected", "bit flip")
    events = Events()
    io = StateIO(lambda p: None, str(run), str(ndir), "node1", 0, events, str(sdir))
    ok, why, dst = io.share(6, path)
    assert ok and dst == str(sdir / step_dirname(6)) and why.endswith(" s")
    assert (sdir / step_dirname(6) / ".metadata").read_bytes() == b"metadata bytes"
    assert io.check(dst) == (True, "1 file(s) match their checksums")  # the arrival re-read
    rec = read_record(dst)
    assert rec.state == "verified" and "copied at restart from node1's verified copy" in rec.reason
    assert sorted(os.listdir(sdir)) == [step_dirname(6)]  # no temporary or moved-aside directory left
    assert [e["event"] for e in events.records] == ["checkpoint_copy"] and events.records[0]["step"] == 6


def test_state_io_share_says_why_a_copy_failed(tmp_path):
    run = tmp_path / "run"
    ndir = run / "node-local" / "node1"
    path = _snapshot(ndir, 6, payload=b"x")
    blocker = tmp_path / "file-in-the-way"
    blocker.write_text("")
    ok, why, dst = StateIO(lambda p: None, str(run), str(ndir), "node1", 0, None, str(blocker / "shared")).share(6, path)
    assert not ok and dst is None and why.startswith(f"cannot copy {path} to {blocker / 'shared'}: ")


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
        [[3, "node"]]  # never offered again


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
