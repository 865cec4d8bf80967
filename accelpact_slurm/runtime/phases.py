"""Phase tracking without the user's help: module and optimizer hooks, active only inside ``run.update()``.

forward (a forward of the protected model began) -> backward (it returned: loss and backward follow)
-> optimizer (``optimizer.step`` began) -> stepped (it returned); gradient accumulation alternates
forward and backward several times before the step.  The guard reads :attr:`PhaseTracker.phase`
when a fault surfaces and :attr:`PhaseTracker.stepped` at the end of the update.

Injected faults for tests (:class:`FaultInjector`) fire from the same hooks: ``forward`` withholds
this rank's part of the whole forward, ``backward`` its part of the whole backward (its peers then
hit the data plane's timeout), ``boundary`` its part of the guard's own collective.
"""

from __future__ import annotations

from typing import Any, Iterable

FORWARD, BACKWARD, OPTIMIZER, COMMITTED = "forward", "backward", "optimizer", "committed"


class Withheld(Exception):
    """This rank is the injected faulting member (raised inside the update, latched by the guard)."""


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

    def __init__(self, model: Any, optimizer: Any, injector: FaultInjector | None = None) -> None:
        self.injector = injector
        self.active = False
        self.step = 0
        self.phase = COMMITTED
        self.stepped = False
        self.forwards = 0
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward),
            model.register_forward_hook(self._post_forward),
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    def begin(self, step: int) -> None:
        self.active, self.step, self.phase, self.stepped, self.forwards = True, step, FORWARD, False, 0

    def end(self) -> None:
        self.active = False
        self.phase = COMMITTED

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
        if self.injector is not None and self.injector.fires("backward", self.step):
            raise Withheld("backward")

    def _pre_step(self, *_: Any) -> None:
        if self.active:
            self.phase = OPTIMIZER

    def _post_step(self, *_: Any) -> None:
        if self.active:
            self.stepped = True
