"""The rank side: every K steps copy this rank's shards into shared memory, hand them over, go on.

Who calls (every rank, same order, from :class:`accelpact_slurm.runtime.job.api.Run`): ``SnapshotClient(cfg, rt,
run_dir, events, model, optimizer, extra)`` after ``job.protect`` (``rt``: :class:`accelpact_slurm.core.rank.RankContext`);
``after_commit(step)`` after each committed update (collective on snapshot steps: the extra-state exchange over the
control plane, and on a start's first snapshot the capture proof's round); ``settle(step, timeout_s)``
where ``run.save()`` or the job's end asks for a verified snapshot (collective likewise); ``close()`` at the end.

A snapshot (:meth:`SnapshotClient.snapshot`) plans the boxes of the tensors this rank holds (:mod:`.capture`) and
copies them into a preallocated shared-memory slot (:mod:`.staging`): all that training waits for.  The hand-over
(the descriptor, the message to the daemon) runs on a worker thread beside the next update; the next snapshot, every
wait for the daemon, ``close()``, a fail-stop and an injected kill join it first, so the daemon sees a rank's
snapshots in order and none is left unannounced.  Two slots alternate; a slot is reused only once the daemon said it
finished writing from it (backpressure, bounded by ``timeouts.control_s``; past it the snapshot is skipped with an
event).  Silence is not release: a daemon that does not answer may still read its slots, so they stay its own and the
node's snapshots are skipped (one ``warning`` per episode) until it answers, or until it is gone for sure (its node
directory's lock is free).  A missing or dead daemon costs a warning, never the run.  Requests answered at once are
bounded by :attr:`SnapshotClient.answer_s`: a silent daemon delays a snapshot by seconds, never by a control-plane
timeout the other nodes' ranks would hit first.

``extra()`` is this rank's non-tensor state as JSON (the frontier, every ``Stateful``'s state, the RNG states); the
client stores every rank's as one document beside the tensors.  Nothing here knows the model's class: the capture
proof (:mod:`.proof`) compares staged bytes with the live state, located without the plan (no copy of it).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable

from accelpact_slurm.core.faults import NO_FAULTS, TestFaults
from accelpact_slurm.core.rank import RankContext

from ckpt_service import faults as faults_mod
from ckpt_service import proof_cache, staging
from ckpt_service.index import read_json
from ckpt_service.layout import daemon_failed_marker, node_dir, socket_path, staging_root
from ckpt_service.protocol import FINAL, DaemonSilent, DaemonUnavailable, request

log = logging.getLogger(__name__)

SLOTS = 2
#: The longest a rank waits for the daemon to answer a request it answers at once (at most a quarter of
#: ``timeouts.control_s``); past it the daemon counts as silent.  Once silent, each later snapshot asks again
#: for at most :data:`PROBE_S`.
ANSWER_S = 5.0
PROBE_S = 1.0
#: Said with a daemon that did not answer in time.
STARVED = ("; the daemon is stopped, stuck or starved of CPU (on a machine shared with other busy work, "
           "ACCELPACT_CKPTD_IDLE=0 keeps its workers from starving it: docs/checkpoints.md)")

#: Every client of this process, for :func:`join_handovers`.
_CLIENTS: "weakref.WeakSet[SnapshotClient]" = weakref.WeakSet()


def join_handovers(timeout_s: float) -> int:
    """Wait up to ``timeout_s`` for every hand-over still pending in this process; returns how many clients still
    have one.

    A fail-stop leaves with ``os._exit``, which would cut a hand-over short: the snapshot of a committed step
    taken just before the fault would be lost, and the restart would load an older one.
    """
    deadline = time.monotonic() + timeout_s
    for client in list(_CLIENTS):
        client._idle.wait(max(0.0, deadline - time.monotonic()))
    return sum(not c._idle.is_set() for c in list(_CLIENTS))


class SnapshotClient:
    def __init__(self, cfg: Any, rt: RankContext, run_dir: str, events: Any, model: Any, optimizer: Any,
                 extra: Callable[[], dict[str, Any]], faults: TestFaults = NO_FAULTS) -> None:
        self.cfg = cfg
        self.rt: RankContext = rt  # what the client reads of the rank: nothing outside RankContext
        self.run_dir = run_dir
        self.events = events
        self.model = model
        self.optimizer = optimizer
        self.extra = extra
        self.faults = faults
        self.every = cfg.checkpoint.every_steps
        self.ndir = node_dir(run_dir, self.rt.ctx.hostname, cfg.checkpoint.local_dir)
        self.sock = socket_path(self.ndir)
        self.stage_root = staging_root(self.ndir)
        self.slots = [staging.Slot(staging.slot_path(self.stage_root, self.rt.local_rank, i)) for i in range(SLOTS)]
        self._slot_step: list[int | None] = [None] * SLOTS
        self._proved = False  # this start's capture was proven against the live state dict
        self._contacted = False  # the first contact waits (bounded) for a daemon still starting; later ones do not
        self.down: str | None = None  # why this node has no daemon (then snapshots are skipped on it)
        self.answer_s = min(ANSWER_S, cfg.timeouts.control_s / 4)
        self._silent_since: float | None = None  # when the daemon first left a request unanswered (this episode)
        self._skipping: dict[int, tuple[int, float]] = {}  # rank 0: node -> (first skipped step, since) per episode
        self._failed_marker = daemon_failed_marker(run_dir, self.rt.ctx.hostname)
        self.taken: set[int] = set()  # steps snapshotted (not skipped) in this start
        self.last_error: str | None = None
        # the hand-over worker: one thread per client, started with the first snapshot; _idle is clear while a
        # snapshot waits on it to be handed over
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._prefault: threading.Thread | None = None  # makes the slots' pages ready beside training
        _CLIENTS.add(self)

    # ------------------------------------------------------------------ snapshots

    @property
    def proved(self) -> bool:
        """Whether this start's capture was proven against the live state dict (then no rank proves it again)."""
        return self._proved

    def adopt_proof(self, proved: bool) -> None:
        """A rank that joins a running job (a spare in a lost rank's place) takes the others' proof state: the
        proof is collective, and every rank must decide it alike."""
        self._proved = proved

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def after_commit(self, step: int) -> None:
        if not self.due(step):
            if self.every > 0 and self._prefault is None:
                self._prepare_slots()
            return
        self.snapshot(step)
        faults_mod.exit_after_verified(self, step, self.faults)

    def snapshot(self, step: int, slot_wait_s: float | None = None) -> bool:
        """Collective: stage this rank's state at committed step ``step``; False when it was skipped.

        ``slot_wait_s``: a snapshot asked for (the job's end, ``run.save()``) waits up to this long for the daemon
        to release a slot, while it answers that it still writes, instead of skipping at ``timeouts.control_s``: on
        a loaded node the daemon may still be writing the two snapshots before (every rank passes the same value,
        and the exchange waits as long).  A silent daemon is not waited for.
        """
        from ckpt_service.capture import plan_for

        rt, cfg = self.rt, self.cfg
        t0 = time.monotonic()
        parts: dict[str, float] = {}
        self.join_handover()
        if self._prefault is not None:
            self._prefault.join()  # the slots it makes ready are this snapshot's
        slot, busy_why = self._free_slot(cfg.timeouts.control_s, patient_s=slot_wait_s)
        parts["wait_slot"] = time.monotonic() - t0
        # every rank takes part in the exchange, even one whose slot is busy: all decide alike
        t = time.monotonic()
        plan = plan_for(self.model, self.optimizer)  # FSDP1: no collective; otherwise get_state_dict (collective)
        nbytes = plan.layout()
        parts["plan"] = time.monotonic() - t
        # The capture proof runs once per job and plan: each rank's plan signature travels in the exchange, with
        # the signatures a proof of this job already passed (rank 0 reads them), so every rank decides alike.
        mine: dict[str, Any] = {"extra": self.extra(), "slot_ok": slot is not None}
        if slot is None:
            mine["slot_why"] = busy_why
        if not self._proved:
            mine["plan"] = proof_cache.signature(plan, rt.rank, rt.layout.world_size)
            if rt.rank == 0:
                mine["proven"] = sorted(proof_cache.proven(self.run_dir))
        t = time.monotonic()
        # a rank may still be waiting for its slot (up to control_s, or slot_wait_s): the round allows for it
        extras = rt.control.all_gather("ckpt-extra", mine,
                                       timeout_s=cfg.timeouts.control_s + (slot_wait_s or cfg.timeouts.control_s))
        parts["extra"] = time.monotonic() - t
        resumed = self._episodes(step, extras) if rt.rank == 0 else []
        if not all(r["slot_ok"] for r in extras):
            busy = [i for i, r in enumerate(extras) if not r["slot_ok"]]
            why = "; ".join(f"rank {i}: {extras[i].get('slot_why')}" for i in busy)
            log.warning("snapshot %d skipped: no free staging slot on rank(s) %s (%s)", step, busy, why)
            if rt.rank == 0 and self.events is not None:
                self.events.emit("snapshot", step=step, skipped=True, blocking_s=time.monotonic() - t0,
                                 reason=f"no free staging slot on rank(s) {busy}: {why}")
            return False
        t = time.monotonic()
        created = self.slots[slot].ensure(staging.slot_bytes(nbytes))
        if plan.on_gpu:
            self.slots[slot].pin()  # once per mapping: D2H at DMA speed
        parts["slot"] = time.monotonic() - t
        t, cpu = time.monotonic(), time.thread_time()
        token = staging.new_token()
        # cleared before the first byte changes, stamped after the last: a daemon still writing what this slot
        # held before (it should not be: the slot was released) sees the stamp gone and commits nothing
        staging.clear_stamp(self.slots[slot].buf, nbytes)
        plan.copy_into(self.slots[slot].buf)
        staging.write_stamp(self.slots[slot].buf, nbytes, step, token)
        parts["copy"] = time.monotonic() - t
        parts["copy_cpu"] = time.thread_time() - cpu  # this thread's CPU in it (wall above it: waiting or preempted)
        other = self.slots[(slot + 1) % SLOTS]
        if 0 < other.size < staging.slot_bytes(nbytes) and (self._prefault is None or not self._prefault.is_alive()):
            # a second slot exists (the daemon was behind once) but the state outgrew it: regrown beside training
            self._prefault = threading.Thread(target=self._ready_slot, args=(other, staging.slot_bytes(nbytes)),
                                              name="ckpt-prefault", daemon=True)
            self._prefault.start()
        if created and slot == 1 and self._slot_step[0] is not None:
            log.info("snapshot %d: the checkpoint daemon still held slot %d (snapshot %s), so a second staging slot "
                     "was created (%d bytes in shared memory from now on)", step, 0, self._slot_step[0], self.slots[1].size)
        faults_mod.corrupt_capture(self, plan, slot, step, self.faults)
        capture = None
        if not self._proved:  # once per job and plan, the same decision on every rank
            t = time.monotonic()
            signatures = [e.get("plan") for e in extras]
            known = set(extras[0].get("proven") or ())
            if all(sig in known for sig in signatures):
                capture = {"ok": True, "step": step, "cached": True,
                           "reason": f"every rank's capture plan was proven earlier in this job "
                                     f"({len(signatures)} plans, {proof_cache.FILE})"}
                self._proved = True
            else:
                self.faults.kill_node_at("proof", step, rt.node)
                ok, why = self._prove(plan, slot)
                passed = rt.control.all_gather("ckpt-proof", ok)  # every rank's node's verdict
                capture = {"ok": ok, "reason": why, "step": step}
                self._proved = all(passed)  # the same on every rank: the next proof is collective too
                if self._proved and rt.rank == 0:
                    proof_cache.record(self.run_dir, signatures, step, rt.ctx.restart_count)
                if not ok:
                    log.error("snapshot %d: the staged state does not match the live state: %s", step, why)
            parts["proof"] = time.monotonic() - t
        t = time.monotonic()
        self.taken.add(step)  # decided alike on every rank (the handover below may still fail on one)
        self._slot_step[slot] = step
        desc = {"step": step, "rank": rt.rank, "local_rank": rt.local_rank, "slot": self.slots[slot].path,
                "slot_ino": self.slots[slot].ino, "nbytes": nbytes, "stamp": {"at": nbytes, "token": token},
                "plain": plan.plain, "source": plan.source}
        if self._worker is None:
            self._worker = threading.Thread(target=self._hand_over_loop, daemon=True, name="ckpt-handover")
            self._worker.start()
        self._idle.clear()
        self._jobs.put((step, desc, plan, extras, capture))
        parts["hand_over"] = time.monotonic() - t  # queuing it; the hand-over itself runs beside the next update
        blocking = time.monotonic() - t0
        log.debug("snapshot %d staged in %.3f s (%s)", step, blocking, parts)
        if rt.rank == 0 and self.events is not None:  # what a snapshot costs training (accelpact-cadence reads it)
            self.events.emit("snapshot", step=step, blocking_s=blocking, parts_s={k: round(v, 6) for k, v in parts.items()},
                             staging_bytes=[slot_.size for slot_ in self.slots],  # rank 0's slots in /dev/shm
                             **({"capture_proof": capture["reason"], "capture_ok": capture["ok"]} if capture else {}),
                             **({"resumed": resumed} if resumed else {}))
        faults_mod.kill_after_staged(self, step, self.faults)
        self.faults.kill_node_at("handoff", step, rt.node)  # its hand-off to the daemon in flight
        return True

    def _prove(self, plan: Any, slot: int) -> tuple[bool, str]:
        """This rank's part of the capture proof (:mod:`.proof`): the slot's bytes against a reference of the live
        state (views, no copy), over two rounds of its node's ranks on the control plane; the node's verdict."""
        from ckpt_service import proof

        rt = self.rt
        node = rt.layout.shard_ranks(rt.node)
        live: proof.Side | str
        staged = proof.Side({}, {})
        try:  # nothing raises out of here: every rank of the node enters both rounds
            staged = proof.staged(plan, self.slots[slot].buf)
            live = proof.reference(self.model, self.optimizer, plan)
        except Exception as exc:  # noqa: BLE001 - the proof fails with the reason; training goes on
            live = f"no reference of the live state on rank {rt.rank}: {type(exc).__name__}: {exc}"
        return proof.prove(staged, live,
                           lambda tag, value: rt.control.all_gather(f"ckpt-proof-{tag}/{rt.node}", value, ranks=node))

    def _prepare_slots(self) -> None:
        """After the start's first committed update (every tensor of the state exists by then): size the slot the
        first snapshot takes from this rank's plan and touch its pages on a thread of its own, beside training, so that
        the first snapshot of this start (the first after a restart included) does not fault fresh pages in while
        training waits.  Only that one: a daemon that keeps up costs one slot of shared memory per rank; the second is
        created by the first snapshot that finds the daemon still writing from the first (:meth:`_free_slot`).

        FSDP1's plan needs no collective; any other wrapping's does (``get_state_dict``), so there the first snapshot
        makes its slot itself.
        """
        from ckpt_service.capture import fsdp1_plan

        def prepare() -> None:
            try:
                plan = fsdp1_plan(self.model, self.optimizer)
                if plan is None:
                    return
                nbytes = staging.slot_bytes(plan.layout())
                plan = None  # views of the live tensors: dropped here, on this thread
                self._ready_slot(self.slots[0], nbytes)  # the slot _free_slot gives while none is used
            except Exception as exc:  # noqa: BLE001 - the first snapshot makes its slot itself
                log.info("staging slots not made ready ahead: %s", exc)

        self._prefault = threading.Thread(target=prepare, name="ckpt-prefault", daemon=True)
        self._prefault.start()

    @staticmethod
    def _ready_slot(slot: staging.Slot, nbytes: int) -> None:
        try:
            slot.ensure(nbytes)
            slot.prefault()
        except Exception as exc:  # noqa: BLE001 - the snapshot that needs it makes it itself
            log.info("staging slot %s not made ready ahead: %s", slot.path, exc)

    def _hand_over_loop(self) -> None:
        """The hand-over worker: for each staged snapshot, the descriptor, then the message to the daemon."""
        while True:
            item = self._jobs.get()
            if item is None:  # close()
                return
            step, desc, plan, extras, capture = item
            try:
                desc["meta"] = self._meta(extras, capture)
                desc["entries"] = plan.describe()
                path = staging.write_descriptor(self.stage_root, step, self.rt.local_rank, desc)
                self._request({"op": "staged", "step": step, "rank": self.rt.rank,
                               "local_rank": self.rt.local_rank, "nranks": self.rt.layout.ranks_per_node,
                               "path": path}, self._answer_timeout())
            except Exception as exc:  # noqa: BLE001 - never fatal to training
                self.last_error = f"snapshot {step}: {exc}" + (STARVED if isinstance(exc, DaemonSilent) else "")
                log.warning("snapshot %d not handed to the daemon: %s", step, self.last_error)
            finally:
                # drop the plan (views of the live tensors) here, not when the thread ends: a tensor freed by a
                # daemon thread while the interpreter shuts down aborts the process
                item = desc = plan = extras = capture = None
                self._idle.set()

    def _meta(self, extras: list[dict[str, Any]], capture: dict[str, Any] | None) -> dict[str, Any]:
        """The snapshot's metadata: the job, the configuration, the layout, every rank's extra state, the proof."""
        rt, cfg = self.rt, self.cfg
        doc = {"run": extras[0]["extra"]["run"], "ranks": {str(r): e["extra"]["rank"] for r, e in enumerate(extras)}}
        return {"job_id": rt.ctx.job_id, "config_digest": cfg.digest(), "config": cfg.to_dict(),
                "world_size": rt.layout.world_size, "layout": [rt.layout.num_nodes, rt.layout.ranks_per_node],
                "extra_json": json.dumps(doc), "capture": capture}

    def join_handover(self) -> None:
        """Wait for the last snapshot's hand-over (bounded by its own request's timeouts)."""
        self._idle.wait()

    def _free_slot(self, timeout_s: float, patient_s: float | None = None) -> tuple[int | None, str | None]:
        """``(slot, None)``: a slot the daemon no longer reads; ``(None, why)`` when none is free now.

        Prefers reusing a released slot (its pages are already touched) over creating the second one,
        so a daemon that keeps up costs one slot; waits (bounded by ``timeout_s``) only when both are busy
        and the daemon answers.  A slot is free only when the daemon said so (or is gone for sure): a
        daemon that does not answer may still read it (one stopped with SIGSTOP resumes where it was).
        ``patient_s``: while the daemon answers that it still writes, ask again until that many seconds have
        passed.  A silent daemon is not waited for (stopped, or the node's daemon a healed node left behind).
        """
        if not patient_s:
            return self._free_slot_now(timeout_s)
        deadline = time.monotonic() + patient_s
        while True:
            left = deadline - time.monotonic()
            slot, why = self._free_slot_now(max(left, 0.0))
            if slot is not None or left <= 0 or self._silent_since is not None:
                return slot, why

    def _free_slot_now(self, timeout_s: float) -> tuple[int | None, str | None]:
        """One pass of :meth:`_free_slot`."""
        used = sorted((s for s in range(SLOTS) if self._slot_step[s] is not None), key=lambda s: self._slot_step[s])
        unused = [s for s in range(SLOTS) if self._slot_step[s] is None]
        silent: str | None = None
        for s in used:
            released, silent = self._released(s, 0.0)
            if released:
                return s, None
            if silent is not None:  # asking about the other slot would only wait out another timeout
                break
        if unused:
            return unused[0], None
        if silent is None:
            released, silent = self._released(used[0], timeout_s)
            if released:
                return used[0], None
        s = used[0]
        if silent is not None:
            return None, f"the checkpoint daemon has not released slot {s} (snapshot {self._slot_step[s]}): {silent}"
        return None, (f"the checkpoint daemon is still writing snapshot {self._slot_step[s]} from slot {s} "
                      f"(waited {timeout_s:g} s)")

    def _released(self, slot: int, wait_s: float) -> tuple[bool, str | None]:
        """``(released, silent)``: whether the daemon is done with ``slot``'s snapshot; ``silent`` says why there is
        no answer (None when it answered).  Without an answer the slot stays busy, unless no daemon lives."""
        prev = self._slot_step[slot]
        try:
            reply = self._request({"op": "released", "step": prev, "timeout": wait_s}, wait_s + self._answer_timeout())
        except DaemonUnavailable as exc:
            gone = self._daemon_failed()  # this start's daemon could not start: it never served, nor will
            if gone is None and staging.served(self.ndir) is False:
                gone = "its process has ended"  # the kernel dropped its lock: nothing reads the slot
            if gone is not None:
                log.info("slot %d (snapshot %s) is free: no daemon serves %s (%s; %s)", slot, prev, self.ndir, gone,
                         exc)
                return True, None
            if self._silent_since is None:
                self._silent_since = time.monotonic()
            return False, f"not answering for {time.monotonic() - self._silent_since:.1f} s ({exc}){STARVED}"
        return bool(reply.get("released")), None

    def _answer_timeout(self) -> float:
        """How long to wait for an answer the daemon gives at once: :attr:`answer_s`, or :data:`PROBE_S` while it
        has been silent (each later snapshot only asks whether it is back)."""
        return min(self.answer_s, PROBE_S) if self._silent_since is not None else self.answer_s

    def _episodes(self, step: int, extras: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rank 0, at every snapshot's exchange: one ``warning`` event when a node starts skipping snapshots (no
        free slot on one of its ranks), one log line when its daemon releases again; returns the nodes that
        resumed now (for the snapshot event)."""
        layout = self.rt.layout
        now = time.monotonic()
        resumed = []
        for node in range(layout.num_nodes):
            busy = [r for r in layout.shard_ranks(node) if not extras[r]["slot_ok"]]
            host = self._host(node)
            if busy and node not in self._skipping:
                self._skipping[node] = (step, now)
                why = extras[busy[0]].get("slot_why")
                reason = (f"snapshot {step} skipped on {host} (rank {busy[0]}): {why}; training goes on, and the "
                          f"snapshots of every node are skipped until the daemon on {host} releases its slots")
                log.warning("%s", reason)
                if self.events is not None:
                    self.events.emit("warning", step=step, hostname=host, node_index=node, reason=reason)
            elif not busy and node in self._skipping:
                first, since = self._skipping.pop(node)
                line = (f"the checkpoint daemon on {host} released its slots again after {now - since:.1f} s "
                        f"(snapshots from {first} to before {step} skipped); snapshots resume")
                log.warning("%s", line)
                resumed.append({"hostname": host, "first_skipped": first, "skipping_s": round(now - since, 3),
                                "reason": line})
        return resumed

    def _host(self, node: int) -> str:
        names = list(getattr(self.rt.ctx, "nodelist", None) or ())
        return str(names[node]) if node < len(names) else f"node {node}"

    def _request(self, msg: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One request; the first contact waits (bounded) for a daemon that is still starting (nothing listens
        yet); a daemon that took the connection but is silent is not waited for."""
        timeout = timeout_s or self.cfg.timeouts.control_s
        patience = self.cfg.timeouts.startup_s if not self._contacted else 0.0
        deadline = time.monotonic() + patience
        while True:
            try:
                reply = request(self.sock, msg, timeout)
                self._contacted = True
                self.down = None
                self._silent_since = None
                if not reply.get("ok"):
                    raise DaemonUnavailable(reply.get("error", "refused"))
                return reply
            except DaemonSilent:
                if self._silent_since is None:
                    self._silent_since = time.monotonic()
                raise
            except DaemonUnavailable as exc:
                failed = self._daemon_failed()
                if time.monotonic() >= deadline or failed:
                    if not self._contacted:
                        self._contacted = True  # the patience is spent once per start, not once per snapshot
                        self._went_down(failed or str(exc))
                    raise
                threading.Event().wait(0.1)

    def _daemon_failed(self) -> str | None:
        """The reason this node's daemon left in the run directory when it could not start (this start only)."""
        rec = read_json(self._failed_marker)
        if isinstance(rec, dict) and rec.get("restart") == self.rt.ctx.restart_count:
            return str(rec.get("reason"))
        return None

    def _went_down(self, why: str) -> None:
        """No daemon on this node: training goes on without snapshots here; say so once."""
        self.down = why
        log.warning("no checkpoint daemon on %s: %s; training goes on without snapshots on this node",
                    self.rt.ctx.hostname, why)
        if self.events is not None and self.rt.local_rank == 0:
            self.events.emit("warning", step=None, hostname=self.rt.ctx.hostname,
                             reason=f"no checkpoint daemon on {self.rt.ctx.hostname}: {why}; training goes on "
                                    f"without snapshots on this node")

    def wait(self, step: int, timeout_s: float) -> str | None:
        """Block until the daemon reports a final state for ``step`` (or the timeout); return the state."""
        self.join_handover()
        try:
            reply = self._request({"op": "wait", "step": step, "timeout": timeout_s}, timeout_s + 10)
        except DaemonUnavailable as exc:
            log.warning("cannot wait for snapshot %d: %s", step, exc)
            return None
        return reply.get("state")

    def settle(self, step: int, timeout_s: float) -> tuple[str | None, str]:
        """Collective: make sure this start has a snapshot of committed step ``step`` (staged now unless one was
        taken), then wait up to ``timeout_s`` until this node's daemon settles it.

        Returns ``(state, why)``: the daemon's final state (``verified``, ``rejected``, ``failed``) and its reason,
        or ``None`` and why there is none (the snapshot skipped, not handed over, no daemon, not settled in time).
        Every rank takes part in the snapshot's exchange even when its own node cannot take it.
        """
        if step not in self.taken and not self.snapshot(step, slot_wait_s=timeout_s):
            return None, f"snapshot {step} skipped (no free staging slot: the warning event says why)"
        self.join_handover()
        if self.last_error and self.last_error.startswith(f"snapshot {step}:"):
            return None, f"not handed to the checkpoint daemon ({self.last_error})"
        try:
            reply = self._request({"op": "wait", "step": step, "timeout": timeout_s}, timeout_s + 10)
        except DaemonUnavailable as exc:
            return None, f"no answer from the checkpoint daemon on {self.rt.ctx.hostname}: {exc}"
        state = reply.get("state")
        if reply.get("unknown"):  # handed to a daemon killed since; the one serving now never had it
            return None, str(reply.get("reason"))
        if state not in FINAL:
            return None, f"not settled within {timeout_s:g} s (the daemon has it {state or 'not at all'})"
        return state, str(reply.get("reason") or f"the daemon {state} it")

    def snapshot_and_wait(self, step: int, timeout_s: float) -> str | None:
        """Collective: make sure a snapshot of the current step exists and wait until the daemon settles it.

        Used before a requeue (pre-timeout signal, preemption).  Returns the daemon's
        final state for the step (``committed``/``verified``/``rejected``/``failed``)
        or None when no daemon answered or the snapshot could not be staged.
        """
        if step not in self.taken and not self.snapshot(step):
            return None
        return self.wait(step, timeout_s)

    def close(self) -> None:
        """Join the last hand-over (the daemon then has every snapshot taken); the slots stay for the daemon
        until it is done with them."""
        self.join_handover()
        if self._prefault is not None:
            self._prefault.join(self.cfg.timeouts.shutdown_s)
        worker, self._worker = self._worker, None
        if worker is not None:  # ended and joined before the interpreter's shutdown can reach it
            self._jobs.put(None)
            worker.join(self.cfg.timeouts.shutdown_s)
