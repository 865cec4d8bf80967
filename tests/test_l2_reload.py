"""L2 reload: re-check, agree, load, replay-check, reject and fall back to the previous verified snapshot.

Pure decisions and the agreement loop run against a fake control plane (threads, one per rank, every
wait with a deadline); the end-to-end case runs real ranks and daemons on the embedded default: the run
directory a job leaves when it is requeued after snapshot 6 was verified, snapshot 6 corrupted on one node,
then restarted; and its negative control (the same corruption with the reload check disabled).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import types

import pytest

from accelpact_slurm.core.errors import EXIT_REQUEUE, FailStop
from accelpact_slurm.runtime.restore import (TrainerIO, agree, checker_ranks, make_offer, plan, reload, restore_trainer,
                                     same_bits)
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
    """``all_gather`` like :class:`accelpact_slurm.runtime.control.ControlPlane`: JSON values, n-th call per name matches."""

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
    """One rank's files and trainer: scripted check and replay answers, every call recorded."""

    def __init__(self, bad_check=None, replay=None) -> None:
        self.bad_check = bad_check or {}  # path -> reason
        self.replay_answers = replay or {}  # path -> (got, recorded)
        self.calls: list[tuple] = []

    def check(self, path):
        self.calls.append(("check", path))
        why = self.bad_check.get(path)
        return (False, why) if why else (True, "ok")

    def load(self, path):
        self.calls.append(("load", path))

    def replay(self, path):
        self.calls.append(("replay", path))
        return self.replay_answers.get(path, (1.5, 1.5))

    def reject(self, step, path, reason):
        self.calls.append(("reject", step, path, reason))


def offer(host, verified, other=()):
    return {"host": host, "verified": sorted([s, p] for s, p in verified.items()),
            "other": sorted([list(o) for o in other])}


def two_nodes(n1, n2, o1=(), o2=()):
    """Ranks 0,1 on node1 and 2,3 on node2; ``n1``/``n2``: {step: path} each node reaches."""
    return [offer("node1", n1, o1)] * 2 + [offer("node2", n2, o2)] * 2


def run_ranks(offers, ios, check=True):
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
    assert not any(isinstance(o, BaseException) for o in out), out
    return out, hub


N1 = "/n1/step-"  # path prefixes of the two nodes' copies and the shared tier
N2 = "/n2/step-"
SH = "/shared/step-"

# --------------------------------------------------------------------------- pure decisions


def test_plan_orders_common_steps_and_says_why_others_are_not_candidates():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6", 9: N1 + "9"}, {3: N2 + "3", 6: SH + "6"},
                       o2=[(9, "rejected", "replay loss 1.0 differs from the recorded 2.0")])
    order, unusable, why = plan(offers)
    assert order == [6, 3] and "newest 6" in why
    assert unusable == {9: "verified on node1 only; node2: rejected (replay loss 1.0 differs from the recorded 2.0)"}
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


# --------------------------------------------------------------------------- the agreement loop (fake control plane)


def test_newest_common_step_is_loaded_when_every_copy_checks_out():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6", 9: N1 + "9"}, {3: N2 + "3", 6: N2 + "6"})
    ios = [FakeIO() for _ in offers]
    out, hub = run_ranks(offers, ios)
    assert {(o.step, o.path) for o in out[:2]} == {(6, N1 + "6")} and out[2].path == N2 + "6"
    assert out[0].skipped == [{"step": 9, "reason": "verified on node1 only; node2: absent"}]
    assert "newest snapshot verified on every node" in out[0].reason and "matched bitwise" in out[0].reason
    assert [c for c in ios[0].calls if c[0] == "check"] == [("check", N1 + "6")]
    assert ios[1].calls == [("load", N1 + "6"), ("replay", N1 + "6")]  # rank 1 shares rank 0's copy: no re-read
    assert hub.rounds == ["reload-offer", "reload-check", "reload-replay"]


def test_a_corrupt_copy_on_one_node_moves_every_rank_to_the_previous_step():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6"}, {3: N2 + "3", 6: N2 + "6"})
    bad = {N1 + "6": "__0_0.distcp fails its SHA-256 checksum (corrupted)"}
    ios = [FakeIO(bad_check=bad) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert [o.step for o in out] == [3, 3, 3, 3] and not any(o.dirty for o in out)
    assert out[3].skipped == [{"step": 6, "reason": "re-check at restart failed: node1: __0_0.distcp fails its "
                                                    "SHA-256 checksum (corrupted)"}]
    rejects = [(r, c) for r, io in enumerate(ios) for c in io.calls if c[0] == "reject"]
    assert rejects == [(0, ("reject", 6, N1 + "6", "re-check at restart failed: " + bad[N1 + "6"]))]
    assert all(("load", p + "6") not in io.calls for io in ios for p in (N1, N2))  # nothing loaded before the check


def test_a_replay_mismatch_rejects_that_copy_and_loads_the_previous_one_over_it():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6"}, {3: N2 + "3", 6: SH + "6"})
    ios = [FakeIO(replay={SH + "6": (2.5, 2.25)}) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert [o.step for o in out] == [3, 3, 3, 3]
    assert out[0].skipped == [{"step": 6, "reason": "node2: replay mismatch: recorded 2.25, got 2.5"}]
    assert [c for c in ios[2].calls if c[0] in ("load", "reject")] == [
        ("load", SH + "6"), ("reject", 6, SH + "6", "replay mismatch: recorded 2.25, got 2.5"), ("load", N2 + "3")]
    assert not [c for io in (ios[0], ios[1], ios[3]) for c in io.calls if c[0] == "reject"]


def test_a_replay_mismatch_with_nothing_older_leaves_a_dirty_trainer():
    offers = two_nodes({6: N1 + "6"}, {6: N2 + "6"})
    ios = [FakeIO(replay={N1 + "6": (2.5, 2.25), N2 + "6": (2.5, 2.25)}) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert all(o.step is None and o.dirty and o.offered for o in out)
    assert "restart from scratch on the next start" in out[0].reason
    assert [c[2] for io in ios for c in io.calls if c[0] == "reject"] == [N1 + "6", N2 + "6"]  # ranks 0 and 2


def test_every_candidate_rejected_before_loading_starts_fresh():
    offers = two_nodes({3: N1 + "3"}, {3: N2 + "3"})
    ios = [FakeIO(bad_check={N2 + "3": "manifest.json missing or unreadable"}) for _ in offers]
    out, _ = run_ranks(offers, ios)
    assert all(o.step is None and not o.dirty and o.offered for o in out)
    assert out[0].skipped == [{"step": 3, "reason": "re-check at restart failed: node2: manifest.json missing or "
                                                    "unreadable"}]


def test_nothing_to_reload_is_not_an_event():
    out, hub = run_ranks(two_nodes({}, {}), [FakeIO() for _ in range(4)])
    assert all(o.step is None and not o.offered and o.skipped == [] for o in out) and hub.rounds == ["reload-offer"]


def test_check_disabled_loads_the_newest_common_step_unchecked():
    offers = two_nodes({3: N1 + "3", 6: N1 + "6"}, {3: N2 + "3", 6: N2 + "6"})
    ios = [FakeIO(bad_check={N1 + "6": "corrupted"}) for _ in offers]
    out, _ = run_ranks(offers, ios, check=False)
    assert [o.step for o in out] == [6] * 4 and ios[0].calls == [("load", N1 + "6")]


# --------------------------------------------------------------------------- restore_trainer, files, index


def _fake_trainer(rank=0, world=1):
    cfg = types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(local_dir=None, shared_dir=None, milestone_every=0),
        timeouts=types.SimpleNamespace(control_s=5.0, startup_s=5.0))
    hub = Hub(world)
    rt = types.SimpleNamespace(rank=rank, ctx=types.SimpleNamespace(hostname="node1"), control=FakeControl(hub, rank))
    return types.SimpleNamespace(cfg=cfg, rt=rt)


class Events:
    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": event, **fields})


def _snapshot(ndir, step, state="verified"):
    d = ndir / step_dirname(step)
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"step": step, "files": {}}))
    record_state(str(d), state)
    return str(d)


class MismatchIO(FakeIO):
    def replay(self, path):
        return 1.0, 2.0


def test_restore_trainer_fails_stop_for_a_requeue_when_the_trainer_is_dirty(tmp_path, monkeypatch):
    import accelpact_slurm.runtime.restore as restore

    _snapshot(tmp_path / "node-local" / "node1", 6)
    monkeypatch.setattr(restore, "TrainerIO", lambda *a: MismatchIO())
    events = Events()
    with pytest.raises(FailStop) as err:
        restore_trainer(_fake_trainer(), str(tmp_path), events, environ={})
    assert err.value.exit_code == EXIT_REQUEUE and err.value.context["phase"] == "restore"
    (ev,) = events.records
    assert ev["event"] == "restart_load" and ev["step"] is None and ev["skipped"][0]["step"] == 6


def test_restore_trainer_writes_no_event_without_snapshots(tmp_path):
    events = Events()
    assert restore_trainer(_fake_trainer(), str(tmp_path), events, environ={}) == \
        (None, "no verified snapshot on any rank")
    assert events.records == []


def test_make_offer_reports_verified_copies_and_the_state_of_the_others(tmp_path):
    ndir, sdir = tmp_path / "node", tmp_path / "shared"
    p3 = _snapshot(ndir, 3)
    _snapshot(ndir, 6, "committed")
    p6 = _snapshot(sdir, 6)
    _snapshot(ndir, 9)
    record_state(str(ndir / step_dirname(9)), "rejected", "bit flip")
    got = make_offer("node1", str(ndir), str(sdir))
    assert got == {"host": "node1", "verified": [[3, p3], [6, p6]], "other": [[9, "rejected", "bit flip"]]}


def test_reject_records_state_beside_the_data_event_and_index(tmp_path):
    run_dir = tmp_path / "run"
    ndir = run_dir / "node-local" / "node1"
    path = _snapshot(ndir, 6)
    events = Events()
    io = TrainerIO(_fake_trainer(), str(run_dir), str(ndir), events)
    io.reject(6, path, "re-check at restart failed: __0_0.distcp fails its SHA-256 checksum (corrupted)")
    rec = read_record(path)
    assert rec.state == "rejected" and "SHA-256" in rec.reason
    idx = json.loads((run_dir / "ckpt-index" / "node1.json").read_text())
    assert [(s["step"], s["state"]) for s in idx["snapshots"]] == [(6, "rejected")]
    (ev,) = events.records
    assert (ev["event"], ev["step"], ev["state"], ev["source"], ev["hostname"]) == \
        ("checkpoint", 6, "rejected", "restore", "node1")


def test_a_publish_from_an_older_scan_cannot_undo_a_rejection(tmp_path):
    """The daemon scans, the restorer rejects and publishes, the daemon publishes its older scan last."""
    ndir = tmp_path / "node"
    path = _snapshot(ndir, 6)
    stale = scan(str(ndir))
    record_state(path, "rejected", "bit flip")
    publish_index(str(tmp_path), "node1", scan(str(ndir)))
    publish_index(str(tmp_path), "node1", stale)
    idx = json.loads((tmp_path / "ckpt-index" / "node1.json").read_text())
    assert [(s["state"], s["reason"]) for s in idx["snapshots"]] == [("rejected", "bit flip")]
    fake = dataclasses.replace(stale[0], path=str(tmp_path / "gone"))
    publish_index(str(tmp_path), "node1", [fake])  # a record of no directory is published as given
    assert json.loads((tmp_path / "ckpt-index" / "node1.json").read_text())["snapshots"][0]["state"] == "verified"


# --------------------------------------------------------------------------- end to end (real ranks and daemons)

CONFIG = """
name: l2r
seed: 1234
steps: 8
topology: {nodes: 2, ranks_per_node: 2}
model: {layers: 2, width: 32, heads: 4, vocab: 64, seq_len: 16, dropout: 0.1}
train: {batch_per_rank: 2, warmup_steps: 2, log_every: 4}
checkpoint: {every_steps: 3, keep_last: 2, compress: false}
timeouts: {collective_s: 3, control_s: 20, startup_s: 60, shutdown_s: 5}
"""


def _run(config, run_dir, env=None):
    from tests.conftest import run_cli

    proc = run_cli(["accelpact_slurm.cli.run", config, "--run-dir", str(run_dir)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _events(run_dir, kind):
    from accelpact_slurm.core.events import read_events

    return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == kind]


def _flip_a_weight_byte(step_dir):
    """Flip one bit in the middle of ``model.tok.weight``'s bytes (found through DCP's own metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(step_dir)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.tok.weight")
    shard = step_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def _forge_a_consistent_corruption(step_dir):
    """Damage ``layers.0.qkv.weight`` enough to move the loss and re-hash the manifest: only the replay can tell."""
    import hashlib

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(step_dir)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.layers.0.qkv.weight")
    shard = step_dir / info.relative_path
    data = bytearray(shard.read_bytes())
    mid = info.offset + info.length // 2
    for j in range(64):  # 16 floats, exponent bytes included (one flipped mantissa bit may not move the loss)
        data[mid + j] ^= 0x40
    shard.write_bytes(bytes(data))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][info.relative_path]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _as_if_requeued_after(src, dst):
    """``dst``: the run directory a job requeued right after snapshot 6 was verified leaves behind.

    Training and snapshots are deterministic, so the uninterrupted run's node directories (snapshots
    3 and 6, both verified; 8 is not a multiple of 3) are bitwise what a run stopped there leaves; the
    events and summary are dropped so that ``dst`` shows only the restart.  (Three runs instead of four:
    the test stays within its time budget on two cores.)
    """
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("events.jsonl", "summary.json", "logs"))


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """A: uninterrupted; B: A's snapshots with 6 corrupted on node1, restarted;
    C: the same corruption, restarted with the reload check disabled (negative control);
    D: 6 corrupted on node2 with a re-hashed manifest (checksums pass, the replay does not), restarted."""
    base = tmp_path_factory.mktemp("l2reload")
    cfg = base / "job.yaml"
    cfg.write_text(CONFIG)
    _run(str(cfg), base / "a")
    _as_if_requeued_after(base / "a", base / "b")
    stopped = {n: [(r.step, r.state) for r in scan(str(base / "b" / "node-local" / n))] for n in ("node1", "node2")}
    _flip_a_weight_byte(base / "b" / "node-local" / "node1" / step_dirname(6))
    _as_if_requeued_after(base / "b", base / "c")
    _run(str(cfg), base / "b")
    _run(str(cfg), base / "c", env={"ACCELPACT_TEST_SKIP_RELOAD_CHECK": "1"})
    _as_if_requeued_after(base / "a", base / "d")
    _forge_a_consistent_corruption(base / "d" / "node-local" / "node2" / step_dirname(6))
    _run(str(cfg), base / "d")
    return {"a": base / "a", "b": base / "b", "c": base / "c", "d": base / "d", "stopped": stopped}


@pytest.mark.multiproc
def test_corrupted_newest_is_rejected_and_the_previous_verified_reproduces_the_run(e2e):
    a, b = e2e["a"], e2e["b"]
    assert e2e["stopped"] == {n: [(3, "verified"), (6, "verified")] for n in ("node1", "node2")}
    (load,) = _events(b, "restart_load")
    assert load["step"] == 3 and load["path"] == str(b / "node-local" / "node1" / step_dirname(3))
    assert [s["step"] for s in load["skipped"]] == [6]
    assert "node1" in load["skipped"][0]["reason"] and "SHA-256 checksum" in load["skipped"][0]["reason"]
    assert _summary(b)["final_state_digest"] == _summary(a)["final_state_digest"]
    assert _summary(b)["losses"] == _summary(a)["losses"] and len(_summary(a)["losses"]) == 8
    # node1's snapshot 6: rejected at restart (beside the data, by the restorer), then replaced by the
    # resumed run's own snapshot 6 (a rejected directory is never chosen again, only overwritten).
    six = [(e["state"], e.get("source"), e.get("reason")) for e in _events(b, "checkpoint")
           if e["step"] == 6 and e["hostname"] == "node1"]
    assert [s for s, _src, _why in six] == ["rejected", "committed", "verified"]
    assert six[0][1] == "restore" and "fails its SHA-256 checksum" in six[0][2]
    # node2's copy of 6 was fine: never rejected; the writer keeps it (same step, already verified).
    node2 = [(e["state"], e.get("reason") or "") for e in _events(b, "checkpoint") if e["hostname"] == "node2"]
    assert [st for st, _why in node2] == ["failed"] and "already exists and is verified" in node2[0][1]
    for node in ("node1", "node2"):
        idx = json.loads((b / "ckpt-index" / f"{node}.json").read_text())
        assert [(s["step"], s["state"]) for s in idx["snapshots"]] == [(3, "verified"), (6, "verified")]


@pytest.mark.multiproc
def test_negative_control_without_the_reload_check_the_corruption_is_loaded(e2e):
    a, c = e2e["a"], e2e["c"]
    (load,) = _events(c, "restart_load")
    assert load["step"] == 6 and load["skipped"] == [] and load["checked"] is False
    assert not [e for e in _events(c, "checkpoint") if e["state"] == "rejected"]
    assert _summary(c)["final_state_digest"] != _summary(a)["final_state_digest"]


@pytest.mark.multiproc
def test_replay_mismatch_after_loading_rejects_and_loads_the_previous_one_over_it(e2e):
    a, d = e2e["a"], e2e["d"]
    (load,) = _events(d, "restart_load")
    assert load["step"] == 3 and [s["step"] for s in load["skipped"]] == [6]
    assert load["skipped"][0]["reason"].startswith("node2: replay mismatch: recorded ")
    (rej,) = [e for e in _events(d, "checkpoint") if e["state"] == "rejected"]
    assert (rej["hostname"], rej["step"], rej["source"], rej["rank"]) == ("node2", 6, "restore", 2)
    # step 6 was loaded, then 3 over it: the whole state is replaced, so the run still ends bitwise equal
    assert _summary(d)["final_state_digest"] == _summary(a)["final_state_digest"]
    assert _summary(d)["losses"] == _summary(a)["losses"]
