"""The rank side: every K steps capture this rank's shards, stage them in shared memory, hand them over.

Who calls (every rank, same order, from ``job.run_rank``):

1. ``SnapshotClient(cfg, trainer, run_dir, events)`` then ``restore()`` before the loop (collective);
2. ``after_commit()`` right after ``trainer.commit`` (collective on snapshot steps: the fixed-batch
   loss and ``get_state_dict`` are FSDP collectives, the RNG exchange goes over the control plane);
3. ``close()`` at the end (waits for the last staging, bounded).

The capture is synchronous (clones); writing the payload to ``/dev/shm`` and
telling the daemon happen on a named background thread, so training goes on.
The next snapshot waits only for the previous staging thread.  A missing or
dead daemon costs a warning, never the run.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from accelpact_slurm.errors import EXIT_REQUEUE

from . import faults, staging
from .layout import node_dir, socket_path, staging_root
from .protocol import DaemonUnavailable, request

log = logging.getLogger(__name__)

EVAL_BATCH = 4


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
        self._thread: threading.Thread | None = None
        self._contacted = False
        self.last_error: str | None = None

    # ------------------------------------------------------------------ restore

    def restore(self) -> int | None:
        """Collective: resume from the newest verified snapshot every rank can reach (if any)."""
        from accelpact_slurm.restore import restore_trainer

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
            self._join(self.cfg.timeouts.startup_s)
            state = self.wait(step, self.cfg.timeouts.startup_s)
            self.rt.control.barrier("ckpt-exit-after-verified", timeout_s=self.cfg.timeouts.startup_s)
            log.warning("fault injection: exiting after snapshot %d (%s)", step, state)
            raise SystemExit(EXIT_REQUEUE)

    def snapshot(self) -> None:
        """Collective: capture this rank's state at the current step and stage it in the background."""
        from accelpact_slurm.workload import appstate

        tr, rt, cfg = self.trainer, self.rt, self.cfg
        step = tr.progress.step
        self._join(cfg.timeouts.control_s)  # the next snapshot waits only for the previous staging
        t0 = time.monotonic()
        loss = tr.eval_loss(tr.stream.fixed_batch(EVAL_BATCH))
        state = appstate.capture(tr)
        rngs = rt.control.all_gather("ckpt-rng", appstate.rng_b64())
        meta = {
            "job_id": rt.ctx.job_id, "config_digest": cfg.digest(), "config": cfg.to_dict(),
            "world_size": rt.layout.world_size, "eval": {"loss": loss, "batch_size": EVAL_BATCH},
            "extra": appstate.extra_state(tr, rngs),
        }
        self._thread = threading.Thread(target=self._stage, args=(step, meta, state),
                                        name=f"ckpt-stage-{step}", daemon=True)
        self._thread.start()
        blocking = time.monotonic() - t0
        log.debug("snapshot %d captured in %.3f s", step, blocking)
        if rt.rank == 0 and self.events is not None:  # what a snapshot costs training (accelpact-cadence reads it)
            self.events.emit("snapshot", step=step, blocking_s=blocking)

    def _stage(self, step: int, meta: dict[str, Any], state: Any) -> None:
        rt = self.rt
        try:
            path = staging.write_payload(self.stage_root, step, rt.rank, rt.local_rank, meta, state)
            msg = {"op": "staged", "step": step, "rank": rt.rank, "local_rank": rt.local_rank,
                   "nranks": rt.layout.ranks_per_node, "path": path}
            self._request(msg)
        except Exception as exc:  # never fatal to training
            self.last_error = f"snapshot {step}: {exc}"
            log.warning("snapshot %d not handed to the daemon: %s", step, exc)
            return
        kill = faults.kill_after_staged()
        if kill == (step, rt.rank):
            log.warning("fault injection: rank %d kills itself after staging step %d", rt.rank, step)
            os.kill(os.getpid(), signal.SIGKILL)

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
        or None when no daemon answered.
        """
        step = self.trainer.progress.step
        if self.every <= 0 or step % self.every:
            self.snapshot()
        self._join(timeout_s)
        return self.wait(step, timeout_s)

    def _join(self, timeout_s: float) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.warning("previous staging still running after %g s", timeout_s)

    def close(self) -> None:
        self._join(self.cfg.timeouts.control_s)
