"""The repair engine's own phases, against a fake control plane: no process group, one process.

In the end-to-end tests the vote has already agreed on (F, generation) before the engine runs, so
``control_barrier``'s own check never sees a mismatch there; here it is given one, both on the vote's
data (what the guard hands the engine) and through its own agreement (a caller without a vote).
``replace``, ``rebind`` and ``validate`` need real groups (tests/e2e/test_l1_repair.py); a rank outside the
affected replication group skips the first two, so the whole driver runs here for such a rank, and the
release's failure reports are checked here: a rank that fails after the control barrier puts its
failure into the release, and a failure reported there fails every other rank stop.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from accelpact_slurm.core.errors import EXIT_REQUEUE, FailStop, RepairError
from accelpact_slurm.repair.engine import PHASES, RepairEngine, RepairContext
from accelpact_slurm.runtime.job.topology import Layout


class FakeControl:
    """The part of ``runtime.transport.control.ControlPlane`` the engine uses, with prepared answers per agreement."""

    def __init__(self, answers=None, generation=0, fail=None):
        self.answers = dict(answers or {})
        self.fail = dict(fail or {})
        self.generation = generation
        self.base_store = object()
        self.calls = []
        self.contributed = []

    def all_gather(self, name, value, ranks=None, timeout_s=None):
        self.calls.append((name, value))
        if name in self.fail:
            raise self.fail[name]
        return self.answers[name]

    def contribute(self, name, value, ranks=None):
        self.contributed.append((name, value))

    def set_generation(self, generation):
        self.generation = generation


class FakeEvents:
    def __init__(self):
        self.emitted = []

    def emit(self, event, **fields):
        self.emitted.append((event, fields))


def make_engine(rank, control, *, nodes=2, rpn=2, fsdp="fsdp1", model=None):
    layout = Layout(num_nodes=nodes, ranks_per_node=rpn)
    rt = SimpleNamespace(rank=rank, layout=layout, local_rank=layout.local_of(rank), control=control,
                         replicate_group=object(), mesh=None, collective_timeout_s=1)
    events = FakeEvents()
    engine = RepairEngine(model if model is not None else torch.nn.Linear(2, 2), rt, events, fsdp=fsdp,
                          out=io.StringIO())
    return engine, rt, events


def ctx_for(frontier=7, ranks=(1, 3), generation=1):
    return RepairContext(frontier=frontier, ranks=list(ranks), observed=0.0, key="<k>", reason="test",
                         generation=generation)


# ------------------------------------------------------------------ observe


@pytest.mark.parametrize("rank, member, members", [(0, False, [0, 2]), (1, True, [1, 3]), (3, True, [1, 3])])
def test_observe_advances_the_generation_and_names_the_replication_group(rank, member, members):
    engine, rt, _ = make_engine(rank, FakeControl())
    ctx = RepairContext(frontier=7, ranks=[1, 3], observed=0.0, key="<k>", reason="test")
    engine.observe(ctx)
    assert (engine.generation, ctx.generation) == (1, 1)
    assert ctx.member is member and ctx.members == members
    assert ctx.old is rt.replicate_group
    engine.observe(ctx)
    assert (engine.generation, ctx.generation) == (2, 2)


def test_observe_on_a_three_node_world():
    engine, _, _ = make_engine(5, FakeControl(), nodes=3, rpn=2)
    ctx = RepairContext(frontier=1, ranks=[1, 3, 5], observed=0.0, key="<k>", reason="test")
    engine.observe(ctx)
    assert ctx.member and ctx.members == [1, 3, 5]


# ------------------------------------------------------------------ control_barrier


def test_control_barrier_agreement_moves_to_the_next_generation():
    agree = [{"F": 7, "g": 1}] * 4
    control = FakeControl({"repair-agree": agree}, generation=4)
    engine, _, _ = make_engine(1, control)
    engine.control_barrier(ctx_for())
    assert control.calls == [("repair-agree", {"F": 7, "g": 1})]
    assert control.generation == 5


def test_control_barrier_on_the_votes_data_needs_no_round_trip():
    """The vote carried every rank's frontier and the repairs it made before: its generation before this repair."""
    control = FakeControl(generation=4)
    engine, _, _ = make_engine(1, control)
    ctx = ctx_for(generation=3)
    ctx.agreed = [{"F": 7, "g": 2}] * 4
    engine.control_barrier(ctx)
    assert control.calls == [] and control.generation == 5 and ctx.advanced


@pytest.mark.parametrize("other, words", [
    ({"F": 8, "g": 0}, "rank 3 has F=8 g=1"),    # a rank one update ahead
    ({"F": 7, "g": 1}, "rank 3 has F=7 g=2"),    # a rank that counted one repair more
    ({"F": 7, "g": None}, "rank 3 has F=7 g=None"),  # a vote without the generation
])
def test_control_barrier_mismatch_in_the_votes_fails_stop_on_every_rank(other, words):
    for rank in range(4):  # every rank holds the same votes: every rank takes the same branch
        control = FakeControl(generation=4)
        engine, _, _ = make_engine(rank, control)
        ctx = ctx_for()
        ctx.agreed = [{"F": 7, "g": 0}] * 3 + [other]
        with pytest.raises(FailStop) as info:
            engine.control_barrier(ctx)
        assert "rank 0 has F=7 g=1" in info.value.reason and words in info.value.reason, info.value.reason
        assert info.value.context["frontier"] == 7
        assert control.generation == 4 and not ctx.advanced and control.calls == []


@pytest.mark.parametrize("other, words", [
    ({"F": 8, "g": 1}, "rank 2 has F=8 g=1"),   # a rank one update ahead
    ({"F": 7, "g": 2}, "rank 2 has F=7 g=2"),   # a rank that counted one repair more
])
def test_control_barrier_mismatch_fails_stop_naming_both_ranks(other, words):
    values = [{"F": 7, "g": 1}, {"F": 7, "g": 1}, other, {"F": 7, "g": 1}]
    control = FakeControl({"repair-agree": values}, generation=4)
    engine, _, _ = make_engine(1, control)
    with pytest.raises(FailStop) as info:
        engine.control_barrier(ctx_for())
    stop = info.value
    assert "rank 0 has F=7 g=1" in stop.reason and words in stop.reason, stop.reason
    assert stop.exit_code == EXIT_REQUEUE == 75
    assert stop.context["frontier"] == 7 and stop.context["phase"] == "committed" and stop.context["key"] == "<k>"
    assert control.generation == 4, "a failed agreement must not move the generation"


def test_control_barrier_mismatch_on_rank_zero_itself():
    values = [{"F": 9, "g": 3}, {"F": 7, "g": 1}]
    control = FakeControl({"repair-agree": values}, generation=0)
    engine, _, _ = make_engine(1, control, nodes=2, rpn=1)
    with pytest.raises(FailStop, match=r"rank 0 has F=9 g=3, rank 1 has F=7 g=1") as info:
        engine.control_barrier(ctx_for(ranks=(1,)))
    assert info.value.context["frontier"] == 7  # the lowest frontier any rank reported
    assert control.generation == 0


# ------------------------------------------------------------------ the driver


RELEASED = [{"ok": True}, {"ok": True, "view": {"phases": {"observe": 0.1}, "rebound": 4}}, {"ok": True},
            {"ok": True}]


@pytest.mark.parametrize("agreed", [None, [{"F": 7, "g": 0}] * 4])
def test_driver_runs_every_phase_for_a_rank_outside_the_repaired_group(agreed):
    control = FakeControl({"repair-agree": [{"F": 7, "g": 1}] * 4, "repair-release": RELEASED}, generation=2)
    engine, rt, events = make_engine(0, control)
    old = rt.replicate_group
    ctx = engine.repair(frontier=7, ranks=[1, 3], observed=0.0, key="<k>", reason="test", agreed=agreed)
    assert list(ctx.durations) == list(PHASES)
    assert not ctx.member and ctx.new is None and rt.replicate_group is old
    assert control.generation == 3 and engine.repairs == 1
    # With the vote's data, the release is the repair's only round trip over the control plane.
    assert [c[0] for c in control.calls] == (["repair-release"] if agreed else ["repair-agree", "repair-release"])
    assert control.calls[-1][1] == {"ok": True}  # rank 0 is not the lead: no phase timings of its own ride along
    assert control.contributed == []
    assert ctx.lead_view == {"phases": {"observe": 0.1}, "rebound": 4}  # rank 1's view: min(ranks)
    assert [e for e, _ in events.emitted] == ["repair_rank"]  # only min(ranks) emits "repair"
    assert "L1 repair (generation 1) at F=7" in engine.out.getvalue()  # rank 0 prints the summary


def test_the_lead_sends_its_phase_timings_in_the_release():
    control = FakeControl({"repair-release": RELEASED}, generation=2)
    engine, _, events = make_engine(1, control)
    ctx = RepairContext(frontier=7, ranks=[1, 3], observed=0.0, key="<k>", reason="test", member=False,
                        agreed=[{"F": 7, "g": 0}] * 4)
    ctx.durations = {"observe": 0.5}
    engine.control_barrier(ctx)
    engine.validate(ctx)
    assert control.calls == [("repair-release", {"ok": True, "view": {"phases": {"observe": 0.5}, "rebound": 0,
                                                                       "in_place": []}})]


def test_a_failure_reported_in_the_release_fails_every_other_rank_stop():
    """A member whose validation (or replacement, or rebinding) failed put its failure into the release: every
    other rank fails stop there, at once, naming it; none goes on to step, and no group is retired."""
    release = [{"ok": True}, {"ok": False, "why": "rank 1, phase validate: RepairError: all-reduce gave 1"},
               {"ok": True}, {"ok": True}]
    control = FakeControl({"repair-release": release}, generation=2)
    engine, _, events = make_engine(0, control)
    with pytest.raises(FailStop) as info:
        engine.repair(frontier=7, ranks=[1, 3], observed=0.0, key="<k>", reason="test", agreed=[{"F": 7, "g": 0}] * 4)
    reason = info.value.reason
    assert reason.startswith("L1 repair failed in phase validate: RepairError: the repair failed on rank(s) [1]")
    assert "all-reduce gave 1" in reason and info.value.exit_code == 75
    assert control.contributed == [], "a rank that took its part in the release reports nothing more"
    assert engine.repairs == 0 and events.emitted == []


def test_a_rank_failing_after_the_control_barrier_reports_it_in_the_release_without_waiting():
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()  # a gradient left after a (skipped) discard: guard_sync refuses
    control = FakeControl(generation=2)
    engine, _, _ = make_engine(3, control, model=model)
    engine.skip_discard = True
    with pytest.raises(FailStop, match="L1 repair failed in phase guard_sync"):
        engine.repair(frontier=7, ranks=[0, 1, 2, 3], observed=0.0, key="<k>", reason="test", scope="update", step=8,
                      agreed=[{"F": 7, "g": 0}] * 4)
    assert control.calls == [], "it does not wait for the others"
    (name, value), = control.contributed
    assert name == "repair-release" and value["ok"] is False
    assert value["why"].startswith("rank 3, phase guard_sync: RepairError: guard check failed"), value
    assert control.generation == 3, "it moved to the repair's generation with every other rank"


def test_a_failed_agreement_reports_nothing_in_the_release():
    control = FakeControl(generation=2)
    engine, _, _ = make_engine(1, control)
    with pytest.raises(FailStop, match="frontier/generation mismatch"):
        engine.repair(frontier=7, ranks=[1, 3], observed=0.0, key="<k>", reason="test",
                      agreed=[{"F": 7, "g": 0}, {"F": 7, "g": 1}, {"F": 7, "g": 0}, {"F": 7, "g": 0}])
    assert control.contributed == [] and control.generation == 2


def test_driver_passes_a_control_barrier_fail_stop_through_unchanged():
    control = FakeControl({"repair-agree": [{"F": 7, "g": 1}, {"F": 6, "g": 1}, {"F": 7, "g": 1}, {"F": 7, "g": 1}]})
    engine, _, events = make_engine(1, control)
    with pytest.raises(FailStop, match="frontier/generation mismatch at repair: rank 0 has F=7 g=1, rank 1 has F=6 g=1"):
        engine.repair(frontier=7, ranks=[1, 3], observed=0.0, key="<k>", reason="test")
    assert control.generation == 0 and engine.repairs == 0 and events.emitted == []


def test_driver_turns_a_phase_exception_into_a_requeue_fail_stop_naming_the_phase():
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()  # a gradient left after a (skipped) discard: guard_sync refuses
    engine, _, events = make_engine(1, FakeControl({"repair-agree": [{"F": 7, "g": 1}] * 4}), model=model)
    engine.skip_discard = True
    with pytest.raises(FailStop) as info:
        engine.repair(frontier=7, ranks=[1, 3], observed=0.0, key="<k>", reason="test", scope="update", step=8)
    stop = info.value
    assert stop.exit_code == EXIT_REQUEUE == 75
    assert "L1 repair failed in phase guard_sync" in stop.reason and "RepairError" in stop.reason, stop.reason
    assert "outstanding gradients" in stop.reason
    assert isinstance(stop.__cause__, RepairError)
    assert stop.context == {**stop.context, "phase": "backward", "frontier": 7, "key": "<k>"}
    assert engine.generation == 1, "observe ran before the failing phase"
    assert events.emitted == []


def test_driver_turns_a_control_plane_error_into_a_fail_stop_naming_control_barrier():
    control = FakeControl(fail={"repair-agree": TimeoutError("store wait timed out")}, generation=2)
    engine, _, _ = make_engine(1, control)
    with pytest.raises(FailStop, match=r"L1 repair failed in phase control_barrier: TimeoutError: store wait") as info:
        engine.repair(frontier=7, ranks=[1, 3], observed=0.0, key="<k>", reason="test")
    assert info.value.exit_code == 75
    assert control.generation == 2


def test_the_boundary_guard_check_runs_on_the_groups_ranks_only_and_takes_the_look_of_the_walk_ahead():
    """At the committed boundary a rank outside the group(s) to repair keeps its model and groups: no check (it
    joins the release only).  A member takes the look at its FSDP units the walk ahead of the vote took (nothing
    ran since): a unit it saw mid-step fails the check (the control: a member without that look checks itself)."""
    from accelpact_slurm.repair.rebind import WalkAhead

    engine, _, _ = make_engine(0, FakeControl())
    ctx = ctx_for(ranks=(1, 3))
    engine.observe(ctx)
    assert not ctx.member
    engine.guard_sync(ctx)  # a non-member: nothing looked at
    engine, _, _ = make_engine(1, FakeControl())
    ctx = ctx_for(ranks=(1, 3))
    engine.observe(ctx)
    engine.guard_sync(ctx)  # a member, no walk ahead: its own look (a plain module: no FSDP unit)
    ctx.ahead = WalkAhead([], object())
    ctx.ahead.idle = (False, "FSDP unit is FORWARD")
    with pytest.raises(RepairError, match="guard check failed: FSDP unit is FORWARD"):
        engine.guard_sync(ctx)


def test_replaced_gloo_groups_are_held_and_freed_off_the_training_thread():
    """Freeing a Gloo group waits for ticks of Gloo's transport loop (~10 ms per pair): the retired groups are held
    after the release and freed on a thread of their own when the guard's next committing vote asks for it.
    Negative control: freed in ``_retire`` (as before) the finalizer runs on this thread, there."""
    import threading
    import weakref

    engine, _, _ = make_engine(1, FakeControl({}))
    freed: list[str] = []

    class Group:  # stands for a Gloo group: not in c10d's registry, no NCCL communicator
        pass

    ctx = ctx_for()
    ctx.retired = [Group()]
    weakref.finalize(ctx.retired[0], lambda: freed.append(threading.current_thread().name))
    engine._retire(ctx)
    assert freed == [] and len(engine.retired) == 1 and ctx.retired == []
    thread = engine.release_retired()
    thread.join(5)
    assert freed == ["accelpact-free-retired"] and engine.retired == [] and thread in engine.retiring
    assert engine.release_retired() is None
