"""The six-phase L1 Preserve repair engine.

One driver (:meth:`RepairEngine.repair`), one method per phase, one transition
table.  Every rank of the world runs the driver at the same boundary (the vote
made them agree); the ranks of the affected replication group(s) R replace and
rebind, the others take part in the barriers only.

    observe -> guard_sync -> control_barrier -> replace -> rebind -> validate -> done

That is the repair of a fault at the committed boundary (``scope="replicate"``: the replication
group(s) of the faulted ranks).  A fault in backward (``scope="update"``) leaves FSDP mid-flight and
possibly every group of the mesh dead; every rank then runs

    observe -> discard -> guard_sync -> control_barrier -> replace_all -> validate_all -> done

(:mod:`accelpact_slurm.repair.discard`: the update dropped, both HSDP groups replaced and rebound on
every rank), and the caller runs the update again.

Any exception in a phase becomes a fail-stop (``FailStop``, "requeue me"):
L1 never continues on a state it could not validate.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from accelpact_slurm.core.errors import EXIT_REQUEUE, FailStop, RepairError
from accelpact_slurm.repair import rebind as rb
from accelpact_slurm.repair import torch_compat as tc

log = logging.getLogger(__name__)

PHASES = ("observe", "guard_sync", "control_barrier", "replace", "rebind", "validate")
TRANSITIONS: dict[str, str] = {
    "observe": "guard_sync",
    "guard_sync": "control_barrier",
    "control_barrier": "replace",
    "replace": "rebind",
    "rebind": "validate",
    "validate": "done",
}
UPDATE_PHASES = ("observe", "discard", "guard_sync", "control_barrier", "replace_all", "validate_all")
UPDATE_TRANSITIONS: dict[str, str] = {
    "observe": "discard",
    "discard": "guard_sync",
    "guard_sync": "control_barrier",
    "control_barrier": "replace_all",
    "replace_all": "validate_all",
    "validate_all": "done",
}


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


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class RepairEngine:
    """Owns the repair of one rank.

    ``model`` is the user's wrapped model (FSDP1 or FSDP2; the flavour is read from it), ``rt`` the
    rank's runtime (``rank``, ``local_rank``, ``layout``, ``control``, ``replicate_group``, ``mesh``,
    ``collective_timeout_s``: a fake one in the phase tests), ``events`` the event log.
    ``skip_rebind`` is the negative control of the rebinding tests (never set in production).
    """

    def __init__(self, model, rt, events, *, fsdp: str, skip_rebind: bool = False, skip_discard: bool = False,
                 out=None) -> None:
        self.model = model
        self.rt = rt
        self.events = events
        self.fsdp = fsdp
        self.skip_rebind = skip_rebind
        self.skip_discard = skip_discard
        self.out = out
        self.generation = 0
        self.repairs = 0
        self.retiring: list[Any] = []  # background aborts of retired NCCL communicators (joined by close)

    @property
    def device(self) -> torch.device:
        """The rank's training device (new groups get an NCCL communicator there when it is a GPU)."""
        return getattr(self.rt, "device", None) or torch.device("cpu")

    def close(self, deadline_s: float = 10.0) -> int:
        """Wait up to ``deadline_s`` for the background retirements; return how many are still running."""
        end = time.monotonic() + deadline_s
        for t in self.retiring:
            t.join(max(0.0, end - time.monotonic()))
        self.retiring = [t for t in self.retiring if t.is_alive()]
        return len(self.retiring)

    # ------------------------------------------------------------------ driver

    def repair(self, *, frontier: int, ranks: list[int], observed: float, key: str, reason: str,
               scope: str = "replicate", optimizer: Any = None, step: int | None = None) -> RepairContext:
        ctx = RepairContext(frontier=frontier, ranks=ranks, observed=observed, key=key, reason=reason, scope=scope,
                            optimizer=optimizer, step=step)
        transitions = UPDATE_TRANSITIONS if scope == "update" else TRANSITIONS
        failed_phase = "backward" if scope == "update" else "committed"
        phase = "observe"
        t_start = time.monotonic()
        while phase != "done":
            t0 = time.monotonic()
            try:
                getattr(self, phase)(ctx)
            except FailStop:
                raise
            except Exception as exc:
                raise FailStop(f"L1 repair failed in phase {phase}: {type(exc).__name__}: {exc}", EXIT_REQUEUE,
                               phase=failed_phase, frontier=frontier, decided_at=time.monotonic(),
                               key=key) from exc
            ctx.durations[phase] = time.monotonic() - t0
            phase = transitions[phase]
        total = time.monotonic() - t_start
        self.repairs += 1
        self.events.emit("repair_rank", generation=ctx.generation, frontier=frontier, member=ctx.member,
                         rebound=sum(ctx.rebound.values()), total_s=total, rss_bytes=rss_bytes())
        if self.rt.rank == min(ranks):
            self.events.emit(
                "repair", generation=ctx.generation, frontier=frontier, ranks=ranks,
                rebound=sum(ctx.rebound.values()), rebound_by_kind=ctx.rebound, phases=ctx.durations,
                total_s=total, fault_to_resume_s=time.monotonic() - observed, decision="preserve", key=key,
                reason=reason, scope=scope, discarded_update=step if scope == "update" else None,
                replayed_updates=1 if scope == "update" else 0, discarded=ctx.discarded or None,
            )
        log.info("L1 repair generation %d at F=%d done in %.1f ms (rebound %s)", ctx.generation, frontier,
                 total * 1000, ctx.rebound)
        if self.rt.rank == 0:
            last = "validate_all" if scope == "update" else "validate"
            phases = {**ctx.lead_view.get("phases", {}), last: ctx.durations[last]}
            detail = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in phases.items())
            what = f"update {step} discarded, every group replaced; " if scope == "update" else ""
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

        On a GPU the failed NCCL work was aborted where its wait raised (so no kernel of it is left to wait
        for); the device is drained before the checks.
        """
        if self.device.type == "cuda":  # pragma: no cover - GPU only
            torch.cuda.synchronize(self.device)
        ok, why = tc.fsdp_idle(self.model, self.fsdp)
        if not ok:
            raise RepairError(f"guard check failed: {why}")
        # At the committed boundary the update's reduced gradients are still to be stepped on: they stay.  After
        # a discard none may be left.
        pending = [n for n, p in self.model.named_parameters() if p.grad is not None] if ctx.scope == "update" else []
        if pending:
            raise RepairError(f"guard check failed: {len(pending)} outstanding gradients (e.g. {pending[0]})")

    def control_barrier(self, ctx: RepairContext) -> None:
        """Rank 0's (F, generation) must equal every rank's; then all move to the new generation."""
        control = self.rt.control
        mine = {"F": ctx.frontier, "g": ctx.generation}
        values = control.all_gather("repair-agree", mine)
        lead = values[0]
        for r, v in enumerate(values):
            if v != lead:
                raise FailStop(
                    f"frontier/generation mismatch at repair: rank 0 has F={lead['F']} g={lead['g']}, "
                    f"rank {r} has F={v['F']} g={v['g']}",
                    EXIT_REQUEUE, phase="committed", frontier=min(x["F"] for x in values),
                    decided_at=time.monotonic(), key=ctx.key,
                )
        control.set_generation(control.generation + 1)

    def replace(self, ctx: RepairContext) -> None:
        """Members of R build a group with identical membership under a fresh store prefix."""
        if not ctx.member:
            return
        gen = self.rt.control.generation
        store = dist.PrefixStore(f"accelpact/replicate/{self.rt.local_rank}/g{gen}", self.rt.control.base_store)
        name = f"accelpact-replicate-{self.rt.local_rank}-g{gen}"
        ctx.new = tc.build_group(ctx.members, store, name, self.rt.collective_timeout_s, self.device)

    def rebind(self, ctx: RepairContext) -> None:
        """Every cached reference to the retired group now names the new one; none remains."""
        if not ctx.member:
            return
        old, new = ctx.old, ctx.new
        if self.skip_rebind:
            log.warning("rebinding skipped (test-only fault injection)")
            self.rt.replicate_group = new
            return
        ctx.rebound = rb.rebind_all(self.model, self.fsdp, self.rt.mesh, 0, old, new)
        self.rt.replicate_group = new
        left = rb.find_references(tc.framework_roots(self.model, self.rt.mesh), old, self.rt.mesh)
        if left:
            raise FailStop(f"rebinding invariant violated: {len(left)} reference(s) to the retired group remain, "
                           f"e.g. {left[:3]}", EXIT_REQUEUE, phase="committed", frontier=ctx.frontier,
                           decided_at=time.monotonic(), key=ctx.key)
        ctx.retired.append(old)

    def validate(self, ctx: RepairContext) -> None:
        """Integer all-reduce on the new group, then the world's release barrier."""
        if ctx.member:
            self._check_group("replication", ctx.new)
        view = self.rt.control.all_gather("repair-release", {"phases": ctx.durations,
                                                             "rebound": sum(ctx.rebound.values())})
        ctx.lead_view = view[min(ctx.ranks)]
        self._retire(ctx)

    def _check_group(self, name: str, pg: dist.ProcessGroup) -> None:
        """An integer all-reduce on ``pg``: on the CPU (Gloo), and on a GPU over its NCCL communicator too."""
        devices = [torch.device("cpu")] + ([self.device] if self.device.type == "cuda" else [])
        for dev in devices:
            t = torch.ones(1, dtype=torch.int64, device=dev)
            dist.all_reduce(t, group=pg)
            if int(t) != pg.size():
                raise RepairError(f"validation all-reduce on the new {name} group ({dev.type}) gave {int(t)}, "
                                  f"expected {pg.size()}")

    def _retire(self, ctx: RepairContext) -> None:
        """After the release: unregister the replaced groups; an NCCL communicator is aborted in the background."""
        for pg in ctx.retired:
            thread = tc.retire_group(pg)
            if thread is not None:  # pragma: no cover - GPU only
                self.retiring.append(thread)
        ctx.retired = []

    # ------------------------------------------------------------------ phases of a backward fault

    def discard(self, ctx: RepairContext) -> None:
        """Every rank drops the update: FSDP back to idle and resharded, every gradient gone."""
        from accelpact_slurm.repair.discard import discard_update

        if self.skip_discard:
            log.warning("discarding the update skipped (test-only fault injection)")
            return
        ctx.discarded = discard_update(self.model, ctx.optimizer, self.fsdp)

    def replace_all(self, ctx: RepairContext) -> None:
        """Both HSDP groups of this rank replaced (identical membership, fresh prefix) and rebound."""
        from accelpact_slurm.repair.discard import replace_broken_groups

        rt = self.rt

        def rebound(new: dict[str, Any]) -> None:
            rt.replicate_group, rt.shard_group = new["replicate"], new["shard"]

        res = replace_broken_groups(self.model, self.fsdp, store=rt.control.base_store,
                                    tag=f"accelpact/l1/g{rt.control.generation}", timeout_s=rt.collective_timeout_s,
                                    mesh=rt.mesh, on_rebound=rebound, retire=False, device=self.device)
        ctx.member, ctx.new = True, res.new
        ctx.retired = list(res.old.values())
        ctx.rebound = dict(res.rebound)

    def validate_all(self, ctx: RepairContext) -> None:
        """Integer all-reduce on each new group, then the world's release barrier."""
        for name, pg in ctx.new.items():
            self._check_group(name, pg)
        view = self.rt.control.all_gather("repair-release", {"phases": ctx.durations,
                                                             "rebound": sum(ctx.rebound.values())})
        ctx.lead_view = view[min(ctx.ranks)]
        self._retire(ctx)
