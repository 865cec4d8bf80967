"""The boundary guard: phases, the committed frontier F and the per-update vote.

Every update runs forward -> backward -> optimizer -> committed.  At the committed
boundary the guard runs one small collective on the replication group (every
replica must agree on the new frontier), then every rank of the world votes over
the control plane: its frontier, whether it saw a fault and in which phase, and
its loss.  All ranks decide from the same votes, so all stop at the same boundary
and take the same action (:func:`decide_votes`, pure).

The frontier F advances (``Run`` commits the update) only after the vote shows that
``optimizer.step`` returned on every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from accelpact_slurm.core.errors import EXIT_REQUEUE, FailStop
from accelpact_slurm.core.faults import NO_FAULTS, TestFaults
from accelpact_slurm.runtime import envelope as env_mod
from accelpact_slurm.runtime.phases import COMMITTED, Withheld

log = logging.getLogger(__name__)

CONTINUE = "continue"

@dataclass
class Vote:
    rank: int
    frontier: int
    fault: str | None  # the phase the fault was seen in, or None
    error: str | None
    loss: float | None

    @classmethod
    def from_json(cls, rank: int, d: dict[str, Any]) -> "Vote":
        return cls(rank, int(d["F"]), d.get("fault"), d.get("error"), d.get("loss"))


def decide_votes(votes: list[Vote], lookup: Callable[[str], tuple[str, str]]) -> tuple[str, str]:
    """Pure decision from every rank's vote: ``(continue | preserve | restart, reason)``.

    ``lookup(phase)`` returns the envelope's ``(action, reason)`` for a fault in ``phase``.
    """
    frontiers = {v.frontier for v in votes}
    faults = [v for v in votes if v.fault]
    if len(frontiers) > 1:
        lo = min(votes, key=lambda v: v.frontier)
        hi = max(votes, key=lambda v: v.frontier)
        return env_mod.RESTART, (f"frontier mismatch: rank {lo.rank} reports F={lo.frontier}, "
                                 f"rank {hi.rank} reports F={hi.frontier}")
    if not faults:
        return CONTINUE, "no fault"
    phases = sorted({v.fault for v in faults})
    first = faults[0]
    if phases != [COMMITTED]:
        uncommitted = [p for p in phases if p != COMMITTED][0]
        return env_mod.RESTART, (f"fault in uncommitted compute ({uncommitted}) on rank(s) "
                                 f"{[v.rank for v in faults]}: {first.error}")
    action, reason = lookup(COMMITTED)
    return action, f"communicator fault at the committed boundary on rank(s) {[v.rank for v in faults]}: {reason}"


def affected_ranks(votes: list[Vote], replicate_ranks: Callable[[int], list[int]],
                   local_of: Callable[[int], int]) -> list[int]:
    """The members of every replication group that saw a fault (pure)."""
    out: set[int] = set()
    for v in votes:
        if v.fault:
            out.update(replicate_ranks(local_of(v.rank)))
    return sorted(out)


class BoundaryGuard:
    """Decides one update on one rank; see the module docstring.

    Who calls: :class:`accelpact_slurm.runtime.api.Update` on every rank, at the end of every update
    (:meth:`finish`), in the same order.
    """

    def __init__(self, rt, events, envelope: env_mod.Envelope, key_for: Callable[[str], env_mod.Key], engine,
                 injector, faults: TestFaults = NO_FAULTS) -> None:
        self.rt = rt
        self.events = events
        self.envelope = envelope
        self.key_for = key_for
        self.engine = engine
        self.injector = injector
        self.faults = faults
        self.stop_requested = False

    def lookup(self, phase: str) -> tuple[str, str]:
        return env_mod.decide(self.envelope, self.key_for(phase))

    def finish(self, step: int, fault: str | None, error: str | None, loss: float | None,
               extra: dict[str, Any] | None = None) -> tuple[float | None, list[dict[str, Any]]]:
        """Boundary collective, vote, decision for update ``step`` (= F + 1).

        ``fault``/``error``: the phase and text of a fault this rank saw inside the update (or None).
        ``extra`` rides along in this rank's vote (the replay fingerprint).  Returns the job's mean
        loss (None when no rank reported one) and every rank's raw vote.

        Raises:
            FailStop: the decision is Restart.  After a Preserve decision the engine has repaired
                the replication group before this returns.
        """
        rt = self.rt
        frontier = step - 1 if fault else step
        if not fault:
            try:
                if self.injector.fires("boundary", step):
                    raise Withheld("boundary")
                self._boundary_collective(step)
            except Withheld:
                fault, error = COMMITTED, f"injected fault: rank {rt.rank} withheld its part in boundary of update {step}"
            except RuntimeError as exc:  # a real collective failure (Gloo timeout, closed pair)
                fault, error = COMMITTED, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        reported = frontier
        if self.faults.frontier_skew == (rt.rank, step):
            reported = frontier + 1
        observed = time.monotonic()
        if fault:
            log.warning("rank %d saw a fault in %s at update %d: %s", rt.rank, fault, step, error)
            self.events.emit("fault", phase=fault, step=step, fault_rank=rt.rank, error=error, frontier=frontier)
        from accelpact_slurm.slurm import signals

        raw = rt.control.all_gather("vote", {"F": reported, "fault": fault, "error": error, "loss": loss,
                                             "stop": signals.requested(), **(extra or {})})
        # A pre-timeout signal seen by any rank stops every rank at this same boundary.
        self.stop_requested = any(d.get("stop") for d in raw)
        votes = [Vote.from_json(r, d) for r, d in enumerate(raw)]
        action, reason = decide_votes(votes, self.lookup)
        decided = time.monotonic()
        losses = [v.loss for v in votes if v.loss is not None]
        mean = sum(losses) / len(losses) if losses else None
        if action == CONTINUE:
            return mean, raw
        phase = next((v.fault for v in votes if v.fault), COMMITTED)
        key = self.key_for(phase)
        if action == env_mod.PRESERVE:
            ranks = affected_ranks(votes, rt.layout.replicate_ranks, rt.layout.local_of)
            self.engine.repair(frontier=frontier, ranks=ranks, observed=observed, key=str(key), reason=reason)
            return mean, raw
        raise FailStop(reason, EXIT_REQUEUE, phase=phase, frontier=min(v.frontier for v in votes),
                       decided_at=decided, key=str(key))

    def _boundary_collective(self, step: int) -> None:
        """Every replica of this shard must have committed the same update."""
        t = torch.tensor([step], dtype=torch.int64)
        dist.all_reduce(t, group=self.rt.replicate_group)
        expected = step * self.rt.layout.num_nodes
        if int(t) != expected:
            raise RuntimeError(f"replicas disagree on the committed update: sum {int(t)} != {expected}")
