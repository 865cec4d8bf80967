"""The guard: phases, the committed frontier F and the per-update vote.

Every update runs forward -> backward -> (decision) -> optimizer -> committed.  The decision is taken once per
update, before any optimizer steps: at its first ``optimizer.step`` (the pre-hook), or at its end when it raised or
never stepped.  There the guard runs one small collective on the replication group (every replica at the same
frontier; the group alive after backward), then every rank votes over the control plane (frontier, generation,
fault and phase, loss), and all decide from the same votes (:func:`decide_votes`, pure), as in a two-phase commit:

- no fault: every rank steps and the update commits (F advances);
- a fault at the guard's own collective (``committed``) where the envelope allows Preserve: the replication group is
  repaired, then every rank steps on the gradients it has;
- a fault in ``backward`` where the envelope allows Preserve: every rank discards the update, every group is replaced
  and rebound, and the update runs again from its batch and the RNG states it began with;
- an error of the training code (not a failed collective) on any rank: every rank stops, not requeued (:data:`STOP`);
- anything else (forward, the optimizer step, an unqualified key, a frontier mismatch, a batch not from
  ``run.batches``): fail stop, L2.

No rank steps while a peer's update failed.  A rank whose optimizer step raised (after the vote) votes again with
the old frontier, and the others' next vote fails every rank stop on the mismatch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_REQUEUE, FailStop
from accelpact_slurm.core.faults import NO_FAULTS, TestFaults
from accelpact_slurm.core.rank import GuardRank
from accelpact_slurm.runtime.job import envelope as env_mod
from accelpact_slurm.runtime.job.phases import BACKWARD, COMMITTED, TRAINING_CODE, Withheld
from accelpact_slurm.slurm import signals

log = logging.getLogger(__name__)

CONTINUE = "continue"
REDO = "redo"
#: The training code raised: every rank stops, and the job is not requeued.
STOP = "stop"
#: How many times one update may be discarded and run again in a row before the job restarts instead.
MAX_REDOS = 3

@dataclass
class Vote:
    rank: int
    frontier: int
    fault: str | None  # the phase the fault was seen in, or None
    error: str | None
    loss: float | None
    exception: dict[str, Any] | None = None  # a training-code error: type, message, file, line, function

    @classmethod
    def from_json(cls, rank: int, d: dict[str, Any]) -> "Vote":
        exc = d.get("exc")
        return cls(rank, int(d["F"]), d.get("fault"), d.get("error"), d.get("loss"),
                   exc if isinstance(exc, dict) else None)


def summarize_votes(raw: list[dict[str, Any]]) -> dict[str, Any]:
    """What the decision needs of every rank's vote, in a size that does not grow with the ranks (pure).

    The round's lead computes it once (:meth:`~accelpact_slurm.runtime.transport.control.ControlPlane.all_reduce`);
    every rank decides from it exactly as from every vote: the votes of the lowest and the highest frontier (the lowest
    rank of each) and of every rank that saw a fault, the any-stop and all-redoable flags, the mean loss (summed in
    rank order), rank 0's (F, generation) and the first rank that differs from it, and the replay fingerprints
    (only in the votes that carry them: the update after a snapshot or a load)."""
    fs = [int(d["F"]) for d in raw]
    lo = min(range(len(raw)), key=lambda r: (fs[r], r))
    hi = max(range(len(raw)), key=lambda r: (fs[r], -r))
    keep = sorted({lo, hi, *(r for r, d in enumerate(raw) if d.get("fault"))})
    losses = [d.get("loss") for d in raw if d.get("loss") is not None]
    pairs = [{"F": d["F"], "g": d.get("g")} for d in raw]
    diff = next(([r, p] for r, p in enumerate(pairs) if p != pairs[0]), None)
    fps = [d.get("fp") for d in raw] if any("fp" in d for d in raw) else None
    return {"n": len(raw), "votes": [[r, {k: v for k, v in raw[r].items() if k != "fp"}] for r in keep],
            "stop": any(d.get("stop") for d in raw), "redo": all(d.get("redo", True) for d in raw),
            "mean": sum(losses) / len(losses) if losses else None, "agreed": [pairs[0], diff], "fps": fps}


def decide_votes(votes: list[Vote], lookup: Callable[[str], tuple[str, str]],
                 redoable: bool = True, bugs_stop: bool = True) -> tuple[str, str]:
    """Pure decision from every rank's vote: ``(continue | preserve | redo's preserve | restart | stop, reason)``.

    ``lookup(phase)`` returns the envelope's ``(action, reason)`` for a fault in ``phase``;
    ``redoable``: every rank's update can run again (its batch came from ``run.batches``).  An error of the
    training code on any rank decides first: a restart would run into it again (``bugs_stop=False``: it is
    restarted like any fault in uncommitted compute, the negative control).
    """
    frontiers = {v.frontier for v in votes}
    faults = [v for v in votes if v.fault]
    bugs = [v for v in faults if v.fault == TRAINING_CODE]
    if bugs and bugs_stop:
        return STOP, training_code_reason(bugs[0], len(bugs))
    if len(frontiers) > 1:
        lo = min(votes, key=lambda v: v.frontier)
        hi = max(votes, key=lambda v: v.frontier)
        return env_mod.RESTART, (f"frontier mismatch: rank {lo.rank} reports F={lo.frontier}, "
                                 f"rank {hi.rank} reports F={hi.frontier}")
    if not faults:
        return CONTINUE, "no fault"
    phases = sorted({v.fault for v in faults})
    first = faults[0]
    ranks = [v.rank for v in faults]
    if phases == [COMMITTED]:
        action, reason = lookup(COMMITTED)
        return action, f"communicator fault at the committed boundary on rank(s) {ranks}: {reason}"
    if not set(phases) <= {COMMITTED, BACKWARD}:
        uncommitted = [p for p in phases if p not in (COMMITTED, BACKWARD)][0]
        return env_mod.RESTART, (f"fault in uncommitted compute ({uncommitted}) on rank(s) {ranks}: {first.error}")
    action, reason = lookup(BACKWARD)
    if action != env_mod.PRESERVE:
        return env_mod.RESTART, (f"fault in uncommitted compute (backward) on rank(s) {ranks}: {first.error}; "
                                 f"{reason}")
    if not redoable:
        return env_mod.RESTART, (f"fault in backward on rank(s) {ranks}, but the update cannot run again: its batch "
                                 f"did not come from run.batches")
    return action, f"fault in backward on rank(s) {ranks} ({first.error}): {reason}; the update runs again"


def training_code_reason(vote: Vote, count: int = 1) -> str:
    """``training code raised on rank 1: ValueError: boom (train.py:42, in loss_fn)``: one line (pure)."""
    exc = vote.exception or {}
    where = f" ({exc.get('file')}:{exc.get('line')}, in {exc.get('function')})" if exc.get("file") else ""
    what = f"{exc.get('type')}: {exc.get('message')}" if exc.get("type") else (vote.error or "an error")
    more = f" (and on {count - 1} other rank(s))" if count > 1 else ""
    return f"training code raised on rank {vote.rank}{more}: {what}{where}; not requeued: fix the code and resubmit"


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

    Who calls: :class:`accelpact_slurm.runtime.job.api.Run` on every rank, at the decision point of every
    update (:meth:`decide`), in the same order.  ``rt``: the rank as the guard reads it
    (:class:`~accelpact_slurm.core.rank.GuardRank`).
    """

    def __init__(self, rt: GuardRank, events, envelope: env_mod.Envelope, key_for: Callable[[str], env_mod.Key], engine,
                 injector, faults: TestFaults = NO_FAULTS) -> None:
        self.rt = rt
        self.events = events
        self.envelope = envelope
        self.key_for = key_for
        self.engine = engine
        self.injector = injector
        self.faults = faults
        self.stop_requested = False
        self._redos: dict[int, int] = {}  # update -> times it was discarded and run again in a row

    def lookup(self, phase: str) -> tuple[str, str]:
        return env_mod.decide(self.envelope, self.key_for(phase))

    def decide(self, step: int, fault: str | None, error: str | None, loss: float | None,
               extra: dict[str, Any] | None = None, *, redoable: bool = True,
               optimizer: Any = None, exception: dict[str, Any] | None = None
               ) -> tuple[str, float | None, list[str | None]]:
        """Boundary collective, vote, decision for update ``step`` (= F + 1), before any optimizer stepped.

        ``fault``/``error``: the phase and text of a fault this rank saw inside the update (or None); ``exception``: a
        training-code error's description (:func:`accelpact_slurm.runtime.job.phases.describe_exception`). ``extra``
        rides along in this rank's vote (the replay fingerprint).  Returns
        ``(outcome, the job's mean loss or None, every rank's replay fingerprint or None)``; ``outcome`` is
        ``continue`` (step and commit) or ``redo`` (the update was discarded and every group repaired: run it again).

        Raises:
            FailStop: the decision is Restart.  After a Preserve decision the engine has repaired
                the group(s) before this returns.
        """
        rt = self.rt
        frontier = step - 1
        if not fault:
            try:
                if self.injector.fires("boundary", frontier):  # boundary:STEP: the boundary after update STEP
                    raise Withheld("boundary")
                if self.injector.fires("boundary-stuck", frontier):  # stays in the collective; its part never arrives
                    rt.detector.stall_next("replicate")
                self._boundary_collective(frontier)
            except Withheld:
                fault, error = COMMITTED, (f"injected fault: rank {rt.rank} withheld its part in the boundary after update "
                                           f"{frontier}")
            except FailStop:  # the detector: a member of the group is dead, hung or stopped
                raise
            except RuntimeError as exc:  # a real collective failure (Gloo timeout, closed pair, the detector)
                fault, error = COMMITTED, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                if getattr(rt, "detector", None) is not None:
                    rt.detector.take_latched()  # reported here, in this vote
        reported = self.faults.reported_frontier(rt.rank, step, frontier)
        observed = time.monotonic()
        if fault:
            log.warning("rank %d saw a fault in %s at update %d: %s", rt.rank, fault, step, error)
            detector = getattr(rt, "detector", None)
            seen_at = getattr(detector, "given_up_at", None)  # the detector's verdict, before the error unwound
            if seen_at is not None:
                detector.given_up_at = None
            self.events.emit("fault", phase=fault, step=step, fault_rank=rt.rank, error=error, frontier=frontier,
                             **({"detected_ts": seen_at} if seen_at is not None else {}))

        mine = {"F": reported, "g": self.engine.generation, "fault": fault, "error": error, "loss": loss,
                "stop": signals.requested(), "redo": redoable, **(extra or {})}
        if exception:
            mine["exc"] = {k: exception.get(k) for k in ("type", "message", "file", "line", "function")}
        # A rank whose group broke at the boundary walks the framework's objects for the repair's invariant while
        # its vote is in flight (the repair then reads the walk's finds back instead of walking: off its path).
        ahead: list[Any] = []
        walk = getattr(self.engine, "walk_ahead", None) if fault == COMMITTED else None
        self.faults.kill_node_at("vote", step, rt.layout.node_of(rt.rank))
        summary = rt.control.all_reduce("vote", mine, summarize_votes,
                                        **({"meanwhile": lambda: ahead.append(walk())} if walk else {}))  # type: ignore[arg-type]
        # A pre-timeout signal seen by any rank stops every rank at this same boundary.
        self.stop_requested = bool(summary["stop"])
        votes = [Vote.from_json(r, d) for r, d in summary["votes"]]
        action, reason = decide_votes(votes, self.lookup, summary["redo"], bugs_stop=not self.faults.bug_restarts)
        decided = time.monotonic()
        mean = summary["mean"]
        fps = summary["fps"] or [None] * summary["n"]
        if action == CONTINUE:
            # The groups a repair replaced are freed off this thread, now that no frame of a given-up update holds
            # them (a frame that let go last would free them here, ~10 ms per Gloo pair).
            self.engine.release_retired()
            return CONTINUE, mean, fps
        if action == STOP:
            culprit = next(v for v in votes if v.fault == TRAINING_CODE)
            mine = exception if culprit.rank == rt.rank and exception else culprit.exception  # its own: the traceback
            raise FailStop(reason, EXIT_NO_REQUEUE, cause="training-code", phase=TRAINING_CODE, frontier=frontier,
                           decided_at=decided, rank=culprit.rank, exception=mine)
        phases = {v.fault for v in votes if v.fault}
        # The phase that decided: any other than the two repairable ones, else backward, else the boundary.
        others = sorted(phases - {BACKWARD, COMMITTED})
        phase = others[0] if others else BACKWARD if BACKWARD in phases else COMMITTED
        key = self.key_for(phase)
        # The repair's control barrier checks every rank's (F, generation) on the vote's data: no round trip.
        first, diff = summary["agreed"]
        agreed = [first] * summary["n"]
        if diff is not None:
            agreed[diff[0]] = diff[1]
        if action == env_mod.PRESERVE:
            ranks = affected_ranks(votes, rt.layout.replicate_ranks, rt.layout.local_of)
            if phase == BACKWARD:
                redos = self._redos.get(step, 0) + 1
                if redos > MAX_REDOS:  # the same on every rank: all took the same branches before
                    raise FailStop(f"update {step} was discarded {MAX_REDOS} times in a row and failed again in "
                                   f"backward ({reason}): a fault that recurs is a restart's business",
                                   EXIT_REQUEUE, cause="link", phase=phase, frontier=frontier, decided_at=decided,
                                   key=str(key))
                self._redos = {step: redos}
                self.engine.repair(frontier=frontier, ranks=list(range(rt.layout.world_size)), observed=observed,
                                   key=str(key), reason=reason, scope="update", optimizer=optimizer, step=step,
                                   agreed=agreed)
                return REDO, None, fps
            self.engine.repair(frontier=frontier, ranks=ranks, observed=observed, key=str(key), reason=reason,
                               agreed=agreed, **({"ahead": ahead[0]} if ahead and ahead[0] is not None else {}))
            return CONTINUE, mean, fps
        raise FailStop(reason, EXIT_REQUEUE, cause="link", phase=phase, frontier=min(v.frontier for v in votes),
                       decided_at=decided, key=str(key))

    def _boundary_collective(self, frontier: int) -> None:
        """Every replica of this shard must be at the same committed frontier (and the group alive)."""
        device = getattr(self.rt, "device", None)
        if device is not None and device.type == "cuda":  # pragma: no cover - GPU only
            # Over NCCL, queued behind FSDP's replication all-reduce on the same communicator: a withheld or
            # stuck one surfaces here, as the wait's timeout raising in this thread (which aborts the work's
            # communicator), instead of a kernel that never ends.
            t = torch.tensor([frontier], dtype=torch.int64, device=device)
            work = dist.all_reduce(t, group=self.rt.replicate_group, async_op=True)
            detector = getattr(self.rt, "detector", None)
            if detector is not None:
                detector.wait_device(work, self.rt.replicate_group, self.rt.collective_timeout_s)
            else:
                work.wait(timedelta(seconds=self.rt.collective_timeout_s))
            t = t.cpu()
        else:
            t = torch.tensor([frontier], dtype=torch.int64)
            dist.all_reduce(t, group=self.rt.replicate_group)
        expected = frontier * self.rt.layout.num_nodes
        if int(t) != expected:
            raise RuntimeError(f"replicas disagree on the committed update: sum {int(t)} != {expected}")
