"""Phase tracking without the user's help: module and optimizer hooks, active only inside ``run.update()``.

forward (a forward of the protected model began) -> backward (it returned) -> optimizer (``optimizer.step`` began)
-> stepped (it returned); gradient accumulation alternates forward and backward before the step.  The guard reads
:attr:`PhaseTracker.phase` when a fault surfaces and :attr:`PhaseTracker.stepped` at the end of the update.

The decision point of an update is its first ``optimizer.step`` (the step pre-hook calls :attr:`PhaseTracker.decide`):
every rank votes there, before any optimizer stepped, so a fault anywhere in forward or backward is known to every
rank while every rank still holds the committed state.  A decision to run the update again raises :class:`Redo` out
of ``optimizer.step`` (the update context swallows it, ``run.batches`` yields the same batch again); a
``BaseException``, so a script's ``except Exception`` around the step cannot swallow it.

Injected faults (:class:`FaultInjector`) fire from the same hooks: ``forward`` withholds this rank's part of the whole
forward (a shard-group fault), ``backward`` every replication all-reduce of this update's backward (an inter-node
link), ``backward-all`` its part of the whole backward, ``boundary`` its part of the guard's collective;
``backward-stuck`` and ``boundary-stuck`` keep the rank inside the replication collective while its part never
arrives (a stalled link, :meth:`~accelpact_slurm.runtime.detection.collectives.Detector.stall_next`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from typing import Any, Callable, Iterable
from accelpact_slurm.core.errors import CollectiveAbandoned

FORWARD, BACKWARD, OPTIMIZER, COMMITTED = "forward", "backward", "optimizer", "committed"
#: The test kill point in ``optimizer.step`` after the vote (``ACCELPACT_TEST_KILL_NODE=step:K:NODE``).
STEP = "step"


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

    if isinstance(exc, (Withheld, CollectiveAbandoned)) or type(exc).__name__ == "ReplicationWithheld":
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


class Redo(BaseException):
    """The vote decided to discard this update and run it again (raised out of ``optimizer.step``).

    A control-flow signal of the update context, like ``GeneratorExit``: a ``BaseException``, so that a script's
    ``try: opt.step() except Exception:`` cannot swallow it and step on the discarded gradients.
    """


#: Where the project's and the libraries' frames live: the "user's frame" of a traceback is outside them.
_NOT_USER = tuple(os.path.dirname(p) + os.sep for p in (os.__file__,)) + (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,
    os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def describe_exception(exc: BaseException, limit: int = 20000) -> dict[str, Any]:
    """What a ``fail_stop`` says of a training-code error: type, message, the user's frame, the traceback.

    The user's frame is the innermost one outside the standard library, the installed packages and this project (where
    the script's own line is; an error raised deep inside torch names the line that called it), else the innermost
    one.  The traceback is the full text, chained exceptions included (at most ``limit`` characters, its end kept).
    """
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    user = [f for f in frames if not any(part in os.path.abspath(f.filename) for part in _NOT_USER)]
    frame = (user or frames or [None])[-1]
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(text) > limit:
        text = "...\n" + text[-limit:]
    message = (str(exc).splitlines() or [""])[0][:500]
    return {"type": type(exc).__name__, "message": message,
            "file": frame.filename if frame is not None else None,
            "line": frame.lineno if frame is not None else None,
            "function": frame.name if frame is not None else None, "traceback": text}


def log_exception(logger: Any, what: str, exc: BaseException) -> dict[str, Any]:
    """Write ``exc``'s whole traceback into this rank's log (stderr) and return its description."""
    info = describe_exception(exc)
    logger.error("%s\n%s", what, info["traceback"].rstrip())
    sys.stderr.flush()
    return info


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

    def __init__(self, model: Any, optimizer: Any, injector: FaultInjector | None = None, fsdp: str = "fsdp1",
                 state: Any = None, detector: Any = None, slow: tuple[int, str] | None = None,
                 lose_node: Callable[[str, int], None] | None = None) -> None:
        self.injector = injector
        #: Test-only: ``lose_node(phase, update)`` kills this rank's node where the test asked (``forward``: as the
        #: update's forward begins; ``backward``: as its backward begins; ``step``: in ``optimizer.step``, after the
        #: vote decided the update commits) and does nothing elsewhere.
        self._lose_node = lose_node or (lambda phase, step: None)
        self._slow = slow  # test-only: (update, seconds) this rank computes longer in its forward (a straggler)
        #: This rank's heartbeat record (:class:`~accelpact_slurm.runtime.detection.liveness.LocalState`): update and
        #: phase.
        self.state = state
        self.detector = detector
        self.model, self.fsdp = model, fsdp
        self.active = False
        self.step = 0
        self.phase = COMMITTED
        self.stepped = False
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
        self.active, self.step, self.phase, self.stepped, self.decided = True, step, FORWARD, False, False
        self._show(FORWARD)

    def end(self) -> None:
        self.active = False
        self.phase = COMMITTED
        self._show(COMMITTED)
        self.stop_withholding()

    def _show(self, phase: str) -> None:
        if self.state is not None:
            self.state.update, self.state.phase = self.step, phase

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
        self._show(FORWARD)
        self._lose_node(FORWARD, self.step)
        if self._slow is not None and self._slow[0] == self.step:
            step, text = self._slow
            self._slow = None
            if text.endswith("x") and self.detector is not None:  # a multiple of the bound learned so far
                seconds = float(text[:-1]) * max(self.detector.bounds.bound(d) for d in ("shard", "replicate"))
            else:
                seconds = float(text.rstrip("x"))
            logging.getLogger(__name__).warning("fault injection: update %d's forward is %.2f s slower here (a "
                                                "straggler)", step, seconds)
            threading.Event().wait(seconds)
        if self.injector is not None and self.injector.fires("forward", self.step):
            raise Withheld("forward")

    def _post_forward(self, *_: Any) -> None:
        if not self.active:
            return
        self.phase = BACKWARD
        self._show(BACKWARD)
        self._lose_node(BACKWARD, self.step)
        if self.injector is None:
            return
        if self.injector.fires("backward-all", self.step):
            raise Withheld("backward")
        if self.detector is not None and self.injector.fires("backward-stuck", self.step):
            self.detector.stall_next("replicate")
        if self._withholding is None and self.injector.fires("backward", self.step):
            from accelpact_slurm.repair.discard import withhold_replication

            self._withholding = withhold_replication(self.model, self.fsdp)
            self._withholding.__enter__()

    def _pre_step(self, *_: Any) -> None:
        if not self.active:
            return
        self.phase = OPTIMIZER
        self._show(OPTIMIZER)
        if not self.decided and self.decide is not None:
            self.decided = True
            if self.decide() == "redo":
                raise Redo()
            self._lose_node(STEP, self.step)  # test-only: the vote decided the update commits; the step begins

    def _post_step(self, *_: Any) -> None:
        if self.active:
            self.stepped = True
