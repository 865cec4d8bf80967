"""A heal inside a running job: the survivors' side at the vote, and the spare's start in the dead rank's place.

When a whole node dies, its ranks stop answering; the survivors learn it at the next vote (the round cannot
complete: the detector names the ranks gone), or in the snapshot's collectives after a commit
(:func:`snapshot_after_commit`).  With ``topology.spare_nodes > 0``, instead of failing stop:

1. **Who is gone** (:func:`gone_ranks`): every survivor asks the detector which ranks will never answer again.
2. **One decision**: the survivors' lead (the lowest surviving rank) decides with
   :func:`~accelpact_slurm.core.spares.decide_heal` (exactly one whole node other than node 0, a free warm spare
   node), resolves every dead rank's per-rank packet at the survivors' frontier
   (:meth:`~accelpact_slurm.runtime.state.buddy_ring.BuddyRing.resolve`: a rank lost in the optimizer step, after
   the vote, included) and posts them, hands the spare node the place
   (:func:`~accelpact_slurm.core.spares.assign_spare`, one compare-and-set) and posts the decision under
   ``heal/decision/g<generation>``; every other survivor reads it there.  No decision (no spare left, two nodes
   lost, node 0 lost, a dead rank's per-rank state at the frontier not known): every survivor fails stop to L2 as
   before, the reason named in its stop.
3. **The heal** (:func:`~accelpact_slurm.runtime.job.healing.heal_survivor`): the update in flight is discarded
   (as L1 discards a backward fault's), the replication group rebuilt with the spare at the new generation and
   every reference FSDP cached to the old one rebound, the shard and the dead rank's per-rank packet sent, the
   certificate checked.  The control plane and the repair engine move to the new generation, where the spare's
   start joins them; the update runs again from its batch and the RNG states it began with.
4. **The spare** (:class:`SpareResume`, called by ``job.protect`` on the spare instead of a reload): the spare's
   half of the heal into the model the script built on the heal's mesh, then the run's position (frontier,
   epoch), the ``Stateful`` states and the RNG states of the dead rank; it then trains on as that rank.

Every rank of the heal writes a ``heal`` event; rank 0 and the spare print one line each.  A certificate that
fails, a group that cannot be built, a refused manifest: :class:`~accelpact_slurm.core.errors.HealError`, and the
rank fails stop (L2) with it named.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Any, Mapping, TextIO

import torch.distributed as dist

from accelpact_slurm.core.errors import EXIT_REQUEUE, AccelpactError, FailStop, HealError
from accelpact_slurm.core.faults import TestFaults
from accelpact_slurm.core.spares import Assignment, assign_spare, decide_heal, free_spare_nodes
from accelpact_slurm.repair import heal, torch_compat as tc
from accelpact_slurm.repair.discard import discard_update
from accelpact_slurm.runtime.detection import peers
from accelpact_slurm.runtime.job.healing import heal_parts, heal_spare, heal_survivor
from accelpact_slurm.runtime.job.phases import communication_fault
from accelpact_slurm.runtime.job.stopping import as_fail_stop
from accelpact_slurm.runtime.state.buddy_ring import collect, post_resolved, restore_data_state

log = logging.getLogger(__name__)


def decision_key(generation: int) -> str:
    return f"heal/decision/g{generation}"


#: How many looks at the others' records a survivor takes to see a lost node whole (its ranks die together, but
#: one may be seen alive a moment longer: it wrote once more, or marked its node peer dead, before it died).
GONE_LOOKS = 3


def gone_ranks(detector: Any, world_size: int, ranks_per_node: int) -> tuple[list[int], str]:
    """The ranks that will never answer again, as this rank's detector tells them, and the words for them.

    Looks again while the ranks seen gone are part of a node whose other ranks were still seen alive (at most
    :data:`GONE_LOOKS` looks): a lost node is seen whole, a single dead rank beside live node peers stays single."""
    gone: dict[int, Any] = {}
    for _ in range(GONE_LOOKS):
        verdict = peers.look(detector, world_size, adopt=False)
        if verdict is None:
            return [], "no detector to tell which ranks are gone"
        if verdict.kind != "gone":
            if gone:
                break
            return [], f"the other ranks are {verdict.kind}{': ' + verdict.reason if verdict.reason else ''}"
        before = set(gone)
        gone.update({v.rank: v for v in verdict.verdicts})
        nodes = {r // ranks_per_node for r in gone}
        whole = all(set(range(n * ranks_per_node, (n + 1) * ranks_per_node)) <= set(gone) for n in nodes)
        if whole or (before and set(gone) == before):
            break
    where, _how, ranks, _lost = peers.gone_names(list(gone.values()), ranks_per_node)
    return ranks, where


def adopt_world(plan: heal.HealPlan, store: Any, timeout_s: float) -> float:
    """FSDP1 only (its optimizer state dict gathers over the default group): every rank of the job, survivors and
    spares, takes a new default group over the whole world at the heal's generation; the seconds it took."""
    t0 = time.monotonic()
    tc.adopt_world(dist.PrefixStore(f"{plan.store_prefix()}/world", store), f"heal-g{plan.generation}-world",
                   timeout_s)
    return time.monotonic() - t0


def snapshot_after_commit(run: Any) -> None:
    """The snapshot rules after ``run`` committed an update (a snapshot when one is due); with spare nodes, a node
    lost in the snapshot's collectives is healed at that update (or the rank fails stop, saying why not)."""
    try:
        run._snapshots.after_commit(run.step)
    except (FailStop, RuntimeError) as exc:
        if run._healer is None or not run._healer.covers(exc):
            raise
        run._healer.heal_or_stop(as_fail_stop(exc, phase="snapshot", frontier=run.step), run.step + 1)


class SurvivorHeal:
    """The survivors' side of a heal, for one rank's run (``Run`` builds one when the job has spare nodes).

    Args:
        run: the rank's :class:`~accelpact_slurm.runtime.job.api.Run` (its model, optimizer, guard and runtime).
        key: the run's key (the transfer's manifest is signed with it).
    """

    def __init__(self, run: Any, key: bytes) -> None:
        self.run = run
        self.key = key
        #: The lead: how it resolved each dead rank's per-rank packet at the last heal (for its ``heal`` event).
        self.packets: dict[str, str] = {}
        #: The survivors' lead at the last heal (the lowest surviving rank): it writes the job-level events.
        self.lead = 0

    @staticmethod
    def covers(exc: BaseException) -> bool:
        """Whether ``exc`` may be a lost node's doing: a stop naming a rank gone, or a failed collective."""
        return exc.cause in peers.GONE_CAUSES if isinstance(exc, FailStop) else communication_fault(exc)

    def heal_or_stop(self, stop: FailStop, step: int) -> None:
        """The vote of update ``step`` failed with ``stop`` (a rank gone), or the snapshot of update ``step - 1``
        did: return once the lost node is healed (the update then runs again, or runs first); else fail the rank
        stop (L2), saying why no heal, or naming the heal that failed."""
        job = self.run.job
        try:
            healed, why = self.attempt(stop, step)
        except (AccelpactError, RuntimeError) as exc:  # the heal was decided and failed: L2, naming it
            job._fail_stop(FailStop(f"the heal after {stop.reason} failed: {type(exc).__name__}: {exc}",
                                    EXIT_REQUEUE, cause="heal", phase=stop.context.get("phase"),
                                    frontier=step - 1, decided_at=time.monotonic()))
        if not healed:
            job._fail_stop(FailStop(f"{stop.reason}; {why}", stop.exit_code, **{**stop.context, "frontier": step - 1}))

    def attempt(self, stop: FailStop, step: int) -> tuple[bool, str]:
        """After the vote of update ``step`` failed with ``stop``: heal and return ``(True, what)`` (the update then
        runs again), or return ``(False, why no heal)`` (the caller fails stop with ``stop``, saying why).

        Raises :class:`~accelpact_slurm.core.errors.HealError` when a heal was decided and failed."""
        run, job = self.run, self.run.job
        rt, cfg = job._rt, job.config
        if cfg.topology.spare_nodes <= 0 or rt.detector is None:
            return False, "no spare nodes"
        layout, frontier = rt.layout, step - 1
        generation = rt.control.generation + 1
        t0 = time.monotonic()
        dead, where = gone_ranks(rt.detector, layout.world_size, layout.ranks_per_node)
        alive = [r for r in range(layout.world_size) if r not in dead]
        self.lead = min(alive, default=0)  # the survivors' lead (rank 0 may be the one lost)
        detect_s = time.monotonic() - t0
        if not dead or rt.rank not in alive:
            return self._refused(stop, f"no heal: {where}")
        assignment, why = self._decide(dead, alive, frontier, generation)
        if assignment is None:
            return self._refused(stop, f"no heal: {why}")
        plan = heal.HealPlan(layout.num_nodes, layout.ranks_per_node, assignment.dead_node, generation, frontier)
        membership_s = time.monotonic() - t0 - detect_s
        discarded = discard_update(run._model, run._optimizer, run._wrapping[0])
        buddies = collect(rt.data_store, plan.dead_ranks(), generation)
        outcome = heal_survivor(plan, rt.rank, model=run._model, optimizer=run._optimizer, fsdp=run._wrapping[0],
                                mesh=rt.mesh if run._wrapping[1] == "device_mesh" else None,
                                replicate_group=rt.replicate_group, base_store=rt.data_store, key=self.key,
                                buddies=buddies, timeout_s=cfg.timeouts.control_s, parts=heal_parts(job._faults))
        rt.replicate_group = outcome.groups.replicate
        rt.control.set_generation(generation)
        run._guard.engine.generation = generation
        outcome.seconds.update({"detect": detect_s, "membership": membership_s})
        ok = outcome.certificate.ok if outcome.certificate is not None else None
        job.events.emit("heal", **outcome.event(), spare_node=assignment.spare_node, ranks=list(assignment.ranks),
                        step=step, discarded=discarded, gone=where,
                        **({"packets": self.packets} if rt.rank == min(alive) else {}))
        if rt.rank == min(alive):  # rank 0 may be the one lost
            moved = outcome.transfer.as_dict().get("tensor_bytes", 0) if outcome.transfer is not None else 0
            print(f"[accelpact] heal: node {plan.dead_node} lost in update {step} ({where}); spare node "
                  f"{assignment.spare_node} takes ranks {list(assignment.ranks)} at update {frontier} (generation "
                  f"{generation}): {'certified' if ok else 'certificate FAILED' if ok is False else 'rebuilt'}, "
                  f"{moved:.0f} bytes from rank {rt.rank} in {outcome.seconds.get('total', 0.0):.3f} s; update "
                  f"{step} runs again", file=job._out, flush=True)
        if outcome.certificate is not None:
            outcome.certificate.raise_if_failed()
        if run._wrapping[0] == "fsdp1":
            adopt_world(plan, rt.data_store, cfg.timeouts.control_s)
        return True, f"spare node {assignment.spare_node} took node {plan.dead_node}'s place"

    def _decide(self, dead: list[int], alive: list[int], frontier: int,
                generation: int) -> tuple[Assignment | None, str]:
        """The lead decides and posts; the others read its decision (bounded by ``timeouts.control_s``)."""
        job = self.run.job
        rt, cfg = job._rt, job.config
        store, key = rt.data_store, decision_key(generation)
        nodes, rpn, spares = rt.layout.num_nodes, rt.layout.ranks_per_node, cfg.topology.spare_nodes
        if rt.rank == min(alive):
            try:
                free = free_spare_nodes(store, nodes=nodes, ranks_per_node=rpn, spare_count=spares)
            except Exception as exc:  # noqa: BLE001 - node 0 took the store with it, and it had no standby
                return None, f"the job's store is gone: {type(exc).__name__}: {exc}"
            assignment, why = decide_heal(dead, nodes=nodes, ranks_per_node=rpn, free_nodes=free,
                                          frontier=frontier, generation=generation)
            if assignment is not None:  # every dead rank's per-rank state at the frontier known, or no heal
                why2 = self._resolve(assignment.ranks, frontier, generation)
                if why2:
                    assignment, why = None, why2
            if assignment is not None:
                ok, why2 = assign_spare(store, assignment, nodes=nodes, ranks_per_node=rpn, spare_count=spares)
                if not ok:
                    assignment, why = None, why2
            store.set(key, json.dumps({"assignment": assignment.to_json().decode() if assignment else None,
                                       "why": why, "proved": self.run._snapshots.proved,
                                       "fingerprint": frontier in self.run._snapshots.taken}))
            return assignment, why
        try:
            store.wait([key], timedelta(seconds=cfg.timeouts.control_s))
            doc = json.loads(store.get(key))
        except Exception as exc:  # noqa: BLE001 - the lead is gone too, or never decided: no heal
            return None, f"the survivors' lead (rank {min(alive)}) posted no decision: {type(exc).__name__}: {exc}"
        raw = doc.get("assignment")
        return (Assignment.from_json(raw) if raw else None), str(doc.get("why"))

    def _resolve(self, ranks: tuple[int, ...], frontier: int, generation: int) -> str:
        """The lead: every dead rank's per-rank packet at ``frontier`` from the buddy ring (this rank stands
        witness for what changes after a vote), posted for the sources; ``""``, or why one is not known."""
        packets, self.packets = {}, {}
        for rank in ranks:
            packet, how = self.run._ring.resolve(rank, frontier)
            if packet is None:
                return f"the per-rank state of rank {rank} at update {frontier} is not known: {how}"
            packets[rank], self.packets[str(rank)] = packet, how
        post_resolved(self.run.job._rt.data_store, generation, packets)
        return ""

    def _refused(self, stop: FailStop, why: str) -> tuple[bool, str]:
        log.warning("rank %d: %s; failing stop", self.run.job.rank, why)
        if self.run.job.rank == self.lead:
            self.run.job.events.emit("heal_refused", reason=why, stop=stop.reason[:300])
        return False, why


class SpareResume:
    """How ``job.protect`` takes up the state on a spare that took a dead rank's place: the spare's half of the heal
    (instead of reloading a snapshot).  Built by :func:`~accelpact_slurm.runtime.job.spare_place.take_place`."""

    def __init__(self, plan: heal.HealPlan, groups: heal.HealGroups, *, store: Any, key: bytes, timeout_s: float,
                 faults: TestFaults, out: TextIO, extra_event: Mapping[str, Any]) -> None:
        self.plan, self.groups = plan, groups
        self._store, self._key, self._timeout_s, self._faults = store, key, timeout_s, faults
        self._out, self._extra = out, dict(extra_event)
        self.outcome: Any = None

    def __call__(self, run: Any) -> None:
        plan, job = self.plan, run.job
        _, _, outcome = heal_spare(plan, job.rank, build=lambda _mesh: (run._model, run._optimizer),
                                   base_store=self._store, key=self._key, timeout_s=self._timeout_s,
                                   parts=heal_parts(self._faults), groups=self.groups)
        self.outcome = outcome
        # the survivors' snapshot client proved its capture already or not: this one decides alike (collective)
        decided = json.loads(self._store.get(decision_key(plan.generation)))
        run._snapshots.adopt_proof(bool(decided.get("proved")))
        if decided.get("fingerprint"):  # the update after a snapshot records every rank's fingerprint (replay check)
            run._snapshots.taken.add(plan.frontier)
        if run._wrapping[0] == "fsdp1" and outcome.certificate is not None and outcome.certificate.ok:
            outcome.seconds["world"] = adopt_world(plan, self._store, self._timeout_s)
        data = outcome.data_state or {}
        missing = restore_data_state(data, run._statefuls) if outcome.data_state is not None else []
        position = data.get("run") or {}
        run.step = int(position.get("step", plan.frontier))
        run.epoch = int(position.get("epoch", 0))
        cert = outcome.certificate
        ok = cert is not None and cert.ok
        job.events.emit("heal", **outcome.event(), **self._extra, state_missing=missing)
        moved = outcome.transfer.as_dict().get("tensor_bytes", 0) if outcome.transfer is not None else 0
        print(f"[accelpact] heal: rank {job.rank} of node {plan.dead_node} taken by spare node "
              f"{self._extra.get('spare_node')} at update {plan.frontier} (generation {plan.generation}): "
              f"{'certified' if ok else 'certificate FAILED'}, {moved:.0f} bytes in "
              f"{outcome.seconds.get('total', 0.0):.3f} s", file=self._out, flush=True)
        if cert is None:
            raise HealError("the heal's certificate was not taken")
        cert.raise_if_failed()
