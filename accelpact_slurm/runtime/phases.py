"""Phase tracking without the user's help: module and optimizer hooks, active only inside ``run.update()``.

forward (a forward of the protected model began) -> backward (it returned: loss and backward follow)
-> optimizer (``optimizer.step`` began) -> stepped (it returned); gradient accumulation alternates
forward and backward several times before the step.  The guard reads :attr:`PhaseTracker.phase`
when a fault surfaces and :attr:`PhaseTracker.stepped` at the end of the update.

The decision point of an update is the first ``optimizer.step`` of it (the step pre-hook calls
:attr:`PhaseTracker.decide`, set by the run): every rank votes there, before any optimizer has
stepped, so a fault anywhere in forward or backward is known to every rank while every rank still
holds the committed state.  A decision to run the update again raises :class:`Redo` out of
``optimizer.step`` (the update context swallows it and ``run.batches`` yields the same batch again).

Injected faults for tests (:class:`FaultInjector`) fire from the same hooks: ``forward`` withholds
this rank's part of the whole forward (a shard-group fault: FSDP's all-gathers), ``backward`` every
replication all-reduce FSDP issues in this update's backward (the fault of an inter-node link: its
replication peers time out in theirs, and the shard peers behind them), ``backward-all`` its part of
the whole backward (a shard-group fault first), ``boundary`` its part of the guard's own collective.
"""

from __future__ import annotations

from typing import Any, Iterable

FORWARD, BACKWARD, OPTIMIZER, COMMITTED = "forward", "backward", "optimizer", "committed"


class Withheld(Exception):
    """This rank is the injected faulting member (raised inside the update, latched by the guard)."""


#: The fault phase of an exception that is not a failed collective (always L2).
TRAINING_CODE = "training-code"
#: Words of the errors a broken peer or link gives in a collective, where torch raises a plain RuntimeError
#: (Gloo's timeouts and closed pairs); NCCL's and the c10d store's are ``torch.distributed.DistError``.
COMMUNICATION_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "timed out waiting",
                       "broken pipe", "socket timeout", "pair closure", "application timeout")


def communication_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective (a dead peer or link), not an error of the training code.

    Only a communication fault may be repaired in process: a redo of an update that failed on its own
    (a shape or device mismatch in the user's loss) would fail again the same way.
    """
    import torch.distributed as dist

    if isinstance(exc, Withheld) or type(exc).__name__ == "ReplicationWithheld":
        return True
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    if any(w in text for w in COMMUNICATION_WORDS):
        return True
    # Raised by a collective itself: the innermost Python frame is c10d's (the call into the backend).
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(
        "torch/distributed/distributed_c10d.py")


class Redo(Exception):
    """The vote decided to discard this update and run it again (raised out of ``optimizer.step``)."""


class FaultInjector:
    """Real fault injection: the chosen rank withholds its part of a collective at the chosen update."""

    def __init__(self, faults: Iterable[Any], rank: int, restart_count: int = 0) -> None:
        self._pending = {(f.phase, f.step) for f in faults if f.rank == rank and (f.always or restart_count == 0)}

    def fires(self, phase: str, step: int) -> bool:
        key = (phase, step)
        if key in self._pending:
            self._pending.discard(key)
            return True
        return False


class PhaseTracker:
    """Hooks on the protected model and optimizer; see the module docstring."""

    def __init__(self, model: Any, optimizer: Any, injector: FaultInjector | None = None, fsdp: str = "fsdp1") -> None:
        self.injector = injector
        self.model, self.fsdp = model, fsdp
        self.active = False
        self.step = 0
        self.phase = COMMITTED
        self.stepped = False
        self.forwards = 0
        self.decided = False
        #: Called at the first optimizer.step of an update (set by the run): the vote; returns the outcome.
        self.decide: Any = None
        self._withholding: Any = None
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward),
            model.register_forward_hook(self._post_forward),
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    def begin(self, step: int) -> None:
        self.active, self.step, self.phase, self.stepped, self.forwards = True, step, FORWARD, False, 0
        self.decided = False

    def end(self) -> None:
        self.active = False
        self.phase = COMMITTED
        self.stop_withholding()

    def stop_withholding(self) -> None:
        if self._withholding is not None:
            cm, self._withholding = self._withholding, None
            cm.__exit__(None, None, None)

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    # hooks: record only, except the injected faults
    def _pre_forward(self, *_: Any) -> None:
        if not self.active:
            return
        self.phase = FORWARD
        self.forwards += 1
        if self.injector is not None and self.injector.fires("forward", self.step):
            raise Withheld("forward")

    def _post_forward(self, *_: Any) -> None:
        if not self.active:
            return
        self.phase = BACKWARD
        if self.injector is None:
            return
        if self.injector.fires("backward-all", self.step):
            raise Withheld("backward")
        if self._withholding is None and self.injector.fires("backward", self.step):
            from accelpact_slurm.repair.discard import withhold_replication

            self._withholding = withhold_replication(self.model, self.fsdp)
            self._withholding.__enter__()

    def _pre_step(self, *_: Any) -> None:
        if not self.active:
            return
        self.phase = OPTIMIZER
        if not self.decided and self.decide is not None:
            self.decided = True
            if self.decide() == "redo":
                raise Redo()

    def _post_step(self, *_: Any) -> None:
        if self.active:
            self.stepped = True
