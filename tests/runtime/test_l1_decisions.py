"""Pure decisions of L1: the vote, the envelope lookup, the reference scan."""

from __future__ import annotations

import datetime as _dt
import re

import pytest

from accelpact_slurm.runtime.job import envelope as env_mod
from accelpact_slurm.runtime.job.guard import CONTINUE, Vote, affected_ranks, decide_votes
from accelpact_slurm.runtime.job.topology import Layout

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


def qualified_backward(**kw):
    env = qualified(**kw)
    bwd = env_mod.Key(KEY.platform, KEY.profile, "backward")
    return env_mod.Envelope([*env.entries, env_mod.Entry(bwd, ("preserve",), {"trials": 3, "successes": 3, "date": "d"})])


@pytest.mark.parametrize("phase", ["forward", "optimizer"])
def test_faults_in_forward_or_the_optimizer_step_restart_even_when_qualified(phase):
    v = votes((3, None), (3, phase))
    action, reason = decide_votes(v, lookup_with(qualified_backward()))
    assert action == "restart" and phase in reason


def test_a_backward_fault_restarts_without_its_own_qualified_key():
    """The boundary key does not cover backward: it has its own, earned by its own trials."""
    v = votes((3, None), (3, "backward"))
    action, reason = decide_votes(v, lookup_with(qualified()))
    assert action == "restart" and "backward" in reason and "no envelope entry" in reason


def test_a_backward_fault_is_preserved_and_redone_where_qualified():
    # the faulting rank saw it in backward, a peer whose backward finished in the guard's own collective
    v = votes((3, "backward"), (3, "committed"), (3, None), (3, "backward"))
    action, reason = decide_votes(v, lookup_with(qualified_backward()))
    assert action == "preserve" and "the update runs again" in reason and "rank(s) [0, 1, 3]" in reason


def test_a_backward_fault_whose_batch_cannot_run_again_restarts():
    v = votes((3, "backward"), (3, None))
    action, reason = decide_votes(v, lookup_with(qualified_backward()), redoable=False)
    assert action == "restart" and "did not come from run.batches" in reason


def test_backward_mixed_with_forward_restarts():
    v = votes((3, "forward"), (3, "backward"))
    assert decide_votes(v, lookup_with(qualified_backward()))[0] == "restart"


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


# What a job can report as its wrapping (repair.torch_compat.wrapping), and every fault phase the guard tracks.
WRAPPINGS = (("fsdp1", "device_mesh"), ("fsdp1", "group_pair"), ("fsdp2", "device_mesh"))
PHASES = ("forward", "backward", "optimizer", "committed")
PROFILE = re.compile(r"(?P<device>cpu|cuda):(?P<nodes>[0-9]+)x(?P<rpn>[0-9]+):(?P<fsdp>fsdp[12])-(?P<mesh>[a-z_]+)")


def test_shipped_envelope_has_qualified_cpu_gloo_entries():
    shipped = env_mod.load(env_mod.SHIPPED)
    assert shipped.path == env_mod.SHIPPED and shipped.entries
    keys = [e.key for e in shipped.entries]
    assert len(set(keys)) == len(keys), "one entry per key (accelpact-qualify upserts)"
    for e in shipped.entries:
        ev = e.evidence
        # The key is one the runtime spells: envelope.platform_key from the recorded torch and backend ...
        assert e.key.platform == env_mod.platform_key(str(ev["torch"]), str(ev["backend"])), e.key
        # ... and envelope.profile_key of a wrapping a job can have, on a world with a replication dimension.
        m = PROFILE.fullmatch(e.key.profile)
        assert m, f"profile {e.key.profile!r} is not device:NxR:fsdp-mesh"
        assert (m["fsdp"], m["mesh"]) in WRAPPINGS, e.key.profile
        nodes, rpn = int(m["nodes"]), int(m["rpn"])
        assert nodes >= 2 and rpn >= 1, e.key.profile
        assert env_mod.profile_key(m["device"], nodes, rpn, m["fsdp"], m["mesh"]) == e.key.profile
        assert e.key.phase in env_mod.QUALIFIABLE_PHASES, f"{e.key}: only committed and backward faults can be preserved"
        assert e.key.objective == env_mod.DEFAULT_OBJECTIVE
        # The evidence is what accelpact-qualify writes for a passed qualification.
        assert isinstance(ev["trials"], int) and ev["successes"] == ev["trials"] >= env_mod.MIN_TRIALS, ev
        assert e.actions == (env_mod.PRESERVE, env_mod.RESTART), e.actions
        qualified_on = _dt.date.fromisoformat(str(ev["date"]))
        assert _dt.date(2024, 1, 1) <= qualified_on <= _dt.date.today(), ev["date"]
        assert int(ev.get("steps", 3)) >= 3

    for phase in env_mod.QUALIFIABLE_PHASES:  # both repairable phases, for every wrapping
        gloo_cpu = {e.key.profile.split(":")[-1] for e in shipped.entries
                    if e.key.platform.endswith("/gloo") and e.key.profile.startswith("cpu:") and e.key.phase == phase}
        assert {"-".join(w) for w in WRAPPINGS} <= gloo_cpu, phase

    # decide() preserves exactly the shipped keys: every key a job could present, over the shipped
    # platforms and one that is not shipped, every profile of the shipped world sizes and one other,
    # every wrapping and every phase.
    platforms = {k.platform for k in keys} | {env_mod.platform_key("0.0.0+unqualified", "gloo")}
    sizes = {tuple(map(int, PROFILE.fullmatch(k.profile).group("nodes", "rpn"))) for k in keys} | {(3, 5)}
    candidates = [env_mod.Key(plat, env_mod.profile_key(dev, n, r, f, m), phase)
                  for plat in platforms for dev in ("cpu", "cuda") for n, r in sizes for f, m in WRAPPINGS
                  for phase in PHASES]
    preserved = {k for k in candidates if env_mod.decide(shipped, k)[0] == env_mod.PRESERVE}
    assert preserved == set(keys)
    # Negative controls: a key that is not shipped restarts, and so does a shipped one with its evidence weakened.
    stranger = env_mod.Key(keys[0].platform, env_mod.profile_key("cpu", 3, 5, "fsdp1", "device_mesh"), "committed")
    action, reason = env_mod.decide(shipped, stranger)
    assert action == env_mod.RESTART and "no envelope entry" in reason
    weak = env_mod.Envelope([env_mod.Entry(e.key, e.actions, dict(e.evidence, successes=e.evidence["trials"] - 1))
                             for e in shipped.entries])
    assert all(env_mod.decide(weak, k)[0] == env_mod.RESTART for k in keys)


def test_this_platform_key_is_shipped_when_qualified_here():
    """The key the runtime builds for a job on this torch is the shipped key, where this torch is shipped."""
    import torch

    from accelpact_slurm.runtime.job.recovery import key_factory

    shipped = env_mod.load(env_mod.SHIPPED)
    here = env_mod.platform_key(torch.__version__, "gloo")
    entries = [e for e in shipped.entries if e.key.platform == here]
    # torch is pinned (Makefile): the shipped envelope must cover it, or the embedded default never repairs
    assert entries, f"no shipped entry for {here}: qualify this platform (accelpact-qualify) and ship the entries"
    for e in entries:
        m = PROFILE.fullmatch(e.key.profile)
        if m["device"] != ("cuda" if torch.cuda.is_available() else "cpu"):
            continue
        key = key_factory(int(m["nodes"]), int(m["rpn"]), m["fsdp"], m["mesh"])(e.key.phase)
        assert key == e.key
        assert env_mod.decide(shipped, key)[0] == env_mod.PRESERVE


def test_an_update_discarded_three_times_in_a_row_restarts_instead():
    """A backward fault that recurs on every redo (a broken link that stays broken) ends in L2, not a loop."""
    from types import SimpleNamespace

    from accelpact_slurm.core.errors import FailStop
    from accelpact_slurm.runtime.job.guard import MAX_REDOS, REDO, BoundaryGuard

    layout = Layout(2, 1)
    repairs = []
    control = SimpleNamespace(all_reduce=lambda tag, mine, combine: combine([mine, {**mine, "fault": None,
                                                                                  "error": None}]))
    rt = SimpleNamespace(rank=0, layout=layout, control=control)
    engine = SimpleNamespace(generation=0, repair=lambda **kw: repairs.append(kw["step"]))
    events = SimpleNamespace(emit=lambda *a, **k: None)
    guard = BoundaryGuard(rt, events, qualified_backward(), lambda phase: env_mod.Key(KEY.platform, KEY.profile, phase),
                          engine, SimpleNamespace(fires=lambda *a: False))
    for _ in range(MAX_REDOS):
        assert guard.decide(7, "backward", "withheld", None)[0] == REDO
    with pytest.raises(FailStop, match="discarded 3 times in a row"):
        guard.decide(7, "backward", "withheld", None)
    assert repairs == [7] * MAX_REDOS
    assert guard.decide(8, "backward", "withheld", None)[0] == REDO  # another update starts its own count


def coverage_gaps(envelope, releases=env_mod.SUPPORTED_RELEASES) -> list[str]:
    """The CPU/Gloo keys of the embedded default (2 nodes x 2 ranks) that ``envelope`` does not qualify."""
    gaps = []
    for release in releases:
        for fsdp, mesh in WRAPPINGS:
            for phase in env_mod.QUALIFIABLE_PHASES:
                key = env_mod.Key(env_mod.platform_key(release, "gloo"), env_mod.profile_key("cpu", 2, 2, fsdp, mesh),
                                  phase)
                if env_mod.decide(envelope, key)[0] != env_mod.PRESERVE:
                    gaps.append(f"torch {release}: {key}")
    return gaps


def test_the_shipped_envelope_covers_every_supported_release_and_a_removed_key_is_named():
    shipped = env_mod.load_file(env_mod.SHIPPED)
    assert coverage_gaps(shipped) == [], "the shipped envelope does not qualify L1 on a supported release"
    for release in env_mod.SUPPORTED_RELEASES:  # negative control, per release: one key taken out is named
        victim = next(e for e in shipped.entries if e.key.platform == env_mod.platform_key(release, "gloo"))
        cut = env_mod.Envelope([e for e in shipped.entries if e is not victim])
        assert coverage_gaps(cut) == [f"torch {release}: {victim.key}"]


def test_the_supported_releases_are_the_tested_ones_and_the_installable_range():
    """setup.cfg's torch range spans exactly the supported minors; the Makefile tests exactly those releases."""
    from tests.conftest import REPO

    with open(f"{REPO}/setup.cfg", encoding="utf-8") as fh:
        (lo, hi), = re.findall(r"^\s*torch>=(\d+\.\d+),<(\d+\.\d+)\s*$", fh.read(), flags=re.M)
    minors = [tuple(map(int, r.split(".")[:2])) for r in env_mod.SUPPORTED_RELEASES]
    assert tuple(map(int, lo.split("."))) == minors[0]
    assert tuple(map(int, hi.split("."))) == (minors[-1][0], minors[-1][1] + 1)
    assert minors == [(minors[0][0], minors[0][1] + i) for i in range(len(minors))], "one release per minor"
    with open(f"{REPO}/Makefile", encoding="utf-8") as fh:
        make = fh.read()
    pinned = re.search(r"^TORCH_PINNED\s*:?=\s*(\S+)", make, flags=re.M)[1]
    others = re.search(r"^TORCH_RELEASES\s*\??=\s*(.+)$", make, flags=re.M)[1].split()
    assert (pinned, *others) == env_mod.SUPPORTED_RELEASES


def test_a_job_on_an_unqualified_release_is_told_at_its_start_with_the_command_that_earns_l1():
    profile = env_mod.profile_key("cpu", 2, 2, "fsdp1", "device_mesh")
    evidence = {"trials": 3, "successes": 3, "date": "d"}
    envelope = env_mod.Envelope([env_mod.Entry(env_mod.Key("torch-2.14.1/gloo", profile, ph), ("preserve", "restart"),
                                               evidence) for ph in env_mod.QUALIFIABLE_PHASES])

    def key_for(release):
        return lambda phase: env_mod.Key(env_mod.platform_key(release, "gloo"), profile, phase)

    assert env_mod.coverage_note(envelope, key_for("2.14.1+cu130")) is None  # the build label is not the release
    note = env_mod.coverage_note(envelope, key_for("2.14.2"))  # a patch release gets no L1 from its sibling ...
    assert "L1 is not qualified for torch-2.14.2/gloo" in note and "phase committed, backward" in note
    assert "torch-2.14.1/gloo is qualified" in note and "restarts the job (L2)" in note
    assert "accelpact-qualify JOB.yaml --phase all" in note  # ... and is told how to earn it
    assert "is qualified" not in env_mod.coverage_note(envelope, key_for("2.15.0"))  # another minor: no sibling
    half = env_mod.Envelope([e for e in envelope.entries if e.key.phase == "committed"])
    assert "(phase backward)" in env_mod.coverage_note(half, key_for("2.14.1"))


def test_the_votes_summary_decides_exactly_as_every_vote_and_does_not_grow_with_the_ranks():
    """The round's lead summarises the votes (guard.summarize_votes) and every rank decides from the summary:
    for random vote sets (faults, bugs, frontier skews, losses, stops, unredoable batches) the decision, its
    reason, the mean loss, the flags and the repair's (F, generation) check are those of every vote.  Without
    faults the summary of 4,096 votes is no larger than that of 4 (the control: the votes themselves grow)."""
    import json
    import random

    from accelpact_slurm.runtime.job.guard import Vote, decide_votes, summarize_votes

    lookup = lambda phase: ("preserve", "qualified") if phase in ("committed", "backward") else ("restart", "no")  # noqa: E731
    rng = random.Random(7)
    for trial in range(400):
        n = rng.choice([1, 2, 3, 4, 8, 17])
        raw = []
        for r in range(n):
            fault = rng.choice([None] * 6 + ["committed", "backward", "forward", "training-code"])
            raw.append({"F": 10 + (rng.random() < 0.05) * rng.choice([-1, 1]), "g": rng.choice([0, 0, 0, 1]),
                        "fault": fault, "error": f"e{r}" if fault else None,
                        "loss": None if rng.random() < 0.2 else rng.random(), "stop": rng.random() < 0.05,
                        "redo": rng.random() > 0.05,
                        "exc": {"type": "ValueError", "message": str(r)} if fault == "training-code" else None})
            if trial % 3 == 0:
                raw[-1]["fp"] = f"fp{r}"
        s = json.loads(json.dumps(summarize_votes(raw)))
        full = decide_votes([Vote.from_json(r, d) for r, d in enumerate(raw)], lookup,
                            all(d.get("redo", True) for d in raw))
        assert decide_votes([Vote.from_json(r, d) for r, d in s["votes"]], lookup, s["redo"]) == full, raw
        losses = [d["loss"] for d in raw if d["loss"] is not None]
        assert s["mean"] == (sum(losses) / len(losses) if losses else None)
        assert s["stop"] == any(d["stop"] for d in raw) and s["n"] == n
        assert s["fps"] == ([d["fp"] for d in raw] if trial % 3 == 0 else None)
        pairs = [{"F": d["F"], "g": d["g"]} for d in raw]
        first, diff = s["agreed"]
        assert first == pairs[0]
        assert diff == next(([r, p] for r, p in enumerate(pairs) if p != pairs[0]), None)

    def quiet(n):
        return [{"F": 10, "g": 0, "fault": None, "error": None, "loss": 2.5, "stop": False, "redo": True}] * n

    assert len(json.dumps(summarize_votes(quiet(4096)))) <= len(json.dumps(summarize_votes(quiet(4)))) + 8  # "n"
    assert len(json.dumps(quiet(4096))) > 1000 * len(json.dumps(quiet(4)))
