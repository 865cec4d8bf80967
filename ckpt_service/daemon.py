"""``accelpact-ckptd``: one per node per job; writes, verifies, retains and publishes the node's snapshots.

Threads (all named, each fed by a queue with a sentinel, joined with a deadline): ``ckptd-accept`` (the Unix socket;
one short ``ckptd-conn`` thread per request); ``ckptd-writer`` (a step straight from the ranks' shared-memory slots,
committed once every rank of the node staged it); ``ckptd-verifier`` (checksums and coverage -> verified |
rejected); ``ckptd-deleter`` (retention: rename to ``.del-``, then remove; never the newest step verified on every
node, read from the other nodes' published indexes, so a node whose writes keep failing still shares a step with the
others); ``ckptd-tier`` (verified copies to the shared tier, once per job, :func:`ckpt_service.tiers.should_upload`,
then the tier's retention; one ``shared_upload`` event per copy).

A rank that dies after staging does not stop its snapshot: the slots and descriptors belong to the daemon once every
rank of the node staged.  A rank reuses a slot only after ``released`` says its step left the writer.  On SIGTERM the
daemon stops accepting, finishes what is queued up to ``drain_s``, and exits.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from accelpact_slurm.core import settings
from accelpact_slurm.core.errors import CheckpointError
from accelpact_slurm.core.events import EVENTS_FILE, EventLog
from accelpact_slurm.core.faults import NO_FAULTS, TestFaults
from accelpact_slurm.core.safeopen import open_writable

from ckpt_service import committed, faults, seal, staging
from ckpt_service.index import dir_size, publish_index, read_indexes, read_record, record_state, scan
from ckpt_service.layout import DEL_PREFIX, LOCK, MAX_STEP, daemon_failed_marker, private_dir, shared_dir as default_shared, socket_path, staging_root
from ckpt_service.protocol import FINAL, peer_allowed, peer_uid, recv_line, send_line
from ckpt_service.retention import Snap, newest_common, plan_retention
from ckpt_service.tiers import copy_to_shared, prune_shared, should_upload
from ckpt_service.auth import load_or_create_key
from ckpt_service.verify import verify_snapshot
from ckpt_service.dcp_write import recover_node_dir, write_snapshot

log = logging.getLogger(__name__)

_SENTINEL = object()
#: How long a state record that hit a full disk waits for the writes in flight before its one retry.
RECORD_RETRY_S = 60.0
#: How long a starting daemon retries its node directory's lock before it says another daemon holds it.
LOCK_RETRY_S = 1.0

#: How the worker threads yield the CPU to the node's training ranks (per thread; the accept and connection
#: threads keep the daemon's ``checkpoint.daemon_nice``, so a rank's request is answered at once):
#:
#: - ``"idle"``: ``SCHED_IDLE`` (Linux): the thread runs only on a core no rank wants, and a rank that wakes
#:   (a collective's data arrived) takes the core back at once.  A niced thread (weight 110 at niceness 10)
#:   keeps the core for its time slice instead, and ranks in lock step all wait for the one delayed;
#: - an int: that niceness, at least.
#:
#: The writer yields too: a rank's next due snapshot waits for its slot at most ``timeouts.control_s`` and is
#: skipped (an event, training goes on) when the writer could not finish by then; one asked for (the job's end,
#: ``run.save()``) waits up to ``timeouts.startup_s`` while the daemon answers.
#: ``ACCELPACT_CKPTD_IDLE=0`` (:mod:`accelpact_slurm.core.settings`) keeps them at the daemon's niceness.
BACKGROUND = {"ckptd-writer": "idle", "ckptd-verifier": "idle", "ckptd-tier": "idle", "ckptd-deleter": "idle"}


def lower_priority(how: int | str) -> int | str | None:
    """Lower this thread's CPU priority (never raise it): ``"idle"`` (``SCHED_IDLE``, else niceness 19 where that
    policy is missing) or a niceness.  Returns what the thread runs at now (``"idle"`` or its niceness), None
    where it cannot be told (priorities are an optimisation only)."""
    try:
        tid = threading.get_native_id()
        if how == "idle":
            if hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
                return "idle" if os.sched_getscheduler(0) == os.SCHED_IDLE else None
            how = 19
        cur = os.getpriority(os.PRIO_PROCESS, tid)
        if isinstance(how, int) and how > cur:
            os.setpriority(os.PRIO_PROCESS, tid, how)
            cur = os.getpriority(os.PRIO_PROCESS, tid)
        return cur
    except (OSError, AttributeError):
        return None


class AlreadyRunning(CheckpointError):
    """Another daemon holds this node directory's lock."""


@dataclass
class DaemonOptions:
    """What one node's daemon needs (built by ``accelpact-ckptd`` from the job file and its flags).

    ``node_index``, ``num_nodes`` and ``every_steps`` choose which node uploads which snapshot to the
    shared tier (:func:`ckpt_service.tiers.should_upload`); ``shared_every`` 0 sends only milestones.
    """

    node: str
    node_dir: str
    run_dir: str
    shared_dir: str | None = None
    node_index: int | None = None
    num_nodes: int | None = None
    job_id: str | None = None
    restart: int = 0
    every_steps: int = 0
    keep_last: int = 2
    milestone_every: int = 0
    shared_every: int = 2
    shared_keep: int = 2
    compress: bool = False
    faults: TestFaults = NO_FAULTS  # test-only fault injection (accelpact_slurm.core.faults)
    drain_s: float = 120.0
    conn_timeout_s: float = 30.0


@dataclass
class _Pending:
    nranks: int
    paths: dict[int, str] = field(default_factory=dict)


def acquire_lock(ndir: str) -> int:
    """Take the node directory's lock (flock: released by the kernel when the holder dies, even by kill -9)."""
    os.makedirs(ndir, exist_ok=True)
    path = os.path.join(ndir, LOCK)
    fd, _st = open_writable(path, mode=0o600)  # never through a link planted at the name (core.safeopen)
    deadline = time.monotonic() + LOCK_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            # a rank testing whether a daemon lives (staging.served) holds a shared lock for an instant
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
        try:
            holder = os.pread(fd, 64, 0).decode().strip() or "?"
        finally:
            os.close(fd)
        raise AlreadyRunning(f"another accelpact-ckptd (pid {holder}) already serves {ndir} "
                             f"(lock {path}); one daemon per node per job")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class Daemon:
    def __init__(self, opts: DaemonOptions) -> None:
        self.o = opts
        self.ndir = opts.node_dir
        self.shared = default_shared(opts.run_dir, opts.shared_dir)
        self.sock_path = socket_path(self.ndir)
        self.stage_root = staging_root(self.ndir)
        self.events = EventLog(os.path.join(opts.run_dir, EVENTS_FILE), job_id=opts.job_id, rank=None, restart=opts.restart,
                               node=opts.node_index, source="ckptd")
        self._lock_fd: int | None = None
        self._server: socket.socket | None = None
        self._accepting = threading.Event()
        self._mu = threading.Lock()
        self._changed = threading.Condition(self._mu)
        self._publish_mu = threading.Lock()  # the node's index: scanned and written by one thread at a time
        self._pending: dict[int, _Pending] = {}
        self._states: dict[int, tuple[str, str | None]] = {}
        self._inflight: set[int] = set()  # complete steps queued for, or inside, the writer
        self.q_write: queue.Queue = queue.Queue()
        self.q_verify: queue.Queue = queue.Queue()
        self.q_delete: queue.Queue = queue.Queue()
        self.q_tier: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:

        self.key = load_or_create_key(self.o.run_dir)  # signs every manifest; a bad key file stops the start
        self._lock_fd = acquire_lock(self.ndir)
        try:  # a daemon of an earlier start that could not start left word for the ranks: it is stale now
            os.unlink(daemon_failed_marker(self.o.run_dir, self.o.node))
        except FileNotFoundError:
            pass
        removed = recover_node_dir(self.ndir)
        if removed:
            log.warning("removed leftovers of an interrupted daemon: %s", removed)
        staging.drop_all(self.stage_root)
        for rec in scan(self.ndir, self.o.milestone_every):
            self._states[rec.step] = (rec.state, rec.reason)
            if rec.state == "committed":
                self.q_verify.put(rec.step)
        self._publish()
        private_dir(os.path.dirname(self.sock_path))
        try:
            os.unlink(self.sock_path)  # stale: we hold the lock, so no live daemon owns it
        except FileNotFoundError:
            pass
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            srv.bind(self.sock_path)
        finally:
            os.umask(old)
        os.chmod(self.sock_path, 0o600)
        srv.listen(64)
        srv.settimeout(0.2)
        self._server = srv
        self._accepting.set()
        for name, target, q in (("ckptd-writer", self._write_loop, self.q_write),
                                ("ckptd-verifier", self._verify_loop, self.q_verify),
                                ("ckptd-deleter", self._delete_loop, self.q_delete),
                                ("ckptd-tier", self._tier_loop, self.q_tier)):
            t = threading.Thread(target=self._worker, args=(q, target), name=name, daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._accept_loop, name="ckptd-accept", daemon=True)
        t.start()
        self._accept_thread = t
        log.info("serving %s at %s", self.ndir, self.sock_path)

    def drain_and_close(self) -> bool:
        """Stop accepting, finish queued work up to ``drain_s``; True when everything finished."""
        self._accepting.clear()
        self._accept_thread.join(timeout=5)
        if self._server is not None:
            self._server.close()
            try:
                os.unlink(self.sock_path)
            except OSError:
                pass
        deadline = time.monotonic() + self.o.drain_s
        done = True
        # Order matters: the writer feeds the verifier, which feeds the deleter and the tier.
        for t, q in zip(self._threads, (self.q_write, self.q_verify, self.q_delete, self.q_tier)):
            q.put(_SENTINEL)
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            done = done and not t.is_alive()
        with self._mu:
            abandoned = sorted(self._pending)
        for step in abandoned:
            staging.drop_step(self.stage_root, step)
        if abandoned:
            log.warning("abandoned incomplete staged steps %s (a rank never staged them)", abandoned)
        if done:
            staging.drop_all(self.stage_root)  # no shared memory left behind by a finished daemon
        self.events.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        return done

    # ------------------------------------------------------------------ socket

    def _accept_loop(self) -> None:
        assert self._server is not None
        while self._accepting.is_set():
            try:
                conn, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            threading.Thread(target=self._serve, args=(conn,), name="ckptd-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.o.conn_timeout_s)
            try:
                ok, why = peer_allowed(peer_uid(conn))
                if not ok:
                    log.warning("refused a connection: %s", why)
                    send_line(conn, {"ok": False, "error": f"refused: {why}"})
                    return
                msg = recv_line(conn)
                send_line(conn, self.handle(msg))
            except Exception as exc:  # a client that vanished must not take the daemon down
                log.warning("request failed: %s", exc)

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if "step" in msg:
            step = msg["step"]
            if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
                return {"ok": False, "error": f"step {step!r} is not an integer from 0 to {MAX_STEP}"}
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "node": self.o.node}
        if op == "staged":
            return self._on_staged(int(msg["step"]), int(msg["local_rank"]), int(msg["nranks"]), msg["path"])
        if op == "released":
            # a rank asks before reusing the slot that held ``step``: block until the writer is done with it
            step, timeout = int(msg["step"]), float(msg.get("timeout", 60))
            deadline = time.monotonic() + timeout
            with self._changed:
                while step in self._inflight or step in self._pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                busy = step in self._inflight or step in self._pending
                state, reason = self._states.get(step, (None, None))
            return {"ok": True, "step": step, "released": not busy, "state": state, "reason": reason}
        if op == "status":
            with self._mu:
                return {"ok": True, "states": {str(k): list(v) for k, v in self._states.items()},
                        "pending": sorted(self._pending)}
        if op == "wait":
            step, timeout = int(msg["step"]), float(msg.get("timeout", 60))
            deadline = time.monotonic() + timeout
            with self._changed:
                if step not in self._states and step not in self._pending and step not in self._inflight:
                    # a rank waits only after its hand-over was answered: a step this daemon never heard of was
                    # handed to an earlier daemon of the node, killed since (the launcher started this one)
                    return {"ok": True, "step": step, "state": None, "unknown": True,
                            "reason": f"this daemon (pid {os.getpid()}) was never handed snapshot {step}: "
                                      f"an earlier daemon of this node took it and ended"}
                while self._states.get(step, ("",))[0] not in FINAL:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                state, reason = self._states.get(step, (None, None))
            return {"ok": True, "step": step, "state": state, "reason": reason}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _on_staged(self, step: int, local_rank: int, nranks: int, path: str) -> dict[str, Any]:
        with self._mu:
            pend = self._pending.setdefault(step, _Pending(nranks))
            pend.paths[local_rank] = path
            complete = len(pend.paths) >= pend.nranks
            stale: list[int] = []
            if complete:
                del self._pending[step]
                self._inflight.add(step)
                # Every rank hands its snapshots over in step order, one at a time: once all have handed this one,
                # an older step still short of ranks never completes (a rank handed it to a daemon of this node
                # killed since): dropped now, or the ranks' slots that hold it would stay busy to the end.
                stale = sorted(s for s in self._pending if s < step)
                for s in stale:
                    del self._pending[s]
        for s in stale:
            staging.drop_step(self.stage_root, s)
            self._set_state(s, "failed", f"snapshot {s} was handed to this daemon by some of the node's ranks only "
                                         f"(the others handed it to an earlier daemon, ended since)", None, None)
        faults.pause_point("staging", self.ndir, step, self.o.faults)
        if complete:
            self.q_write.put((step, dict(pend.paths)))
        return {"ok": True, "step": step, "complete": complete}

    # ------------------------------------------------------------------ workers

    def _worker(self, q: queue.Queue, fn: Callable[[Any], None]) -> None:
        how = BACKGROUND.get(threading.current_thread().name, 0)
        lower_priority(how if how != "idle" or settings.ckptd_idle() else 0)
        while True:
            item = q.get()
            if item is _SENTINEL:
                return
            try:
                fn(item)
            except Exception:  # background failures are logged, never fatal
                log.exception("%s failed on %r", threading.current_thread().name, item)

    def _set_state(self, step: int, state: str, reason: str | None, path: str | None, size: int | None,
                   timings: dict[str, float] | None = None) -> None:
        with self._changed:
            self._states[step] = (state, reason)
            self._changed.notify_all()
        extra = {f"{k}_s": round(v, 3) for k, v in (timings or {}).items()}
        self.events.emit("checkpoint", step=step, state=state, size_bytes=size, path=path, reason=reason,
                         hostname=self.o.node, **extra)
        self._publish()

    def _publish(self) -> None:
        # One at a time, scan and write together: the verifier's scan taken before the deleter's deletions and
        # written after the deleter's own index listed deleted snapshots as verified (the fault campaign, 1 run
        # in ~45: "in the index, files gone").
        with self._publish_mu:
            try:
                publish_index(self.o.run_dir, self.o.node, scan(self.ndir, self.o.milestone_every))
            except OSError:
                log.warning("could not publish the checkpoint index", exc_info=True)

    def _write_loop(self, item: tuple[int, dict[int, str]]) -> None:

        step, paths = item
        try:
            descs = []
            for lr in sorted(paths):
                d = staging.read_descriptor(paths[lr])
                d["buf"] = staging.map_slot(d["slot"], d["slot_ino"], d["nbytes"])
                descs.append(d)
            self._check_stamps(step, descs)  # the slots still hold this step (a rank reuses only a released one)
            timings: dict[str, float] = {}
            t0 = time.monotonic()
            path, size = write_snapshot(self.ndir, step, descs, compress=self.o.compress, node=self.o.node,
                                        timings=timings, faults=self.o.faults, key=self.key,
                                        before_commit=lambda: self._check_stamps(step, descs))
            log.info("step %d committed in %.2f s (%s)", step, time.monotonic() - t0,
                     ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()))
        except Exception as exc:
            reason = str(exc) if isinstance(exc, CheckpointError) else f"{exc.__class__.__name__}: {exc}"
            log.error("snapshot %d failed: %s", step, reason)
            self._set_state(step, "failed", reason, None, None)
            self._release(step)
            return
        finally:
            descs = []  # drop the slot mappings before the rank may reuse them
            staging.drop_step(self.stage_root, step)
        self._set_state(step, "committed", None, path, size, timings)
        self._release(step)
        self.q_verify.put(step)

    @staticmethod
    def _check_stamps(step: int, descs: list[dict[str, Any]]) -> None:
        """Refuse to write (or, once written, to commit) step ``step`` unless every slot is still stamped with it.

        A rank reuses a slot only once :meth:`handle` ``released`` said so; this is the guard behind that rule: a
        slot rewritten meanwhile (a rank that took silence for release, a daemon resumed after SIGSTOP) fails the
        snapshot instead of committing another step's weights under this step's name."""
        for d in descs:
            why = staging.check_stamp(d["buf"], d)
            if why is not None:
                raise CheckpointError(f"{why}; snapshot {step} not committed")

    def _release(self, step: int) -> None:
        with self._changed:
            self._inflight.discard(step)
            self._changed.notify_all()

    def _verify_loop(self, step: int) -> None:

        rec = read_record(os.path.join(self.ndir, f"step-{step:010d}"), self.o.milestone_every)
        if rec is None or not os.path.isdir(rec.path):
            return
        faults.slow_verify(self.o.node, self.o.faults)
        sealed: dict[str, Any] = {}  # the files it hashed: a reload of them unchanged needs no second hash
        ok, reason = verify_snapshot(rec.path, self.key, seal_out=sealed)
        state = "verified" if ok else "rejected"
        self._record_state(rec.path, state, None if ok else reason, **({seal.KEY: sealed} if ok and sealed else {}))
        self._set_state(step, state, None if ok else reason, rec.path, rec.size_bytes)
        if ok:
            o = self.o
            try:  # the newest step this node committed, signed: a later start that loads an older one says so
                committed.record(o.run_dir, o.node, step, self.key)
            except OSError as exc:
                log.warning("could not record step %d as this node's newest committed: %s", step, exc)
            up, why = should_upload(step, every_steps=o.every_steps, shared_every=o.shared_every,
                                    milestone_every=o.milestone_every, node_index=o.node_index, num_nodes=o.num_nodes)
            log.debug("shared tier, step %d: %s", step, why)
            if up:  # the step is this node's newest: retention keeps it until keep_last newer ones are verified
                self.q_tier.put((step, rec.path, why))
        self.q_delete.put(None)

    def _record_state(self, path: str, state: str, reason: str | None, **extra: Any) -> None:
        """``record_state``; on a full disk, once more after the writes in flight now have ended.

        A write that fills the disk fails and gives its space back (its temporary directory is removed): a
        verification that finished meanwhile must not leave a good snapshot recorded as merely committed.
        """
        try:
            record_state(path, state, reason, **extra)
            return
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            log.warning("recording %s for %s: disk full; retrying once the writes in flight have ended", state, path)
        deadline = time.monotonic() + RECORD_RETRY_S
        with self._changed:
            busy = set(self._inflight)
            while busy & self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
        record_state(path, state, reason, **extra)

    def _delete_loop(self, _item: Any) -> None:
        records = scan(self.ndir, self.o.milestone_every)
        snaps = [Snap(r.step, r.state) for r in records]
        common, common_why = self._newest_common(records)
        deletions, why = plan_retention(snaps, self.o.keep_last, self.o.milestone_every,
                                        protect=() if common is None else (common,))
        if common is not None and any(s.step == common for s in snaps):
            log.debug("retention keeps step %d: %s", common, common_why)
        for step, reason in deletions:
            src = os.path.join(self.ndir, f"step-{step:010d}")
            aside = os.path.join(self.ndir, f"{DEL_PREFIX}step-{step:010d}-{os.getpid()}")
            try:
                os.rename(src, aside)  # never listed half-deleted
                shutil.rmtree(aside)
                log.info("deleted step %d: %s", step, reason)
            except OSError:
                log.warning("could not delete step %d", step, exc_info=True)
        if deletions:
            self._publish()

    def _newest_common(self, records: list[Any]) -> tuple[int | None, str]:
        """The newest step verified here and on every other node that published an index (their files are
        read now: a node whose daemon never started has a ``daemon-failed`` marker, no index)."""
        per_node = {node: [s["step"] for s in snaps if s.get("state") == "verified" and isinstance(s.get("step"), int)]
                    for node, snaps in read_indexes(self.o.run_dir, exclude=self.o.node).items()}
        if not per_node:
            return None, "no other node has published an index"
        per_node[self.o.node] = [r.step for r in records if r.state == "verified"]
        return newest_common(per_node)

    def _tier_loop(self, item: tuple[int, str, str]) -> None:
        """Copy one verified snapshot to the shared tier, then apply the tier's retention; one event."""
        step, path, due = item
        t0 = time.monotonic()
        try:
            dst, why = copy_to_shared(path, self.shared, self.o.node)
        except OSError as exc:  # a full or unreachable shared file system: the node's copy is still there
            seconds = time.monotonic() - t0
            log.warning("could not copy step %d to the shared tier %s: %s", step, self.shared, exc)
            self.events.emit("shared_upload", step=step, ok=False, source=path, path=None, size_bytes=None,
                             copy_s=round(seconds, 3), hostname=self.o.node, reason=f"{due}; copy failed: {exc}")
            return
        seconds = time.monotonic() - t0
        if dst is None:  # another node's copy won the rename (a milestone, or a restart copy)
            log.info("shared tier, step %d: %s", step, why)
            return
        size = dir_size(dst)
        pruned = prune_shared(self.shared, self.o.shared_keep, self.o.milestone_every, self.o.node)
        log.info("uploaded step %d to the shared tier: %d bytes in %.2f s (%s)%s", step, size, seconds, due,
                 f"; deleted shared step(s) {[s for s, _ in pruned]}" if pruned else "")
        self.events.emit("shared_upload", step=step, ok=True, source=path, path=dst, size_bytes=size,
                         copy_s=round(seconds, 3), hostname=self.o.node, reason=due,
                         pruned=[s for s, _ in pruned])
