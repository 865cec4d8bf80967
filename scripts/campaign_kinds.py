"""The fault kinds of the campaign (``scripts/campaign.py``): how each is prepared, injected and cleaned up.

Each kind injects ONE fault into one run of the decoder job on the embedded default (2 emulated nodes x 2 ranks).
A kind either acts from outside (the campaign's monitor sends the signal when the job's ``events.jsonl`` shows the
chosen moment) or through the project's own test switches (:mod:`accelpact_slurm.core.faults`, ``--inject-fault``).

Phases (where a kind allows them):

- ``update``: while update U runs (rank 0's ``step`` event of U-1 seen, then a random delay within an update; U-1
  is no snapshot's update);
- ``snapshot``: the first snapshot of the start (rank 0's ``step`` event of the first snapshot's update: the
  capture, its proof and the hand-off to the daemon run then; a daemon's: its ``snapshot`` event, the write);
- ``restore``: the second start's restore, after a planned stop (``ACCELPACT_CKPT_EXIT_AFTER_VERIFIED``: every rank
  exits 75 once the first snapshot is verified, the launcher relaunches the job, as a requeue would): the fault hits
  between the restarted target's ``membership`` event and the start's first committed update;
- ``repair``: the link drops are themselves an L1 repair (boundary, backward).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from typing import Any

from accelpact_slurm.core import faults as tf
from accelpact_slurm.runtime.transport.store import CANDIDATES, binding, port_candidates
from ckpt_service.auth import load_or_create_key

#: Every kind, in the order of the summary table; ``phases`` the phases it draws from.
KINDS: dict[str, tuple[str, ...]] = {
    "kill_rank": ("update", "snapshot", "restore"),
    "kill_daemon": ("update", "snapshot", "restore"),
    "kill_node": ("update", "snapshot", "restore"),
    "stop_rank0": ("update", "snapshot"),
    "stop_rank": ("update", "snapshot"),
    "link_boundary": ("repair", "snapshot"),
    "link_backward": ("repair",),
    "disk_full": ("snapshot",),
    "daemon_commit_kill": ("snapshot",),
    "straggler": ("update",),  # slow in an update's forward (ACCELPACT_TEST_SLOW_AT): no snapshot phase
    "squat_ports": ("start",),
}

#: Stops a kind may end with instead of the uninterrupted run's digest: (kind, text the last ``fail_stop`` holds,
#: name). None today: every kind must end bitwise.
NAMED_STOPS: dict[str, list[tuple[str, str]]] = {}

STRAGGLER_FROM = 7  # the first update a straggler is drawn at: the detector has learned its bound by then
#: How much longer the straggler's forward takes: well past the bound its peers learn (0.5 s, the link floor, here)
#: and under the campaign job's collective ceiling (3 s): longer is a hang, whatever the detector does ("3x" of a
#: bound learned on a loaded machine read 5.7 s once).
STRAGGLER_S = 1.5
DISK_MB = 6  # the node-local tmpfs of ``disk_full``: ~10 of the tiny job's snapshots (~0.55 MB each)
DISK_FREE_KB = 64  # what the filler leaves free: less than one snapshot's data


class Fault:
    """One drawn fault. The campaign calls ``prepare`` (before the start), ``env``/``args`` (the launcher's),
    ``poll`` (every monitor tick, with the events so far), ``fault_ts`` and ``cleanup`` (always)."""

    def __init__(self, kind: str, phase: str, update: int, rank: int, shape: dict[str, int], rng: random.Random):
        self.kind, self.phase, self.update, self.rank, self.shape = kind, phase, update, rank, shape
        self.delay_s = rng.uniform(0.0, 0.15)
        self.injected_ts: float | None = None
        self.armed_ts: float | None = None
        self.stopped: list[int] = []
        self.notes: list[str] = []
        self.mount: str | None = None
        self.filler: str | None = None
        self.socks: list[socket.socket] = []
        self.derived: dict[int, list[int]] = {}  # squat_ports: start -> its derived store ports, in order

    # ------------------------------------------------------------------ description

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "phase": self.phase, "update": self.update, "rank": self.rank}

    @property
    def node(self) -> int:
        return self.rank // self.shape["ranks_per_node"]

    # ------------------------------------------------------------------ before the start

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if self.phase == "restore":
            env[tf.EXIT_AFTER_VERIFIED] = str(self.shape["every_steps"])
        if self.kind == "daemon_commit_kill":
            env[tf.CKPTD_KILL_AT] = f"renamed:{self.update}:node{self.node + 1}"
        if self.kind == "straggler":
            env[tf.SLOW_AT] = f"{self.update}:{self.rank}:{STRAGGLER_S:g}"
        if self.kind == "squat_ports":  # as under the sbatch template: no launcher port, the derived ones only
            env[tf.NO_LAUNCHER_PORT] = "1"
        return env

    def args(self) -> list[str]:
        if self.kind == "link_boundary":
            return ["--inject-fault", f"boundary:{self.update}:{self.rank}"]
        if self.kind == "link_backward":
            return ["--inject-fault", f"backward:{self.update}:{self.rank}"]
        return []

    def prepare(self, run_dir: str, job_id: str, local_dir: str | None) -> None:
        if self.kind == "disk_full" and local_dir:
            os.makedirs(local_dir, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m,mode=0700", "tmpfs", local_dir],
                           check=True, capture_output=True, text=True, timeout=30)
            self.mount = local_dir
        if self.kind == "squat_ports":
            self._squat(run_dir, job_id)

    def _squat(self, run_dir: str, job_id: str) -> None:
        """Listen on the first half of the store ports every start of this job derives from the run's key."""
        key = load_or_create_key(run_dir)
        for restart in range(3):
            # bound to the job's step as the ranks bind it (runtime/job/topology.py: JOB.STEP; the embedded default's
            # ranks run as step 0): without the step these are another job's ports, and nothing is squatted
            self.derived[restart] = port_candidates(key, binding(f"{job_id}.0", restart))
            for port in self.derived[restart][:CANDIDATES // 2]:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind(("127.0.0.1", port))
                    s.listen(1)
                    self.socks.append(s)
                except OSError:
                    s.close()
        self.notes.append(f"{len(self.socks)} of the job's derived store ports squatted")
        self.injected_ts = time.time()

    # ------------------------------------------------------------------ while it runs

    def poll(self, run_dir: str, events: list[dict[str, Any]], local_dir: str | None) -> None:
        """Inject the fault when its moment has come (once)."""
        if self.kind in ("squat_ports", "link_boundary", "link_backward", "daemon_commit_kill", "straggler"):
            return  # injected by the project's own switches, or before the start
        if self.kind == "disk_full":
            self._disk(events, local_dir)
            return
        if self.injected_ts is not None:
            return
        restart = 1 if self.phase == "restore" else 0
        if not self._due(events, restart):
            return
        pids = self._targets(run_dir, events, restart, local_dir)
        if pids is None:
            return
        sig = signal.SIGSTOP if self.kind.startswith("stop_") else signal.SIGKILL
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                self.notes.append(f"pid {pid} had ended already")
        if sig == signal.SIGSTOP:
            self.stopped.extend(pids)
        self.injected_ts = time.time()
        self.notes.append(f"{signal.Signals(sig).name} to pid(s) {pids}")

    def _due(self, events: list[dict[str, Any]], restart: int) -> bool:
        steps = [e for e in events if e.get("event") == "step" and e.get("restart") == restart]
        if self.phase == "restore":
            return any(e.get("event") == "membership" and e.get("restart") == 1 for e in events) and not steps
        if self.phase == "snapshot":
            first = self.shape["every_steps"]
            if self.kind == "kill_daemon":
                return any(e.get("event") == "snapshot" and e.get("restart") == 0 and e.get("step") == first
                           for e in events)
            return any(e.get("step") == first for e in steps)
        seen = [e for e in steps if e.get("step") == self.update - 1]
        if not seen:
            return False
        if self.armed_ts is None:
            self.armed_ts = time.monotonic()
        return time.monotonic() - self.armed_ts >= self.delay_s

    def _targets(self, run_dir: str, events: list[dict[str, Any]], restart: int,
                 local_dir: str | None) -> list[int] | None:
        """The pids to signal, or None while they are not known yet."""
        members = {e["rank"]: e for e in events if e.get("event") == "membership" and e.get("restart") == restart}
        if self.kind in ("kill_rank", "stop_rank", "stop_rank0"):
            m = members.get(self.rank)
            return None if m is None else [int(m["pid"])]
        daemon = self._daemon_pid(run_dir, local_dir, events, restart)
        if self.kind == "kill_daemon":
            return None if daemon is None else [daemon]
        ranks = [int(m["pid"]) for r, m in members.items() if m.get("node") == self.node]
        if len(ranks) < self.shape["ranks_per_node"] or daemon is None:
            return None
        return ranks + [daemon]

    def _daemon_pid(self, run_dir: str, local_dir: str | None, events: list[dict[str, Any]],
                    restart: int) -> int | None:
        """The node's daemon of this start: the pid its lock file records (the holder writes it)."""
        parent = local_dir or os.path.join(run_dir, "node-local")
        try:
            with open(os.path.join(parent, f"node{self.node + 1}", "ckptd.lock")) as fh:
                pid = int(fh.read().strip() or 0)
        except (OSError, ValueError):
            return None
        if not pid or not os.path.exists(f"/proc/{pid}"):
            return None
        if restart and pid == getattr(self, "_first_daemon", None):
            return None  # the first start's daemon, not yet replaced
        if not restart:
            self._first_daemon = pid
        return pid

    def _disk(self, events: list[dict[str, Any]], local_dir: str | None) -> None:
        """Fill the node-local tmpfs once the update before the snapshot has run; free it once a snapshot failed."""
        if local_dir is None:
            return
        if self.filler is None:
            steps = [e for e in events if e.get("event") == "step" and e.get("restart") == 0]
            if any(e.get("step") == self.update - 1 for e in steps):
                self.filler = os.path.join(local_dir, "campaign-filler")
                st = os.statvfs(local_dir)
                fill = max(0, st.f_bavail * st.f_frsize - DISK_FREE_KB * 1024)
                with open(self.filler, "wb") as fh:
                    try:
                        fh.write(b"\0" * fill)
                    except OSError:
                        pass  # as full as it gets
                self.injected_ts = time.time()
                self.notes.append(f"node-local tmpfs filled ({fill // 1024} KiB)")
            return
        if os.path.exists(self.filler) and any(e.get("event") == "checkpoint" and e.get("state") == "failed"
                                               for e in events):
            os.unlink(self.filler)
            self.notes.append("a snapshot failed with the disk full; the filler removed")

    # ------------------------------------------------------------------ after it

    def store_ports(self, events: list[dict[str, Any]]) -> tuple[dict[int, int | None], list[str]]:
        """squat_ports: the store port each start took (its ``job_start`` event's ``store_port``) and what is wrong
        with it: a squatted port, or one that is not among its derived ports (the fall-back was not exercised)."""
        ports = {int(e.get("restart") or 0): e.get("store_port") for e in events if e.get("event") == "job_start"}
        problems = []
        for restart, port in sorted(ports.items()):
            derived = self.derived.get(restart, [])
            if port not in derived:
                problems.append(f"start {restart} took store port {port}, none of its derived ports {derived[:4]}...")
            elif derived.index(port) < CANDIDATES // 2:
                problems.append(f"start {restart} took store port {port}, one of the squatted ones")
            else:
                self.notes.append(f"start {restart}: store at port {port}, derived candidate "
                                  f"{derived.index(port) + 1} of {len(derived)}")
        if not ports:
            problems.append("no start recorded its store port (job_start's store_port)")
        return ports, problems

    def fault_ts(self, events: list[dict[str, Any]]) -> float | None:
        """When the fault happened: the campaign's own injection time, else the project's record of it."""
        if self.kind != "squat_ports" and self.injected_ts is not None:
            return self.injected_ts
        if self.kind == "squat_ports":
            return None  # before the start: there is no training to come back to
        if self.kind in ("link_boundary", "link_backward"):
            ts = [e.get("detected_ts") or e["ts"] for e in events if e.get("event") == "fault"]
            return min(ts) if ts else None
        if self.kind == "straggler":
            steps = [e["ts"] for e in events if e.get("event") == "step" and e.get("step") == self.update - 1
                     and e.get("restart") == 0]
            return steps[0] if steps else None
        if self.kind == "daemon_commit_kill":
            ts = [e["ts"] for e in events if e.get("event") == "snapshot" and e.get("step") == self.update
                  and e.get("restart") == 0]
            return ts[0] if ts else None
        return None

    def cleanup(self) -> list[str]:
        """Undo what the fault set up; what could not be undone."""
        problems = []
        for pid in self.stopped:  # the launcher kills a stopped rank; one left over must not stay stopped
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for s in self.socks:
            s.close()
        self.socks = []
        if self.mount:
            r = subprocess.run(["umount", self.mount], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                problems.append(f"umount {self.mount}: {r.stderr.strip()}")
            self.mount = None
        return problems


def check_kind(spec: str) -> str | None:
    """Why ``KIND[:PHASE]`` names no kind (or no phase of it); None when it does."""
    kind, _, phase = spec.partition(":")
    if kind not in KINDS:
        return f"unknown fault kind {kind!r}: one of {', '.join(KINDS)}"
    if phase and phase not in KINDS[kind]:
        return f"{kind} has no phase {phase!r}: one of {', '.join(KINDS[kind])}"
    return None


def draw(spec: str, rng: random.Random, shape: dict[str, int]) -> Fault:
    """One fault of ``KIND[:PHASE]``: its phase (unless given), update and rank drawn from ``rng``."""
    why = check_kind(spec)
    if why:
        raise ValueError(why)
    kind, _, phase = spec.partition(":")
    drawn = rng.choice(KINDS[kind])  # drawn either way: a given phase leaves the other draws as they were
    phase = phase or drawn
    steps, every = shape["steps"], shape["every_steps"]
    world = shape["nodes"] * shape["ranks_per_node"]
    rank = rng.randrange(world)
    if kind == "stop_rank0":
        rank = 0
    elif kind == "stop_rank":
        rank = rng.randrange(1, world)
    # updates 2..steps-1 (a fault in the first update hits the start itself, one in the last its final snapshot),
    # neither a snapshot's update nor the one after it: a fault landing at their end hits the capture and its proof,
    # which is the snapshot phase
    update = rng.choice([u for u in range(2, steps) if u % every and (u - 1) % every])
    snaps = list(range(every, steps, every))
    if phase == "snapshot" or kind in ("disk_full", "daemon_commit_kill"):
        update = every if phase == "snapshot" and kind not in ("disk_full", "daemon_commit_kill") \
            else rng.choice(snaps)
    if phase == "restore":
        update = every + 1
    if kind == "straggler" and phase == "update":
        # from update 7 on: the detector has learned its bound by then
        update = rng.randrange(min(STRAGGLER_FROM, steps - 1), steps)
    return Fault(kind, phase, update, rank, shape, rng)
