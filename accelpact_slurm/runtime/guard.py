"""The boundary guard: phases, the committed frontier F and the per-update vote.

Every update runs forward -> backward -> optimizer -> committed.  At the committed
boundary the guard runs one small collective on the replication group (every
replica must agree on the new frontier), then every rank of the world votes over
the control plane: its frontier, whether it saw a fault and in which phase, and
its loss.  All ranks decide from the same votes, so all stop at the same boundary
and take the same action (:func:`decide_votes`, pure).

The frontier F advances (``Trainer.commit``) only after the vote shows that
``optimizer.step`` returned on every rank.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from accelpact_slurm.runtime import envelope as env_mod
from accelpact_slurm.core.config import JobConfig, FaultSpec
from accelpact_slurm.core.errors import EXIT_REQUEUE, FailStop

log = logging.getLogger(__name__)

FORWARD, BACKWARD, OPTIMIZER, COMMITTED = "forward", "backward", "optimizer", "committed"
CONTINUE = "continue"

#: Test-only switch: ``RANK:STEP`` makes RANK report a frontier one ahead at update STEP.
TEST_FRONTIER_SKEW = "ACCELPACT_TEST_FRONTIER_SKEW"


class FaultInjector:
    """Real fault injection: the chosen rank withholds its part of a collective."""

    def __init__(self, faults: tuple[FaultSpec, ...], rank: int, restart_count: int = 0) -> None:
        self._pending = {(f.phase, f.step) for f in faults
                         if f.rank == rank and (f.always or restart_count == 0)}

    def fires(self, phase: str, step: int) -> bool:
        key = (phase, step)
        if key in self._pending:
            self._pending.discard(key)
            return True
        return False


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
    """Runs one guarded update on one rank; see the module docstring."""

    def __init__(self, cfg: JobConfig, trainer, events, envelope: env_mod.Envelope, key_for: Callable[[str], env_mod.Key],
                 engine) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.rt = trainer.rt
        self.events = events
        self.envelope = envelope
        self.key_for = key_for
        self.engine = engine
        self.phase = COMMITTED
        self.stop_requested = False
        self.injector = FaultInjector(cfg.faults, self.rt.rank, self.rt.ctx.restart_count)
        skew = os.environ.get(TEST_FRONTIER_SKEW, "")
        self._skew = tuple(int(x) for x in skew.split(":")) if skew else None

    def lookup(self, phase: str) -> tuple[str, str]:
        return env_mod.decide(self.envelope, self.key_for(phase))

    def run_update(self) -> float:
        """Forward, backward, optimizer, boundary check and vote; returns the job's mean loss.

        Raises FailStop when the decision is Restart.  After a Preserve decision the
        engine has repaired the replication group before this returns.
        """
        tr, rt = self.trainer, self.rt
        frontier = tr.progress.step
        step = frontier + 1
        fault: str | None = None
        error: str | None = None
        loss_value: float | None = None
        try:
            self.phase = FORWARD
            if self.injector.fires("forward", step):
                raise _Withheld("forward")
            tr.model.train()
            from accelpact_slurm.workload.trainer import lm_loss

            loss = lm_loss(tr.model, tr.batch())
            loss_value = float(loss.detach())
            self.phase = BACKWARD
            if self.injector.fires("backward", step):
                raise _Withheld("backward")
            loss.backward()
            self.phase = OPTIMIZER
            tr.optimizer_step()
            frontier = step
            self.phase = COMMITTED
            if self.injector.fires("boundary", step):
                raise _Withheld("boundary")
            self._boundary_collective(step)
        except _Withheld as w:
            fault, error = self.phase, f"injected fault: rank {rt.rank} withheld its part in {w.args[0]} of update {step}"
        except RuntimeError as exc:  # a real collective failure (Gloo timeout, closed pair)
            fault, error = self.phase, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        reported = frontier
        if self._skew and self._skew == (rt.rank, step):
            reported = frontier + 1
        observed = time.monotonic()
        if fault:
            log.warning("rank %d saw a fault in %s at update %d: %s", rt.rank, fault, step, error)
            self.events.emit("fault", phase=fault, step=step, fault_rank=rt.rank, error=error, frontier=frontier)
        from accelpact_slurm.slurm import signals

        raw = rt.control.all_gather("vote", {"F": reported, "fault": fault, "error": error, "loss": loss_value,
                                             "stop": signals.requested()})
        # A pre-timeout signal seen by any rank stops every rank at this same boundary.
        self.stop_requested = any(d.get("stop") for d in raw)
        votes = [Vote.from_json(r, d) for r, d in enumerate(raw)]
        action, reason = decide_votes(votes, self.lookup)
        decided = time.monotonic()
        if action == CONTINUE:
            return sum(v.loss for v in votes) / len(votes)
        phase = next((v.fault for v in votes if v.fault), COMMITTED)
        key = self.key_for(phase)
        if action == env_mod.PRESERVE:
            ranks = affected_ranks(votes, rt.layout.replicate_ranks, rt.layout.local_of)
            self.engine.repair(frontier=frontier, ranks=ranks, observed=observed, key=str(key), reason=reason)
            return sum(v.loss for v in votes) / len(votes)
        raise FailStop(reason, EXIT_REQUEUE, phase=phase, frontier=min(v.frontier for v in votes),
                       decided_at=decided, key=str(key))

    def _boundary_collective(self, step: int) -> None:
        """Every replica of this shard must have committed the same update."""
        t = torch.tensor([step], dtype=torch.int64)
        dist.all_reduce(t, group=self.rt.replicate_group)
        expected = step * self.rt.layout.num_nodes
        if int(t) != expected:
            raise RuntimeError(f"replicas disagree on the committed update: sum {int(t)} != {expected}")


class _Withheld(Exception):
    """Internal: this rank is the injected faulting member."""
