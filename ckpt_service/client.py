"""The rank side: every K steps copy this rank's shards into shared memory, hand them over, go on.

Who calls (every rank, same order, from ``job.run_rank``):

1. ``SnapshotClient(cfg, trainer, run_dir, events)`` then ``restore()`` before the loop (collective);
2. ``after_commit()`` right after ``trainer.commit`` (collective on snapshot steps: the RNG exchange
   goes over the control plane; on the first snapshot of a start also the fixed-batch loss, an FSDP
   collective);
3. ``close()`` at the end.

A snapshot (:meth:`SnapshotClient.snapshot`) plans which boxes of which tensors this rank holds
(:mod:`.capture`: FSDP1's flat-parameter shards directly, no ``get_state_dict``), copies them into
a preallocated shared-memory slot (:mod:`.staging`), writes a small descriptor and tells the
daemon; that is all training waits for.  The daemon writes the boxes as DCP chunks from the slot.
Two slots alternate: a slot is reused only after the daemon has finished writing the snapshot that
used it (backpressure, bounded by ``timeouts.control_s``; past it the snapshot is skipped with an
event and training goes on).  A missing or dead daemon costs a warning, never the run.

The replay check's reference loss is computed by the daemon from the staged weights
(:mod:`.reference`); the ranks compute the live model's fixed-batch loss only until one snapshot
carrying it was committed, which proves that the staged state equals the live model.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from accelpact_slurm.core.errors import EXIT_REQUEUE

from ckpt_service import faults, staging
from ckpt_service.layout import node_dir, socket_path, staging_root
from ckpt_service.protocol import DaemonUnavailable, request

log = logging.getLogger(__name__)

EVAL_BATCH = 4
SLOTS = 2


class SnapshotClient:
    def __init__(self, cfg: Any, trainer: Any, run_dir: str, events: Any = None) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.rt = trainer.rt
        self.run_dir = run_dir
        self.events = events
        self.every = cfg.checkpoint.every_steps
        self.ndir = node_dir(run_dir, self.rt.ctx.hostname, cfg.checkpoint.local_dir)
        self.sock = socket_path(self.ndir)
        self.stage_root = staging_root(self.ndir)
        self.slots = [staging.Slot(staging.slot_path(self.stage_root, self.rt.local_rank, i)) for i in range(SLOTS)]
        self._slot_step: list[int | None] = [None] * SLOTS
        self._proved = False  # a committed snapshot reproduced the live model's fixed-batch loss
        self._proving: int | None = None
        self._contacted = False
        self.last_error: str | None = None
        self.last_parts: dict[str, Any] = {}

    # ------------------------------------------------------------------ restore

    def restore(self) -> int | None:
        """Collective: resume from the newest verified snapshot every rank can reach (if any)."""
        from accelpact_slurm.runtime.restore import restore_trainer

        step, _why = restore_trainer(self.trainer, self.run_dir, self.events)
        return step

    # ------------------------------------------------------------------ snapshots

    def after_commit(self) -> None:
        step = self.trainer.progress.step
        if self.every <= 0 or step % self.every:
            return
        self.snapshot()
        stop_at = faults.exit_after_verified()
        if stop_at == step:
            state = self.wait(step, self.cfg.timeouts.startup_s)
            self.rt.control.barrier("ckpt-exit-after-verified", timeout_s=self.cfg.timeouts.startup_s)
            log.warning("fault injection: exiting after snapshot %d (%s)", step, state)
            raise SystemExit(EXIT_REQUEUE)

    def snapshot(self, *, live_loss: bool = False) -> bool:
        """Collective: stage this rank's state at the current step; False when it was skipped.

        ``live_loss`` forces the live fixed-batch forward (a snapshot taken before a requeue).
        """
        from accelpact_slurm.runtime import appstate

        from ckpt_service.capture import plan_for

        tr, rt, cfg = self.trainer, self.rt, self.cfg
        step = tr.progress.step
        t0 = time.monotonic()
        parts: dict[str, float] = {}
        if self._proving is not None:  # did the snapshot that carried the live loss commit? (no waiting)
            try:
                self._note_proof(self._proving, self._request({"op": "released", "step": self._proving,
                                                               "timeout": 0}, cfg.timeouts.control_s))
            except DaemonUnavailable:
                pass
        slot = self._free_slot(cfg.timeouts.control_s)
        parts["wait_slot"] = time.monotonic() - t0
        # every rank takes part in the exchange, even one whose slot is busy: all decide alike
        t = time.monotonic()
        rngs = rt.control.all_gather("ckpt-rng", {"rng": appstate.rng_b64(), "slot_ok": slot is not None,
                                                  "proved": self._proved})
        parts["rng"] = time.monotonic() - t
        if not all(r["slot_ok"] for r in rngs):
            busy = [i for i, r in enumerate(rngs) if not r["slot_ok"]]
            log.warning("snapshot %d skipped: the daemon has not finished an earlier snapshot of rank(s) %s "
                        "within %g s", step, busy, cfg.timeouts.control_s)
            if rt.rank == 0 and self.events is not None:
                self.events.emit("snapshot", step=step, skipped=True, blocking_s=time.monotonic() - t0,
                                 reason=f"daemon busy with an earlier snapshot of rank(s) {busy}")
            return False
        t = time.monotonic()
        need_live = live_loss or not all(r["proved"] for r in rngs)  # the same on every rank
        loss = tr.eval_loss(tr.stream.fixed_batch(EVAL_BATCH)) if need_live else None
        parts["eval_loss"] = time.monotonic() - t
        t = time.monotonic()
        plan = plan_for(tr.model, tr.optimizer)  # FSDP1: no collective; otherwise get_state_dict (collective)
        nbytes = plan.layout()
        created = self.slots[slot].ensure(nbytes)
        if plan.on_gpu:
            self.slots[slot].pin()  # once per mapping: D2H at DMA speed
        parts["plan"] = time.monotonic() - t
        t = time.monotonic()
        plan.copy_into(self.slots[slot].buf)
        parts["copy"] = time.monotonic() - t
        if faults.corrupt_capture() == (step, rt.rank):
            self._corrupt(plan, slot)
        meta = {
            "job_id": rt.ctx.job_id, "config_digest": cfg.digest(), "config": cfg.to_dict(),
            "world_size": rt.layout.world_size, "eval": {"batch_size": EVAL_BATCH, "live_loss": loss},
            "extra": appstate.extra_state(tr, [r["rng"] for r in rngs]),
        }
        t = time.monotonic()
        try:
            desc = staging.write_descriptor(self.stage_root, step, rt.local_rank, {
                "step": step, "rank": rt.rank, "local_rank": rt.local_rank, "meta": meta,
                "slot": self.slots[slot].path, "slot_ino": self.slots[slot].ino, "nbytes": nbytes,
                "entries": plan.describe(), "plain": plan.plain, "source": plan.source})
            self._slot_step[slot] = step
            self._request({"op": "staged", "step": step, "rank": rt.rank, "local_rank": rt.local_rank,
                           "nranks": rt.layout.ranks_per_node, "path": desc})
            if need_live:
                self._proving = step
        except Exception as exc:  # never fatal to training
            self.last_error = f"snapshot {step}: {exc}"
            log.warning("snapshot %d not handed to the daemon: %s", step, exc)
        parts["hand_over"] = time.monotonic() - t
        blocking = time.monotonic() - t0
        self.last_parts = dict(parts, total=blocking, bytes=nbytes, new_slot=created, source=plan.source)
        log.debug("snapshot %d staged in %.3f s (%s)", step, blocking, parts)
        if rt.rank == 0 and self.events is not None:  # what a snapshot costs training (accelpact-cadence reads it)
            self.events.emit("snapshot", step=step, blocking_s=blocking)
        kill = faults.kill_after_staged()
        if kill == (step, rt.rank):
            log.warning("fault injection: rank %d kills itself after staging step %d", rt.rank, step)
            os.kill(os.getpid(), signal.SIGKILL)
        return True

    def _corrupt(self, plan: Any, slot: int) -> None:
        """Fault injection: change this rank's staged weights (as a wrong capture mapping would)."""
        for e, _b, view in plan.regions(self.slots[slot].buf):
            if e.key[0] == "model":
                view.add_(1.0)
        log.warning("fault injection: staged weights of rank %d changed", self.rt.rank)

    def _free_slot(self, timeout_s: float) -> int | None:
        """A slot the daemon no longer reads; None when none became free within ``timeout_s``.

        Prefers reusing a released slot (its pages are already touched) over creating the second one,
        so a daemon that keeps up costs one slot; waits (bounded) only when both are busy.
        """
        used = sorted((s for s in range(SLOTS) if self._slot_step[s] is not None), key=lambda s: self._slot_step[s])
        unused = [s for s in range(SLOTS) if self._slot_step[s] is None]
        for s in used:
            if self._released(s, 0.0, timeout_s):
                return s
        if unused:
            return unused[0]
        return used[0] if self._released(used[0], timeout_s, timeout_s + 10) else None

    def _released(self, slot: int, wait_s: float, timeout_s: float) -> bool:
        prev = self._slot_step[slot]
        try:
            reply = self._request({"op": "released", "step": prev, "timeout": wait_s}, timeout_s)
        except DaemonUnavailable:
            return True  # no daemon: nothing reads the slot
        self._note_proof(prev, reply)
        return bool(reply.get("released"))

    def _note_proof(self, step: int, reply: dict[str, Any]) -> None:
        """The snapshot that carried the live loss left the writer: committed means the capture is proved."""
        if step != self._proving or not reply.get("released"):
            return
        self._proving = None
        if reply.get("state") in ("committed", "verified"):
            self._proved = True
        elif reply.get("state") in ("failed", "rejected"):
            log.error("snapshot %d did not reproduce the live model: %s", step, reply.get("reason"))

    def _request(self, msg: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One request; the first contact waits (bounded) for a daemon that is still starting."""
        timeout = timeout_s or self.cfg.timeouts.control_s
        patience = self.cfg.timeouts.startup_s if not self._contacted else 0.0
        deadline = time.monotonic() + patience
        while True:
            try:
                reply = request(self.sock, msg, timeout)
                self._contacted = True
                if not reply.get("ok"):
                    raise DaemonUnavailable(reply.get("error", "refused"))
                return reply
            except DaemonUnavailable:
                if time.monotonic() >= deadline:
                    raise
                threading.Event().wait(0.1)

    def wait(self, step: int, timeout_s: float) -> str | None:
        """Block until the daemon reports a final state for ``step`` (or the timeout); return the state."""
        try:
            reply = self._request({"op": "wait", "step": step, "timeout": timeout_s}, timeout_s + 10)
        except DaemonUnavailable as exc:
            log.warning("cannot wait for snapshot %d: %s", step, exc)
            return None
        return reply.get("state")

    def snapshot_and_wait(self, timeout_s: float) -> str | None:
        """Collective: make sure a snapshot of the current step exists and wait until the daemon settles it.

        Used before a requeue (pre-timeout signal, preemption).  Returns the daemon's
        final state for the step (``committed``/``verified``/``rejected``/``failed``)
        or None when no daemon answered or the snapshot could not be staged.
        """
        step = self.trainer.progress.step
        if step not in self._slot_step and not self.snapshot(live_loss=True):
            return None
        return self.wait(step, timeout_s)

    def close(self) -> None:
        """Nothing to join: staging is synchronous.  The slots stay for the daemon until it is done."""
