"""The scale part's jobs (``benchmarks/parts/scale.py``): one job of the decoder at a given size, watched while it
runs, and what it leaves to read.

A run starts the job as a user does, ``accelpact-run JOB.yaml --run-dir DIR`` (``python -m
accelpact_slurm.cli.run``; ``--inject-fault`` for the fault run): the embedded default's 2 emulated nodes x 2 ranks
and per-node checkpoint daemons, relaunched in place after a fail-stop; the ranks enter
``benchmarks/parts/scale_entry.py``, which runs the example's own entry point.  Meanwhile a thread of this process
(:class:`Watch`) follows the job's ``events.jsonl``:

- every ``process`` event names a rank or a daemon with its pid and node (per start of the job); every
  :data:`SAMPLE_S` seconds the thread reads ``/proc/<pid>/status`` of each of them still alive (``RssAnon``,
  ``RssFile``, ``RssShmem``, ``VmRSS``) and the bytes the node's staging directory holds in ``/dev/shm``
  (``ckpt_service.layout.staging_root`` of the node's directory: the tmpfs pages its slots hold);
- ``kill`` runs: once rank 0's ``step`` event of update :data:`KILL_AFTER` of the first start is written, the rank
  :data:`KILL_RANK` of that start gets SIGKILL (its pid from its ``process`` event, checked against the process's
  start time first, so that a reused pid is never hit);
- the first ``restart_load`` event: every regular file of the loaded step's directory on every node (the shared
  tier's copy for a node that has none) is hard-linked into a holding directory, so that the files stay readable
  after the job's retention removes the step; right after the job ends :func:`plain_read` reads them once, in
  8 MiB chunks into one reused buffer, in this process.

A node's memory at a sample is the anonymous resident memory of its ranks and its daemon (``RssAnon``: the heap,
the model, the optimizer; pages a rank still shares with the zygote it was forked from count in every rank, the same
at every sample) plus its staging bytes in ``/dev/shm``, counted once (a slot is mapped by its rank and by the
daemon: their ``RssShmem``, left out of the sum); the job's is the sum over the nodes.  ``VmRSS`` (shared libraries and mapped slots counted in every process) is kept beside it for reference.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness import common as h
from benchmarks.parts.ckpt_soak import staging_bytes

STEPS, EVERY = 20, 5
FAULT = "forward:12:1"  # uncommitted compute: the job fail-stops and restarts (L2) from snapshot 10
KILL_AFTER, KILL_RANK = 13, 1  # SIGKILL rank 1 once update 13 committed: the restart reloads snapshot 10
KINDS = ("ref", "fault", "kill")
WHAT = {"ref": "uninterrupted", "fault": f"forward fault ({FAULT}), L2", "kill": f"SIGKILL of rank {KILL_RANK} "
        f"after update {KILL_AFTER}, L2"}
SAMPLE_S = 0.2  # memory
POLL_S = 0.05  # events (the kill follows update KILL_AFTER's event within this)
CHUNK = 8 << 20
ROLES = ("rank", "daemon")
#: /proc/<pid>/status fields read (kB)
STATUS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


# ====================================================================== the job file and the model's size


def write_job(path: Path, name: str, shape: dict[str, Any], deadline_s: float) -> Path:
    """The reference job file at the given model shape: ``STEPS`` updates, a snapshot every ``EVERY`` (the
    reference job's other checkpoint settings: ``keep_last`` 2, the shared tier every 2nd snapshot, a snapshot at
    the end).  The timeouts are long (a collective of a 300M-parameter model on two shared cores waits for the
    slowest of four ranks); a rank exits by itself after ``deadline_s``."""
    from benchmarks.parts.workload import entry_of, write_job as write

    return write(path, {
        "name": f"bench-scale-{name}", "steps": STEPS, "log_every": EVERY, "faults": [],
        "topology.nodes": 2, "topology.ranks_per_node": 2, "topology.threads_per_rank": 1,
        "checkpoint.every_steps": EVERY, "checkpoint.milestone_every": 0, "recovery.max_restarts": 3,
        "timeouts.collective_s": 120, "timeouts.control_s": 600, "timeouts.startup_s": 600,
        "timeouts.shutdown_s": 30,
    }, entry=entry_of("scale_entry"), params={**shape, "bench": {"deadline_s": deadline_s}})


def param_count(shape: dict[str, Any]) -> int:
    """The decoder's parameters at ``shape`` (over the reference job's ``seq_len`` and ``dropout``), counted on
    torch's meta device in a child process: nothing allocated here."""
    from benchmarks.parts.workload import SHAPE, base_params

    full = {k: v for k, v in {**base_params(), **shape}.items() if k in SHAPE}
    code = ("import json, sys, torch\nfrom benchmarks.parts.workload import CausalDecoder\n"
            "with torch.device('meta'):\n    m = CausalDecoder(**json.loads(sys.argv[1]))\n"
            "print(sum(p.numel() for p in m.parameters()))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(full)], cwd=h.REPO, env=h.bench_environ(),
                         capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.split()[-1])


# ====================================================================== the watch


def _status(pid: int) -> dict[str, int] | None:
    """The :data:`STATUS` fields of a live process, in bytes (None once it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in STATUS:
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return out


def _started(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class Watch:
    """Follows one run's event log from a thread (see the module docstring): memory samples, the kill, the
    reload's files held for the plain read.  ``start()`` before the launch, ``stop()`` after it."""

    def __init__(self, run_dir: Path, hold: Path, kill: bool, log: Callable[[str], None] | None = None) -> None:
        self.run_dir, self.hold, self.kill, self.log = run_dir, hold, kill, log
        self.offset = 0
        self.procs: dict[int, dict[str, Any]] = {}  # pid -> role, rank, node, restart, hostname, started
        self.hosts: dict[int, str] = {}  # node index -> hostname
        self.samples: list[dict[str, Any]] = []
        self.killed: dict[str, Any] | None = None
        self.held: dict[str, Any] | None = None
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-scale-watch", daemon=True)
        self.t0, self.t0_wall = time.monotonic(), time.time()

    def start(self) -> None:
        self.t0, self.t0_wall = time.monotonic(), time.time()
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        next_sample = 0.0
        while not self._stop.is_set():
            try:
                for ev in self._new_events():
                    self._on_event(ev)
                if time.monotonic() >= next_sample:
                    next_sample = time.monotonic() + SAMPLE_S
                    self._sample()
            except Exception as exc:  # noqa: BLE001 - the watch must not die silently: recorded, the run judged
                self.problems.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(POLL_S)

    def _new_events(self) -> list[dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        try:
            with open(path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def _on_event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == "process" and ev.get("role") in ROLES and isinstance(ev.get("pid"), int):
            pid = ev["pid"]
            self.procs[pid] = {"role": ev["role"], "rank": ev.get("rank"), "node": ev.get("node"),
                               "restart": ev.get("restart"), "started": _started(pid)}
            if isinstance(ev.get("node"), int):
                self.hosts[ev["node"]] = str(ev.get("hostname"))
        elif kind == "step" and ev.get("rank") == 0:
            if self.kill and self.killed is None and ev.get("restart") == 0 and ev.get("step") == KILL_AFTER:
                self._kill(ev)
                self._say(f"rank {KILL_RANK} SIGKILLed after update {KILL_AFTER}: {self.killed or self.problems}")
            if isinstance(ev.get("step"), int) and ev["step"] % EVERY == 0:
                self._say(f"start {ev.get('restart')}: update {ev['step']} done ({ev.get('step_s') or 0:.2f} s)")
        elif kind == "snapshot" and ev.get("rank") == 0:
            self._say(f"start {ev.get('restart')}: snapshot {ev.get('step')} blocked {ev.get('blocking_s') or 0:.2f} s")
        elif kind == "restart_load" and self.held is None and isinstance(ev.get("step"), int):
            self._hold(ev["step"])
            self._say(f"start {ev.get('restart')}: reloaded step {ev['step']} in {ev.get('load_s') or 0:.2f} s")

    def _say(self, msg: str) -> None:
        if self.log is not None:
            self.log(f"  {self.run_dir.name}: {msg}")

    def _kill(self, ev: dict[str, Any]) -> None:
        victim = [(pid, p) for pid, p in self.procs.items()
                  if p["role"] == "rank" and p["rank"] == KILL_RANK and p["restart"] == 0]
        if not victim:
            self.problems.append(f"no process event of rank {KILL_RANK} before update {KILL_AFTER}'s step event")
            self.killed = {}
            return
        pid, p = victim[0]
        if p["started"] is None or _started(pid) != p["started"]:
            self.problems.append(f"rank {KILL_RANK} (pid {pid}) was gone before update {KILL_AFTER}'s step event")
            self.killed = {}
            return
        os.kill(pid, signal.SIGKILL)
        self.killed = {"pid": pid, "rank": KILL_RANK, "after_step": KILL_AFTER, "ts": time.time(),
                       "after_event_s": time.time() - float(ev.get("ts") or time.time())}

    def _hold(self, step: int) -> None:
        """Hard links to every file of the loaded step on every node (the shared tier's copy for a node that has
        none), before the job's retention can remove it."""
        from ckpt_service.layout import shared_dir, step_dirname

        name = step_dirname(step)
        dirs = sorted(p / name for p in (self.run_dir / "node-local").iterdir() if (p / name).is_dir())
        nodes = sorted(p for p in (self.run_dir / "node-local").iterdir() if p.is_dir())
        shared = Path(shared_dir(str(self.run_dir))) / name
        if len(dirs) < len(nodes) and shared.is_dir():
            dirs.append(shared)
        files, total = [], 0
        for d in dirs:
            for src in sorted(p for p in d.rglob("*") if p.is_file() and not p.is_symlink()):
                dst = self.hold / d.parent.name / d.name / src.relative_to(d)
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.link(src, dst)
                files.append(str(dst))
                total += dst.stat().st_size
        self.held = {"step": step, "dirs": [os.path.relpath(d, self.run_dir) for d in dirs], "files": files,
                     "bytes": total}

    def _sample(self) -> None:
        from ckpt_service.layout import node_dir, staging_root

        t = round(time.monotonic() - self.t0, 3)
        nodes: dict[int, dict[str, int]] = {}
        for pid, p in list(self.procs.items()):
            if p["started"] is None or _started(pid) != p["started"]:
                continue
            st = _status(pid)
            if st is None or not isinstance(p["node"], int):
                continue
            n = nodes.setdefault(p["node"], {"anon": 0, "vmrss": 0, "shmem": 0, "ranks": 0, "daemons": 0})
            n["anon"] += st.get("RssAnon", 0)
            n["vmrss"] += st.get("VmRSS", 0)
            n["shmem"] += st.get("RssShmem", 0)
            n["ranks" if p["role"] == "rank" else "daemons"] += 1
        for node, host in self.hosts.items():
            n = nodes.setdefault(node, {"anon": 0, "vmrss": 0, "shmem": 0, "ranks": 0, "daemons": 0})
            n["shm"] = staging_bytes(staging_root(node_dir(str(self.run_dir), host)))
        if nodes:
            self.samples.append({"t": t, "nodes": {str(k): v for k, v in sorted(nodes.items())}})


def plain_read(files: list[str]) -> dict[str, Any]:
    """One sequential read of ``files`` in turn, 8 MiB at a time into one reused buffer: seconds and bytes."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view)
                if not n:
                    break
                total += n
    return {"read_s": time.perf_counter() - t0, "bytes": total, "files": len(files)}


# ====================================================================== one run


def stop_job(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """A launcher still running: SIGTERM to its process group (it stops its ranks and daemons), SIGKILL to the
    group ``grace_s`` later."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(work: Path, name: str, shape: dict[str, Any], kind: str, trial: int, deadline_s: float,
            rank_deadline_s: float, log: Callable[[str], None], keep: bool = False) -> dict[str, Any]:
    """One job of ``kind`` (:data:`KINDS`) at one size, started as ``accelpact-run JOB.yaml --run-dir DIR``
    (``--inject-fault`` for ``fault``; the command relaunches the job in place after a fail-stop) and stopped
    after ``deadline_s``: its exit, digest, snapshots, reload and memory samples.  A run that did not go the way
    its kind says (exit status, fault, kill, reload) carries ``error``."""
    tag = f"{name}-{trial}-{kind}"
    run_dir, hold, out = work / tag, work / f"{tag}-held", work / f"{tag}.log"
    config = write_job(work / f"{tag}.yaml", name, shape, rank_deadline_s)
    job_id = f"bench-scale-{tag}"
    cmd = [sys.executable, "-m", "accelpact_slurm.cli.run", str(config), "--run-dir", str(run_dir)]
    if kind == "fault":
        cmd += ["--inject-fault", FAULT]
    watch = Watch(run_dir, hold, kill=kind == "kill", log=log)
    t_start = time.time()
    t0 = time.monotonic()
    with open(out, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=h.REPO, env=h.bench_environ({"PYTHONUNBUFFERED": "1",
                                                                      "ACCELPACT_LOCAL_JOB_ID": job_id}),
                                stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    watch.start()
    code: int | None = None
    try:
        code = proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        stop_job(proc)
        wall = time.monotonic() - t0
        watch.stop()
    try:
        res = analyse(run_dir, job_id, kind, code, watch)
        res.update(size=name, trial=trial, kind=kind, exit_code=code, wall_s=round(wall, 2), t_start=t_start)
        if watch.held:
            res["plain_read"] = plain_read(watch.held["files"])
            res["held"] = {k: v for k, v in watch.held.items() if k != "files"}
        if code is None:
            res["error"] = f"still running after {deadline_s:.0f} s: stopped; {h.tail(out, 8, sep=' | ', limit=1200)}"
        elif res.get("error") is None and code != 0:
            res["error"] = f"exit status {code}; {h.tail(out, 8, sep=' | ', limit=1200)}"
        return res
    finally:
        shutil.rmtree(hold, ignore_errors=True)
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def analyse(run_dir: Path, job_id: str, kind: str, code: int | None, watch: Watch) -> dict[str, Any]:
    """What one run left: rank 0's snapshots per start, the reload, the per-update times, the digest, the memory
    samples, and whether the run went the way its kind says."""
    events = [e for e in h.read_jsonl(run_dir / "events.jsonl") if e.get("job_id") in (job_id, None)]
    try:
        summ = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summ = {}
    snaps = [{"restart": e.get("restart"), "step": e.get("step"), "blocking_s": e.get("blocking_s"),
              "parts_s": e.get("parts_s") or {}, "proof": e.get("capture_proof"), "proof_ok": e.get("capture_ok")}
             for e in events if e.get("event") == "snapshot" and e.get("rank") == 0 and not e.get("skipped")]
    loads = [e for e in events if e.get("event") == "restart_load"]
    faults = sorted({(e.get("phase"), e.get("step"), e.get("rank")) for e in events if e.get("event") == "fault"},
                    key=str)
    steps = [e.get("step_s") for e in events if e.get("event") == "step" and e.get("rank") == 0]
    starts = sorted({e.get("restart") for e in events if e.get("event") == "job_start"})
    out: dict[str, Any] = {
        "digest": summ.get("final_state_digest"), "final_step": summ.get("final_step"),
        "restarts": summ.get("restart_count", max(starts, default=0)), "snapshots": snaps,
        "step_s": [s for s in steps if isinstance(s, (int, float))],
        "load": None if not loads else {k: loads[0].get(k) for k in ("step", "load_s", "path", "copied", "parts",
                                                                      "restart")},
        "loads": len(loads), "faults": [{"phase": ph, "step": st, "rank": rk} for ph, st, rk in faults],
        "killed": watch.killed, "samples": watch.samples, "watch_problems": watch.problems,
        "skipped_snapshots": sum(1 for e in events if e.get("event") == "snapshot" and e.get("skipped")),
        "warnings": [str(e.get("reason"))[:300] for e in events if e.get("event") == "warning"][:5],
    }
    fp = next((e for e in events if e.get("event") == "footprint"), None)
    if fp:  # the job's own prediction at protect (a floor: docs/checkpoints.md#memory), beside what was measured
        tight = fp.get("tightest") or {}
        out["footprint"] = {"adds": tight.get("adds"), "left": tight.get("left"), "weights": tight.get("weights"),
                            "shortfalls": len(fp.get("shortfalls") or [])}
    error = None
    if code == 0 and summ.get("final_step") != STEPS:
        error = f"final step {summ.get('final_step')}, not {STEPS}"
    elif code == 0 and kind == "ref" and out["restarts"]:
        error = f"the uninterrupted run restarted {out['restarts']} time(s)"
    elif code == 0 and kind != "ref" and (not loads or not out["restarts"]):
        error = f"no restart with a reload ({len(loads)} restart_load event(s), {out['restarts']} restart(s))"
    elif code == 0 and kind == "fault" and not any(f["phase"] == "forward" for f in out["faults"]):
        error = f"no forward fault recorded ({out['faults']})"
    elif code == 0 and kind == "kill" and not watch.killed:
        error = "; ".join(watch.problems) or f"the job ended before update {KILL_AFTER}'s step event was seen"
    elif code == 0 and kind != "ref" and watch.held is None:
        error = "; ".join(watch.problems) or "the reloaded step's files were not held"
    out["error"] = error
    out["peak_at"] = peak_at(events, watch)
    out["windows"] = snapshot_windows(events, watch.t0_wall)
    return out


#: A daemon's last word on a snapshot (``checkpoint`` event states).
ENDED = ("verified", "rejected", "failed")


def snapshot_windows(events: list[dict[str, Any]], t0_wall: float) -> list[list[float]]:
    """``[[from, to]]`` in the memory samples' time base (seconds after the watch began): each snapshot of rank 0,
    from the moment its training blocked for it (the event's time less ``blocking_s``) until every node's daemon
    said its last word on that step (verified, rejected, failed) or the start ended; and the job's end, from its
    last snapshot's start until ``job_end`` (the final digest).  Outside them the ranks only train."""
    last_word: dict[Any, float] = {}
    for e in events:
        if e.get("event") == "checkpoint" and e.get("state") in ENDED and isinstance(e.get("ts"), (int, float)):
            last_word[e.get("step")] = max(last_word.get(e.get("step"), 0.0), float(e["ts"]))
    ends = sorted(float(e["ts"]) for e in events if e.get("event") in ("job_start", "job_end")
                  and isinstance(e.get("ts"), (int, float)))
    out: list[list[float]] = []
    for e in events:
        if e.get("event") != "snapshot" or e.get("rank") != 0 or e.get("skipped") \
                or not isinstance(e.get("ts"), (int, float)):
            continue
        begin = float(e["ts"]) - float(e.get("blocking_s") or 0.0)
        end = max(last_word.get(e.get("step"), 0.0), float(e["ts"]))
        later = [t for t in ends if t > begin]
        if later and end > later[0]:  # the start ended first (or a later start took the same step again)
            end = later[0]
        out.append([round(begin - t0_wall, 3), round(end - t0_wall, 3)])
    job_end = next((float(e["ts"]) for e in events if e.get("event") == "job_end"
                    and isinstance(e.get("ts"), (int, float))), None)
    if job_end is not None and out:
        out.append([out[-1][0], round(job_end - t0_wall, 3)])
    return out


def _mark(e: dict[str, Any]) -> str | None:
    """What an event marks in the run, for :func:`peak_at` (None: not a mark)."""
    kind, r = e.get("event"), e.get("restart")
    if kind == "job_start" and e.get("rank") in (0, None):
        return f"start {r} began"
    if e.get("rank") == 0 and kind in ("step", "snapshot", "restart_load"):
        what = {"step": "update", "snapshot": "snapshot", "restart_load": "the reload of step"}[kind]
        return f"{what} {e.get('step')} of start {r}"
    if kind == "checkpoint":
        return f"snapshot {e.get('step')} {e.get('state')} on node {e.get('node')}"
    return None


def peak_at(events: list[dict[str, Any]], watch: Watch) -> str | None:
    """Where the job's memory peaked: the last event before the peak sample, and how long after it."""
    from benchmarks.parts.scale_report import job_bytes

    if not watch.samples:
        return None
    top = max(watch.samples, key=job_bytes)
    when = watch.t0_wall + top["t"]
    marks = sorted((float(e["ts"]), m) for e in events if isinstance(e.get("ts"), (int, float))
                   and (m := _mark(e)) is not None and e["ts"] <= when)
    return f"{marks[-1][1]} +{when - marks[-1][0]:.1f} s" if marks else f"{top['t']:.1f} s after the start"
