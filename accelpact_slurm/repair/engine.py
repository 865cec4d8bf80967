"""The six-phase L1 Preserve repair engine.

One driver (:meth:`RepairEngine.repair`), one method per phase, one transition table.  Every rank of the world runs
the driver at the same boundary (the vote made them agree); the ranks of the affected replication group(s) replace
and rebind, the others take part in the agreements only.

    observe -> control_barrier -> guard_sync -> replace -> rebind -> validate -> done

The control barrier is the vote itself: it gathered every rank's (F, generation) before the decision, so the phase
checks the agreement on that data (every rank takes the same branch) and moves to the next control-plane
generation with no round trip of its own.  The validation ends in the world's release, which also carries each
rank's outcome: a rank whose repair failed after the control barrier puts its failure into the release before it
fails stop, so every other rank fails stop as the release completes instead of stepping or hanging.

That repairs a fault at the committed boundary (``scope="replicate"``).  A fault in backward (``scope="update"``)
leaves FSDP mid-flight and possibly every group of the mesh dead; every rank then runs

    observe -> control_barrier -> discard -> guard_sync -> replace_all -> validate_all -> done

(:mod:`accelpact_slurm.repair.discard`), and the caller runs the update again.  Any exception in a phase becomes a
fail-stop: L1 never continues on a state it could not validate.

The engine reads the rank through :class:`accelpact_slurm.core.rank.RepairRank` and never assigns to it: the groups
a repair puts in place come back as a :class:`Replaced` (in the returned context, and to ``on_replaced`` once the
model is rebound to them, before their validation); the runtime adopts them
(:func:`accelpact_slurm.runtime.job.recovery.adopt`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from accelpact_slurm.core.errors import EXIT_REQUEUE, FailStop, RepairError
from accelpact_slurm.core.rank import RepairRank
from accelpact_slurm.repair import rebind as rb, torch_compat as tc
from accelpact_slurm.repair.discard import discard_update, replace_broken_groups

log = logging.getLogger(__name__)

PHASES = ("observe", "control_barrier", "guard_sync", "replace", "rebind", "validate")
TRANSITIONS: dict[str, str] = {
    "observe": "control_barrier",
    "control_barrier": "guard_sync",
    "guard_sync": "replace",
    "replace": "rebind",
    "rebind": "validate",
    "validate": "done",
}
UPDATE_TRANSITIONS: dict[str, str] = {
    "observe": "control_barrier",
    "control_barrier": "discard",
    "discard": "guard_sync",
    "guard_sync": "replace_all",
    "replace_all": "validate_all",
    "validate_all": "done",
}
#: The world's release after the validation (one control-plane agreement per repair, in the new generation).
RELEASE = "repair-release"


@dataclass(frozen=True)
class Replaced:
    """The HSDP groups a repair put in place of the rank's own: what the rank holds from now on.

    ``shard_group`` is None when the repair left the shard group as it was (a repair at the committed boundary
    replaces the replication group only).  A group reconfigured in place is the same object as before.
    """

    replicate_group: Any
    shard_group: Any = None


@dataclass
class RepairContext:
    frontier: int
    ranks: list[int]
    observed: float
    key: str
    reason: str
    generation: int = 0
    member: bool = False
    members: list[int] = field(default_factory=list)
    old: Any = None
    new: Any = None
    rebound: dict[str, int] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    lead_view: dict[str, Any] = field(default_factory=dict)
    scope: str = "replicate"  # replicate | update
    optimizer: Any = None
    step: int | None = None  # the update discarded (scope "update")
    discarded: dict[str, int] = field(default_factory=dict)
    retired: list[Any] = field(default_factory=list)  # the replaced groups, retired after the release
    agreed: list[dict[str, Any]] | None = None  # every rank's vote: {"F": frontier, "g": repairs before this one}
    advanced: bool = False  # this rank moved to the repair's control-plane generation (control_barrier passed)
    released: bool = False  # this rank took its part in the release (no failure may be put there after it)
    replace_parts: dict[str, float] = field(default_factory=dict)  # replace_all: build, rebind, scan, retire
    in_place: list[str] = field(default_factory=list)  # the groups given a new transport in place (not rebuilt)
    replaced: Replaced | None = None  # the rank's groups after the repair (None: this rank kept its groups)
    parts: dict[str, float] = field(default_factory=dict)  # seconds of a phase's parts: "validate.check", ...
    marks: dict[str, float] = field(default_factory=dict)  # time.monotonic() when the rank entered the repair, ...
    check: list[Any] | None = None  # the validation's all-reduces, issued once the model is rebound (rebind)
    ahead: rb.WalkAhead | None = None  # the invariant's walk taken while the vote was in flight (walk_ahead)


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class RepairEngine:
    """Owns the repair of one rank.

    ``model`` is the user's wrapped model (FSDP1 or FSDP2; the flavour is read from it), ``rt`` the rank's runtime as
    the engine reads it (:class:`~accelpact_slurm.core.rank.RepairRank`: a small stand-in in the phase tests;
    ``device`` and ``detector`` may be missing there), ``events`` the event log. ``on_replaced(replaced)``: the caller
    takes over the groups the repair replaced (:class:`Replaced`), as soon as the model is rebound to them and before
    they are validated (the rank's fault detector watches the rank's current groups: the validation's collectives
    included).  ``skip_rebind`` is the negative control of the rebinding tests (never set in production).
    """

    def __init__(self, model, rt: RepairRank, events, *, fsdp: str, skip_rebind: bool = False,
                 skip_discard: bool = False, out=None, on_replaced: Callable[[Replaced], None] | None = None) -> None:
        self.model = model
        self.rt = rt
        self.on_replaced = on_replaced
        self.events = events
        self.fsdp = fsdp
        self.skip_rebind = skip_rebind
        self.skip_discard = skip_discard
        self.out = out
        self.generation = 0
        self.repairs = 0
        self.retiring: list[Any] = []  # background aborts of retired NCCL communicators (joined by close)
        #: Retired Gloo groups, held until :meth:`release_retired` frees them on a thread of their own: freeing a
        #: Gloo group closes its pairs, each close waiting for a tick of Gloo's transport loop (up to 10 ms;
        #: two groups cost ~18 ms, measured), and whichever reference drops last frees it, on the training
        #: thread otherwise (the given-up update's traceback, in the middle of a recovery).
        self.retired: list[Any] = []

    @property
    def device(self) -> torch.device:
        """The rank's training device (new groups get an NCCL communicator there when it is a GPU)."""
        return getattr(self.rt, "device", None) or torch.device("cpu")

    def close(self, deadline_s: float = 10.0) -> int:
        """Wait up to ``deadline_s`` for the background retirements; return how many are still running."""
        self.release_retired()
        end = time.monotonic() + deadline_s
        for t in self.retiring:
            t.join(max(0.0, end - time.monotonic()))
        self.retiring = [t for t in self.retiring if t.is_alive()]
        return len(self.retiring)

    # ------------------------------------------------------------------ driver

    def walk_ahead(self) -> rb.WalkAhead | None:
        """The invariant's walk over the framework's objects, for a repair of this rank's replication group that
        the vote in flight may decide on (the guard runs it while its vote's request waits for the others).

        It finds where the group is referenced now; after the rebinding, :meth:`rebind` reads those places back
        instead of walking again (:class:`~accelpact_slurm.repair.rebind.WalkAhead`); it also takes the guard check's
        look at the FSDP units (``idle``), which :meth:`guard_sync` then uses.  None where no walk is needed (a group
        reconfigured in place keeps its references) or where it failed (the rebinding then walks as before).
        """
        old = self.rt.replicate_group
        try:
            if old is None or tc.can_reconfigure(old):
                return None
            ahead = rb.WalkAhead(tc.framework_roots(self.model, self.rt.mesh), old)
            ahead.idle = tc.fsdp_idle(self.model, self.fsdp)  # the guard check's, of the same unchanged state
            return ahead
        except Exception:  # noqa: BLE001 - an optimisation only: the rebinding walks itself
            log.warning("the walk ahead of a repair failed; the rebinding walks after it", exc_info=True)
            return None

    def repair(self, *, frontier: int, ranks: list[int], observed: float, key: str, reason: str,
               scope: str = "replicate", optimizer: Any = None, step: int | None = None,
               agreed: list[dict[str, Any]] | None = None, ahead: rb.WalkAhead | None = None) -> RepairContext:
        """Repair at the boundary the vote decided on; every rank of the world calls this (see the module docstring).

        ``agreed``: every rank's ``{"F": frontier, "g": repairs done before this one}`` as its vote carried them,
        in rank order (:meth:`BoundaryGuard.decide`); the control barrier checks them instead of gathering them
        again.  Without them (a caller with no vote), the control barrier gathers them itself.  ``ahead``: this
        rank's :meth:`walk_ahead`, taken while the vote was in flight (used if it walked the group replaced).
        """
        ctx = RepairContext(frontier=frontier, ranks=ranks, observed=observed, key=key, reason=reason, scope=scope,
                            optimizer=optimizer, step=step, agreed=agreed, ahead=ahead)
        transitions = UPDATE_TRANSITIONS if scope == "update" else TRANSITIONS
        failed_phase = "backward" if scope == "update" else "committed"
        phase = "observe"
        t_start = time.monotonic()
        ctx.marks["start"] = t_start
        while phase != "done":
            t0 = time.monotonic()
            try:
                getattr(self, phase)(ctx)
            except FailStop as stop:
                self._abandon(ctx, phase, stop.reason)
                raise
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                self._abandon(ctx, phase, why)
                raise FailStop(f"L1 repair failed in phase {phase}: {why}", EXIT_REQUEUE,
                               phase=failed_phase, frontier=frontier, decided_at=time.monotonic(),
                               key=key) from exc
            ctx.durations[phase] = time.monotonic() - t0
            phase = transitions[phase]
        total = time.monotonic() - t_start
        self.repairs += 1
        self.events.emit("repair_rank", generation=ctx.generation, frontier=frontier, member=ctx.member,
                         rebound=sum(ctx.rebound.values()), total_s=total, rss_bytes=rss_bytes(),
                         phases=ctx.durations, parts_s=ctx.parts or None, marks=ctx.marks)
        if self.rt.rank == min(ranks):
            self.events.emit(
                "repair", generation=ctx.generation, frontier=frontier, ranks=ranks,
                rebound=sum(ctx.rebound.values()), rebound_by_kind=ctx.rebound, phases=ctx.durations,
                total_s=total, fault_to_resume_s=time.monotonic() - observed, decision="preserve", key=key,
                reason=reason, scope=scope, discarded_update=step if scope == "update" else None,
                replayed_updates=1 if scope == "update" else 0, discarded=ctx.discarded or None,
                replace_parts_s=ctx.replace_parts or None, reconfigured=ctx.in_place or None,
                parts_s=ctx.parts or None,
            )
        log.info("L1 repair generation %d at F=%d done in %.1f ms (rebound %s)", ctx.generation, frontier,
                 total * 1000, ctx.rebound)
        if self.rt.rank == 0:
            last = "validate_all" if scope == "update" else "validate"
            phases = {**ctx.lead_view.get("phases", {}), last: ctx.durations[last]}
            detail = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in phases.items())
            what = f"update {step} discarded, every group replaced; " if scope == "update" else ""
            in_place = ctx.lead_view.get("in_place") or ctx.in_place
            if in_place:
                what += f"{'+'.join(in_place)} reconfigured in place (torch's reconfigure); "
            print(f"[accelpact] L1 repair (generation {ctx.generation}) at F={frontier}, ranks {ranks}: {what}"
                  f"{ctx.lead_view.get('rebound', 0)} references rebound; {detail}; total {total * 1000:.1f} ms, "
                  f"fault to resume {time.monotonic() - observed:.2f} s", file=self.out, flush=True)
        return ctx

    # ------------------------------------------------------------------ phases

    def observe(self, ctx: RepairContext) -> None:
        """Record what failed and who is affected."""
        self.generation += 1
        ctx.generation = self.generation
        layout = self.rt.layout
        ctx.member = self.rt.rank in ctx.ranks
        ctx.members = layout.replicate_ranks(self.rt.local_rank)
        ctx.old = self.rt.replicate_group

    def guard_sync(self, ctx: RepairContext) -> None:
        """Drain the device and check that no FSDP unit is mid-step (and, after a discard, no gradient is left).

        At the committed boundary on the ranks of the group(s) to repair only (a rank outside them keeps its
        model and groups as they are, and leaves the cores to the repair's ranks), from the look at the units
        that :meth:`walk_ahead` took while the vote was in flight where there is one.

        On a GPU the failed NCCL work was aborted where its wait raised (so no kernel of it is left to wait
        for); the device is drained before the checks.
        """
        if ctx.scope != "update" and not ctx.member:  # nothing of this rank's is replaced or rebound
            return
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            torch.cuda.synchronize(self.device)
        # At the boundary, the look the walk took while the vote was in flight (nothing ran on this rank since).
        idle = getattr(ctx.ahead, "idle", None) if ctx.scope != "update" else None
        ok, why = idle if idle is not None else tc.fsdp_idle(self.model, self.fsdp)
        if not ok:
            raise RepairError(f"guard check failed: {why}")
        # At the committed boundary the update's reduced gradients are still to be stepped on: they stay.  After
        # a discard none may be left.
        pending = [n for n, p in self.model.named_parameters() if p.grad is not None] if ctx.scope == "update" else []
        if pending:
            raise RepairError(f"guard check failed: {len(pending)} outstanding gradients (e.g. {pending[0]})")

    def control_barrier(self, ctx: RepairContext) -> None:
        """Rank 0's (F, generation) must equal every rank's; then all move to the new generation.

        The (F, generation) of every rank come from the vote (``ctx.agreed``: the generation there is the
        number of repairs before this one, so this repair's is one more), which every rank holds identically:
        every rank takes the same branch, without a round trip.  Without them, one agreement gathers them.
        """
        control = self.rt.control
        if ctx.agreed is not None:
            values = [{"F": a.get("F"), "g": a["g"] + 1 if isinstance(a.get("g"), int) else a.get("g")}
                      for a in ctx.agreed]
        else:
            values = control.all_gather("repair-agree", {"F": ctx.frontier, "g": ctx.generation})
        lead = values[0]
        for r, v in enumerate(values):
            if v != lead:
                raise FailStop(
                    f"frontier/generation mismatch at repair: rank 0 has F={lead['F']} g={lead['g']}, "
                    f"rank {r} has F={v['F']} g={v['g']}",
                    EXIT_REQUEUE, phase="committed",
                    frontier=min((x["F"] for x in values if isinstance(x["F"], int)), default=ctx.frontier),
                    decided_at=time.monotonic(), key=ctx.key,
                )
        t0 = time.monotonic()
        control.set_generation(control.generation + 1)
        ctx.parts["control_barrier.generation"] = time.monotonic() - t0
        ctx.advanced = True

    def replace(self, ctx: RepairContext) -> None:
        """Members of R give the group a new transport in place where torch can (2.14.1+, Gloo), else build a
        group with identical membership under a fresh store prefix."""
        if not ctx.member:
            return
        gen = self.rt.control.generation
        if tc.can_reconfigure(ctx.old):
            if self.skip_rebind:  # the negative control: the group keeps its failed transport
                log.warning("reconfigure skipped (test-only fault injection)")
            else:
                tc.reconfigure_group(ctx.old, self.rt.control.base_store,
                                     f"accelpact/reconfigure/replicate/{self.rt.local_rank}/g{gen}", gen,
                                     self.rt.collective_timeout_s)
                self._renewed(ctx.old, gen)
            ctx.new, ctx.in_place = ctx.old, ["replicate"]
            return
        store = dist.PrefixStore(f"accelpact/replicate/{self.rt.local_rank}/g{gen}", self.rt.control.base_store)
        name = f"accelpact-replicate-{self.rt.local_rank}-g{gen}"
        ctx.new = tc.build_group(ctx.members, store, name, self.rt.collective_timeout_s, self.device)

    def rebind(self, ctx: RepairContext) -> None:
        """Every cached reference to the retired group now names the new one; none remains.

        Once the model is rebound, the validation's all-reduce on the new group is issued (it needs nothing of
        what follows) and runs while this rank checks, by walking the framework's objects, that no reference to
        the retired group is left; :meth:`validate` waits for it.
        """
        if not ctx.member or ctx.in_place:  # the same object, reconfigured: every cached reference holds
            return
        old, new = ctx.old, ctx.new
        if self.skip_rebind:
            log.warning("rebinding skipped (test-only fault injection)")
            self._replaced(ctx, Replaced(replicate_group=new))
            return
        t0 = time.monotonic()
        ctx.rebound = rb.rebind_all(self.model, self.fsdp, self.rt.mesh, 0, old, new)
        self._replaced(ctx, Replaced(replicate_group=new))
        # The validation's all-reduce on the new group needs nothing of the scan: it runs (the backend's own
        # thread) while this rank walks the framework's objects; validate waits for it.
        t1 = time.monotonic()
        ctx.check = self._start_check(ctx.new)
        t2 = time.monotonic()
        ahead, ctx.ahead = ctx.ahead, None
        if ahead is not None and ahead.old is old:  # walked while the vote was in flight: its finds read back
            left = ahead.left(lambda: tc.framework_roots(self.model, self.rt.mesh), self.rt.mesh)
            ctx.parts["rebind.walk_ahead"] = ahead.seconds  # not within this repair's time: before the vote's answer
        else:
            left = rb.find_references(tc.framework_roots(self.model, self.rt.mesh), old, self.rt.mesh)
        ctx.parts["rebind.rebind"], ctx.parts["rebind.scan"] = t1 - t0, time.monotonic() - t2
        ctx.parts["validate.check_start"] = t2 - t1
        if left:
            raise FailStop(f"rebinding invariant violated: {len(left)} reference(s) to the retired group remain, "
                           f"e.g. {left[:3]}", EXIT_REQUEUE, phase="committed", frontier=ctx.frontier,
                           decided_at=time.monotonic(), key=ctx.key)
        ctx.retired.append(old)

    def validate(self, ctx: RepairContext) -> None:
        """Integer all-reduce on the new group, then the world's release."""
        if ctx.member:
            t0 = time.monotonic()
            self._finish_check("replication", ctx.new, ctx.check or self._start_check(ctx.new))
            ctx.check = None
            ctx.parts["validate.check"] = time.monotonic() - t0
        self._release(ctx)

    def _release(self, ctx: RepairContext) -> None:
        """The world's release: one agreement in which every rank reports that its repair succeeded.

        A rank whose repair failed reported its failure there instead (:meth:`_abandon`), without waiting:
        every rank then fails stop here, none steps.  The lowest affected rank's phase timings ride along for
        rank 0's summary line.  The replaced groups are retired after it.
        """
        lead = min(ctx.ranks)
        mine: dict[str, Any] = {"ok": True}
        if self.rt.rank == lead:
            mine["view"] = {"phases": ctx.durations, "rebound": sum(ctx.rebound.values()), "in_place": ctx.in_place}
        ctx.released = True
        t0 = time.monotonic()
        ctx.marks["release_enter"] = t0
        values = self.rt.control.all_gather(RELEASE, mine)
        t1 = time.monotonic()
        ctx.parts["validate.release"] = t1 - t0
        failed = [(r, v.get("why", "?")) for r, v in enumerate(values) if not v.get("ok")]
        if failed:
            raise RepairError(f"the repair failed on rank(s) {[r for r, _ in failed]}: {failed[0][1]}")
        ctx.lead_view = values[lead].get("view") or {}
        self._retire(ctx)
        ctx.parts["validate.retire"] = time.monotonic() - t1
        ctx.marks["release_exit"] = t1

    def _abandon(self, ctx: RepairContext, phase: str, why: str) -> None:
        """This rank's repair failed in ``phase``: tell the others in the release, so they fail stop there at once.

        Only between the control barrier (before it, no rank has moved to the release's generation yet, and
        a failed agreement fails every rank alike) and this rank's own part in the release.
        """
        if not ctx.advanced or ctx.released:
            return
        ctx.released = True
        try:
            self.rt.control.contribute(RELEASE, {"ok": False, "why": f"rank {self.rt.rank}, phase {phase}: "
                                                                    f"{why.splitlines()[0][:300] if why else '?'}"})
        except Exception:  # the control plane itself is gone: the others reach the release's deadline
            log.warning("could not report the failed repair to the other ranks", exc_info=True)

    def _check_group(self, name: str, pg: dist.ProcessGroup) -> None:
        """An integer all-reduce on ``pg``: on the CPU (Gloo), and on a GPU over its NCCL communicator too."""
        self._finish_check(name, pg, self._start_check(pg))

    def _start_check(self, pg: dist.ProcessGroup) -> list[tuple[Any, torch.Tensor]]:
        """:meth:`_check_group`'s all-reduces issued (``async_op``: through the collective tap, so that on the CPU
        their waits are watched by the detector like any other); :meth:`_finish_check` waits for them (timed by the
        detector from that wait, not from their issue) and checks the sums."""
        devices = [torch.device("cpu")] + ([self.device] if self.device.type == "cuda" else [])
        out = []
        for dev in devices:
            t = torch.ones(1, dtype=torch.int64, device=dev)
            out.append((dist.all_reduce(t, group=pg, async_op=True), t))
        return out

    def _finish_check(self, name: str, pg: dist.ProcessGroup, pending: list[tuple[Any, torch.Tensor]]) -> None:
        detector = getattr(self.rt, "detector", None)
        for work, t in pending:
            if detector is not None and hasattr(detector, "timed_from_now"):  # the scan since its issue is ours
                detector.timed_from_now(work)
            work.wait()
            if int(t) != pg.size():
                raise RepairError(f"validation all-reduce on the new {name} group ({t.device.type}) gave {int(t)}, "
                                  f"expected {pg.size()}")

    def _replaced(self, ctx: RepairContext, replaced: Replaced) -> None:
        """The model is rebound to the new groups: hand them to the caller (the rank takes them over now)."""
        ctx.replaced = replaced
        if self.on_replaced is not None:
            self.on_replaced(replaced)

    def _renewed(self, pg: dist.ProcessGroup, generation: int) -> None:
        """Tell the rank's collective detector that ``pg`` runs on a new transport now (it gave the old one up)."""
        detector = getattr(self.rt, "detector", None)
        if detector is not None:
            detector.renewed(pg, generation)

    def _retire(self, ctx: RepairContext) -> None:
        """After the release: unregister the replaced groups; an NCCL communicator is aborted in the background, a
        Gloo group is held for :meth:`release_retired`."""
        for pg in ctx.retired:
            thread = tc.retire_group(pg)
            if thread is not None:  # pragma: no cover - GPU only
                self.retiring.append(thread)
            else:
                self.retired.append(pg)
        ctx.retired = []

    def release_retired(self) -> threading.Thread | None:
        """Free the retired Gloo groups on a thread of their own (it releases the GIL while Gloo's loop ticks);
        the guard calls this at the first vote that commits after a repair, when nothing of the given-up update
        holds them any more.  Returns the thread (joined by :meth:`close`), or None when none was held."""
        if not self.retired:
            return None
        held, self.retired = self.retired, []
        thread = threading.Thread(target=held.clear, name="accelpact-free-retired", daemon=True)
        del held  # the thread's list holds the last references
        thread.start()
        self.retiring.append(thread)
        return thread

    # ------------------------------------------------------------------ phases of a backward fault

    def discard(self, ctx: RepairContext) -> None:
        """Every rank drops the update: FSDP back to idle and resharded, every gradient gone."""
        if self.skip_discard:
            log.warning("discarding the update skipped (test-only fault injection)")
            return
        ctx.discarded = discard_update(self.model, ctx.optimizer, self.fsdp)

    def replace_all(self, ctx: RepairContext) -> None:
        """Both HSDP groups of this rank replaced (identical membership, fresh prefix) and rebound."""
        rt = self.rt

        def rebound(new: dict[str, Any]) -> None:
            self._replaced(ctx, Replaced(replicate_group=new["replicate"], shard_group=new["shard"]))

        res = replace_broken_groups(self.model, self.fsdp, store=rt.control.base_store,
                                    tag=f"accelpact/l1/g{rt.control.generation}", timeout_s=rt.collective_timeout_s,
                                    mesh=rt.mesh, on_rebound=rebound, retire=False, device=self.device,
                                    reconfigure_uuid=rt.control.generation)
        ctx.member, ctx.new, ctx.in_place = True, res.new, list(res.in_place)
        for dim in res.in_place:
            self._renewed(res.new[dim], rt.control.generation)
        ctx.replace_parts = dict(res.seconds)
        ctx.retired = list(res.old.values())
        ctx.rebound = dict(res.rebound)

    def validate_all(self, ctx: RepairContext) -> None:
        """Integer all-reduce on each new group, then the world's release."""
        for name, pg in ctx.new.items():
            self._check_group(name, pg)
        self._release(ctx)
