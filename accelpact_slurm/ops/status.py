"""Collect one job's status from its run directory (and Slurm, when it answers).

Reads only ``events.jsonl`` (one pass, constant memory per event kind), ``summary.json``, ``ckpt-index/<node>.json``
and the shared tier's snapshot records (``checkpoint.shared_dir`` of the ``job_start`` event, else
``RUN_DIR/shared-ckpt``); asks ``squeue``/``sacct`` with a short timeout when they exist.  The step a restart would
load comes from :func:`ckpt_service.index.restart_source`, the rule the restore applies.  Returns plain dicts whose
keys are the stable ``--json`` schema documented in ``docs/operator-tools.md`` (``accelpact-status/1``).

This module must not import torch: it runs on login nodes.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import statistics
import subprocess
from collections import deque
from typing import Any, Iterable, Mapping

from accelpact_slurm.core import settings
from accelpact_slurm.core.errors import EXIT_NO_REQUEUE, EXIT_REQUEUE
from accelpact_slurm.core.events import (
    EVENTS_FILE, JSON_FILE_LIMIT, SUMMARY_FILE, BadLine, NotRegular, TooDeep, finite_number, parse_json, read_events,
    read_file,
)
from accelpact_slurm.core.spares import SparePool
from accelpact_slurm.ops.stops import add_stop, count as _count
from ckpt_service.committed import SUFFIX as COMMITTED_SUFFIX
from ckpt_service.index import SHARED_SOURCE, restart_source, scan
from ckpt_service.layout import DAEMON_FAILED_SUFFIX, shared_dir
from ckpt_service.retention import newest_common

log = logging.getLogger(__name__)

SCHEMA = "accelpact-status/1"
INDEX_DIR = "ckpt-index"
RUNS_ROOT_ENV = settings.RUNS_ROOT
#: A run directory unchanged for longer than max(this, 20 step times) is reported stale.
STALE_MIN_S = 300.0
#: Slurm queries must not make a login-node tool hang.
SLURM_TIMEOUT_S = 1.5
#: How many recent L1 repairs and L2 restarts are kept in full.
RECENT = 20
_RATE_WINDOW = 64
#: Events that may follow a fail-stop without meaning the run is alive again.
_BOOKKEEPING = {"requeue", "checkpoint", "membership", "shared_upload", "process", "spare_ready", "spare_assigned",
                "spare_end"}
_END_FIELDS = ("final_step", "final_loss", "wall_s", "final_state_digest", "exit_code")
_TERMINAL_SLURM = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE"}


def runs_root(environ: Mapping[str, str] | None = None) -> str:
    """The runs root: ``$ACCELPACT_RUNS_ROOT``, else ``./runs`` (read by :mod:`accelpact_slurm.core.settings`)."""
    return settings.runs_root(environ)


def resolve_target(arg: str, root: str) -> tuple[str, str | None]:
    """``(run_dir, job_id)`` for a run directory (job id: None, read from its events) or a job id."""
    if os.path.isdir(arg):
        return arg, None
    return os.path.join(root, arg), arg


def list_run_dirs(root: str, limit: int = 10, all_users: bool = False) -> list[str]:
    """The most recently changed run directories under ``root`` (the caller's own unless ``all_users``)."""
    found = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    uid = os.getuid() if hasattr(os, "getuid") else None
    for entry in entries:
        try:
            if not entry.is_dir():
                continue
            st = entry.stat()
        except OSError:
            continue
        if not all_users and uid is not None and st.st_uid != uid:
            continue
        events = os.path.join(entry.path, EVENTS_FILE)
        if not (os.path.exists(events) or os.path.isdir(os.path.join(entry.path, INDEX_DIR))):
            continue
        found.append((_mtime(events) or st.st_mtime, entry.path))
    found.sort(reverse=True)
    return [p for _, p in found[:limit]]


# --------------------------------------------------------------------------- Slurm


def query_slurm(job_ids: Iterable[str], timeout_s: float = SLURM_TIMEOUT_S,
                env: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Slurm's state for each job it knows: ``{job_id: {"state": ..., "source": "squeue"|"sacct"}}``.

    ``squeue`` first (running and pending jobs), then ``sacct`` for the rest.  A missing command, a timeout or an
    error (``sacct`` without slurmdbd) just leaves the job out: the caller falls back to the run directory.
    """
    ids = [j for j in dict.fromkeys(job_ids) if re.fullmatch(r"\d+(?:_\d+)?(?:\+\d+)?", j)]
    if not ids:
        return {}
    env = dict(os.environ if env is None else env)
    out: dict[str, dict[str, str]] = {}
    for cmd, source in (
        (["squeue", "-h", "-o", "%i|%T", "--jobs=" + ",".join(ids)], "squeue"),
        (["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(ids)], "sacct"),
    ):
        wanted = [j for j in ids if j not in out]
        if not wanted:
            break
        if source == "sacct":
            cmd[-1] = ",".join(wanted)
        text = _run(cmd, timeout_s, env)
        for line in (text or "").splitlines():
            parts = line.strip().split("|")
            if len(parts) >= 2 and parts[0] in wanted and parts[1]:
                out[parts[0]] = {"state": parts[1].split()[0].upper(), "source": source}  # sacct -D: last wins
    return out


def _run(cmd: list[str], timeout_s: float, env: dict[str, str]) -> str | None:
    exe = shutil.which(cmd[0], path=env.get("PATH"))
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("%s failed: %s", cmd[0], exc)
        return None
    if proc.returncode != 0:
        log.debug("%s exited %s: %s", cmd[0], proc.returncode, proc.stderr.strip())
        return None
    return proc.stdout


# --------------------------------------------------------------------------- pure decisions


def newest_verified(snapshots: Iterable[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """The snapshot L2 would load: highest step in state ``verified``, newest ``created`` on a tie."""
    best = None
    seen = 0
    for snap in snapshots:
        seen += 1
        if snap.get("state") != "verified" or not isinstance(snap.get("step"), int):
            continue
        if best is None or (snap["step"], snap.get("created") or 0) > (best["step"], best.get("created") or 0):
            best = snap
    if best is not None:
        return best, f"step {best['step']} on {best.get('node')} is the highest verified step"
    return None, ("no snapshot at all" if seen == 0 else f"none of {seen} snapshots is verified")


def staleness(now: float, last_change: float | None, step_s: float | None, finished: bool,
              stale_after_s: float | None = None) -> tuple[bool, str]:
    """Whether a run directory has stopped moving, and why (pure)."""
    if finished:
        return False, "run finished or stopped"
    if last_change is None:
        return False, "nothing written yet"
    limit = stale_after_s if stale_after_s is not None else max(STALE_MIN_S, 20.0 * (step_s or 0.0))
    idle = now - last_change
    if idle > limit:
        return True, f"run directory unchanged for {idle:.0f} s (limit {limit:.0f} s)"
    return False, f"last change {idle:.0f} s ago"


def stop_line(stop: dict[str, Any]) -> str:
    """How the last start ended, in one line (pure): ``start 2: hung-rank (exit 75): rank 3 ...``."""
    cause = stop.get("cause") or "unknown cause"
    reason = " ".join(str(stop.get("reason") or "").split())
    if len(reason) > 300:
        reason = reason[:297] + "..."
    code = stop.get("exit_code")
    return f"start {stop.get('restart')}: {cause} (exit {'-' if code is None else code}): {reason}"


def run_dir_state(last_event: dict[str, Any] | None, final: dict[str, Any] | None, stale: bool) -> str:
    """The job state told by the run directory alone (when Slurm does not answer)."""
    if final is not None:
        code = final.get("exit_code")
        return "COMPLETED" if code in (0, None) else f"FAILED({code})"
    if last_event is None:
        return "EMPTY"
    if last_event.get("event") == "fail_stop":
        code = last_event.get("exit_code")
        if code == EXIT_REQUEUE:
            return "REQUEUE_WAIT"
        if code == EXIT_NO_REQUEUE:
            return "STOPPED"
        return f"FAILED({code})"
    return "STALE" if stale else "RUNNING"


# --------------------------------------------------------------------------- collection


def collect(run_dir: str, *, now: float, job_id: str | None = None, slurm: dict[str, str] | None = None,
            stale_after_s: float | None = None) -> dict[str, Any]:
    """Status of the job in ``run_dir`` as a JSON-ready dict (schema in ``docs/operator-tools.md``).

    ``job_id`` defaults to the event log's, else the directory name.  ``slurm`` (``{"state", "source"}`` from
    :func:`query_slurm`) may also be applied later with :func:`apply_slurm`, once the job id is known from the events.
    """
    bad: list[BadLine] = []
    ev = _scan(os.path.join(run_dir, EVENTS_FILE), bad)
    summary = _read_json(os.path.join(run_dir, SUMMARY_FILE), bad)
    nodes = _read_index(os.path.join(run_dir, INDEX_DIR), bad, now)
    all_snaps = [s for n in nodes for s in n["snapshots"]]
    best, best_reason = newest_verified(all_snaps)
    shared = _read_shared(run_dir, ev["shared_dir"], ev["milestone_every"], now, bad)
    restart_step, restart_from, restart_why = restart_source(
        {**{n["node"]: n["snapshots"] for n in nodes}, SHARED_SOURCE: shared["snapshots"]})
    common, common_why = newest_common({n["node"]: [s["step"] for s in n["snapshots"] if s["state"] == "verified"]
                                        for n in nodes})

    step_s = ev["step_s"]
    # Only the documented fields: summary.json also holds e.g. every step's loss.
    final = {k: summary.get(k) for k in _END_FIELDS} if isinstance(summary, dict) else ev["job_end"]
    changes = [t for t in (_mtime(os.path.join(run_dir, EVENTS_FILE)), ev["last_ts"],
                           *(n["updated"] for n in nodes)) if t is not None]
    last_change = max(changes) if changes else None
    dir_state = run_dir_state(ev["last_event"], final, stale=False)
    # A finished or stopped run may sit still forever; a running or requeue-waiting one may not.
    stale, stale_reason = staleness(now, last_change, step_s, dir_state not in ("RUNNING", "REQUEUE_WAIT"),
                                    stale_after_s)
    if stale and dir_state == "RUNNING":
        dir_state = "STALE"
    warnings = []
    files = sum(b.lineno == 0 for b in bad)  # line 0: a whole file (a directory, a FIFO), each one in bad_lines
    counts = ([f"{len(bad) - files} unreadable line(s)"] if len(bad) > files else []) + \
        ([f"{files} unreadable file(s)"] if files else [])
    if counts:
        warnings.append(f"{' and '.join(counts)} skipped")
    if not os.path.isdir(run_dir):
        warnings.append(f"no run directory {run_dir}")

    frontier = ev["frontier"]
    info = {
        "job_id": job_id or ev["job_id"] or os.path.basename(os.path.normpath(run_dir)),
        "run_dir": os.path.abspath(run_dir),
        "state": dir_state,
        "state_source": "run_dir",
        "run_dir_state": dir_state,
        "restarts": ev["max_restart"],
        "frontier": None if frontier is None else {
            "step": frontier[1], "ts": frontier[0], "age_s": now - frontier[0], "source": frontier[2]},
        "step_rate": {"steps_per_s": ev["rate"], "step_s": step_s},
        "checkpoint_every_steps": ev["every_steps"],
        "l1": {"count": len(ev["repairs"]), "last": _with_age(ev["repairs"][-1], now) if ev["repairs"] else None,
               "recent": ev["repairs"][-RECENT:], "phases": ev["phases"], "faults": ev["faults"]},
        "last_stop": None if ev["last_stop"] is None else {**ev["last_stop"], "line": stop_line(ev["last_stop"])},
        "l2": {"count": ev["max_restart"], "fail_stops": ev["fail_stops"][-RECENT:],
               "requeues": ev["requeues"][-RECENT:], "restart_loads": ev["restart_loads"][-RECENT:],
               # nodes lost whole that a requeue excluded (Slurm never runs the job there again)
               "excluded": sorted({h for r in ev["requeues"] for h in r.get("excluded") or []})},
        "snapshots": {"nodes": nodes, "newest_verified": best, "newest_verified_reason": best_reason,
                      "counts": _count_states(all_snaps), "shared": shared,
                      "restart": {"step": restart_step, "source": restart_from, "reason": restart_why},
                      "newest_common": {"step": common, "reason": common_why}},
        "envelope": ev["decision"],
        "spares": ev["spares"],
        "final": final,
        "last_event_ts": ev["last_ts"],
        "last_change_ts": last_change,
        "stale": stale,
        "stale_reason": stale_reason,
        "warnings": warnings,
        "bad_lines": [str(b) for b in bad],
        "events": ev["count"],
    }
    return apply_slurm(info, slurm)


def apply_slurm(info: dict[str, Any], slurm: dict[str, str] | None) -> dict[str, Any]:
    """Put Slurm's view (or, without one, the run directory's) into ``info``: state and warnings."""
    warnings = [w for w in info["warnings"] if not w.startswith(("Slurm says", "run directory unchanged"))]
    if slurm is not None:
        info["state"], info["state_source"] = slurm["state"], slurm["source"]
        if slurm["state"] == "RUNNING" and info["stale"]:
            warnings.insert(0, f"Slurm says RUNNING but the {info['stale_reason']}: hung?")
        elif slurm["state"] in _TERMINAL_SLURM and info["run_dir_state"] in ("RUNNING", "STALE"):
            warnings.insert(0, f"Slurm says {slurm['state']} but the run directory has no terminal event: "
                               "killed from outside?")
    else:
        info["state"], info["state_source"] = info["run_dir_state"], "run_dir"
        if info["stale"]:
            warnings.insert(0, info["stale_reason"])
    info["warnings"] = warnings
    return info


def _scan(path: str, bad: list[BadLine]) -> dict[str, Any]:
    """One pass over the event log; ranks that log the same step or repair are counted once."""
    job_id = None
    count = 0
    last_ts = None
    last_event = None
    frontier = None  # (ts, step, source)
    max_restart = 0
    window: deque[tuple[int, float]] = deque(maxlen=_RATE_WINDOW)
    step_s: deque[float] = deque(maxlen=_RATE_WINDOW)
    window_restart = None
    repairs: list[dict[str, Any]] = []
    seen_repairs: set[tuple[Any, Any]] = set()
    phases: dict[str, list[float]] = {}
    fail_stops: dict[Any, dict[str, Any]] = {}
    requeues: list[dict[str, Any]] = []
    restart_loads: dict[Any, dict[str, Any]] = {}
    faults = 0
    seen_faults: set[tuple[Any, Any, Any]] = set()
    decision = None
    every_steps = None
    shared = None
    milestone_every = 0
    job_end = None
    job_end_at: tuple[Any, Any] = (None, None)
    spares = SparePool()
    for rec in read_events(path, bad):
        count += 1
        spares.feed(rec)
        kind = rec["event"]
        ts = finite_number(rec.get("ts"))
        restart = rec.get("restart") if isinstance(rec.get("restart"), int) else 0
        max_restart = max(max_restart, restart)
        if job_id is None and rec.get("job_id") is not None:
            job_id = str(rec["job_id"])
        if ts is not None:
            last_ts = ts if last_ts is None else max(last_ts, ts)
        if kind not in _BOOKKEEPING:  # a requeue or checkpoint after a fail-stop does not revive the run
            last_event = rec
        if kind == "step":
            step = _count(rec.get("step"))
            if step is None or ts is None:
                continue
            if frontier is None or ts >= frontier[0]:
                frontier = (ts, step, "step")
            if restart != window_restart or (window and step < window[-1][0]):
                window.clear()
                window_restart = restart
            if not window or step > window[-1][0]:
                window.append((step, ts))
                if (secs := finite_number(rec.get("step_s"))) is not None:
                    step_s.append(secs)
        elif kind == "repair":
            key = (restart, rec.get("generation", ts))
            if key in seen_repairs:
                continue
            seen_repairs.add(key)
            ph = _phases(rec.get("phases"))
            for name, secs in ph.items():
                phases.setdefault(name, []).append(secs)
            repairs.append({"ts": ts, "restart": restart, "generation": rec.get("generation"),
                            "frontier": rec.get("frontier"), "total_s": finite_number(rec.get("total_s")),
                            "phases": ph})
            if isinstance(rec.get("frontier"), int) and ts is not None and (frontier is None or ts >= frontier[0]):
                frontier = (ts, rec["frontier"], "repair")
            decision = _decision(rec, "preserve")
        elif kind == "fail_stop":
            add_stop(fail_stops, rec, ts, restart, frontier)
            decision = _decision(rec, "restart")
        elif kind == "fault":  # every rank that saw it logs it: one fault per (restart, step, phase)
            fkey = (restart, rec.get("step"), rec.get("phase"))
            if fkey not in seen_faults:
                seen_faults.add(fkey)
                faults += 1
            if rec.get("decision") is not None:
                decision = _decision(rec, None)
        elif kind == "requeue":
            requeues.append({"ts": ts, "restart": restart, "reason": rec.get("reason"), "by": rec.get("by"),
                             **({"excluded": rec["excluded"]} if isinstance(rec.get("excluded"), list) else {})})
        elif kind == "restart_load":
            restart_loads.setdefault(restart, {"ts": ts, "restart": restart, "step": rec.get("step"),
                                               "reason": rec.get("reason"), "skipped": rec.get("skipped")})
        elif kind == "job_start":
            cfg = rec.get("config")
            ck = cfg.get("checkpoint") if isinstance(cfg, dict) else None
            if isinstance(ck, dict) and isinstance(ck.get("every_steps"), int):
                every_steps = ck["every_steps"]
            if isinstance(ck, dict):
                shared = ck.get("shared_dir") if isinstance(ck.get("shared_dir"), str) else None
                milestone_every = _count(ck.get("milestone_every")) or 0
        elif kind == "job_end":
            job_end = {k: rec.get(k) for k in _END_FIELDS}
            job_end_at = (ts, restart)
    stops = sorted(fail_stops.values(), key=_by_ts)
    last_stop = stops[-1] if stops else None
    if job_end is not None and (last_stop is None or (job_end_at[0] or 0) >= (last_stop["ts"] or 0)):
        last_stop = {"ts": job_end_at[0], "restart": job_end_at[1], "cause": "completed", "exit_code":
                     job_end.get("exit_code"), "reason": "completed" if job_end.get("final_step") is None
                     else f"completed {job_end.get('final_step')} updates",
                     "culprit": None}
    rate = None
    if len(window) >= 2 and window[-1][1] > window[0][1]:
        rate = (window[-1][0] - window[0][0]) / (window[-1][1] - window[0][1])
    median_step = statistics.median(step_s) if step_s else (1.0 / rate if rate else None)
    return {
        "job_id": job_id, "count": count, "last_ts": last_ts, "last_event": last_event, "frontier": frontier,
        "max_restart": max_restart, "rate": rate, "step_s": median_step, "repairs": repairs,
        "phases": {n: {"last": v[-1], "median": statistics.median(v), "max": max(v), "count": len(v)}
                   for n, v in phases.items()},
        "fail_stops": stops, "last_stop": last_stop, "requeues": requeues,
        "restart_loads": sorted(restart_loads.values(), key=_by_ts), "faults": faults,
        "decision": decision, "every_steps": every_steps, "job_end": job_end, "shared_dir": shared,
        "milestone_every": milestone_every, "spares": spares.result(),
    }


def _decision(rec: dict[str, Any], implied: str | None) -> dict[str, Any]:
    """The envelope decision an event shows: its ``decision`` field, else what the event implies."""
    return {"decision": rec.get("decision") or implied, "key": rec.get("key"), "event": rec["event"],
            "ts": rec.get("ts"), "phase": rec.get("phase")}


def _phases(value: Any) -> dict[str, float]:
    """Per-phase durations from a dict, a list of ``[name, s]`` or a list of ``{"phase", "s"}``."""
    out: dict[str, float] = {}
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = []
        for item in value:
            if isinstance(item, (list, tuple)) and len(item) == 2:
                items.append((item[0], item[1]))
            elif isinstance(item, dict):
                items.append((item.get("phase") or item.get("name"), item.get("s", item.get("seconds"))))
    else:
        return out
    for name, secs in items:
        if isinstance(name, str) and (secs := finite_number(secs)) is not None:
            out[name] = secs
    return out


def _read_index(index_dir: str, bad: list[BadLine], now: float) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = []
    try:  # beside each <node>.json: <node>.daemon-failed.json (a daemon that could not start) and the signed
        # <node>.committed.json (the newest step the node verified), no index either: read as one, each showed its
        # node a second time, with no snapshots, above its real index
        names = sorted(n for n in os.listdir(index_dir) if n.endswith(".json")
                       and not n.endswith((DAEMON_FAILED_SUFFIX, COMMITTED_SUFFIX)))
    except OSError:
        return nodes
    for name in names:
        path = os.path.join(index_dir, name)
        doc = _read_json(path, bad)
        if not isinstance(doc, dict):
            if doc is not None:
                bad.append(BadLine(path, 1, "not a JSON object"))
            continue
        node = str(doc.get("node") or name[:-5])
        snaps = []
        raw = doc.get("snapshots") if isinstance(doc.get("snapshots"), list) else []
        for i, s in enumerate(raw):
            if not isinstance(s, dict) or not isinstance(s.get("step"), int):
                bad.append(BadLine(path, 1, f"snapshot #{i} has no integer step"))
                continue
            created = finite_number(s.get("created"))
            snaps.append({"node": node, "step": s["step"], "state": s.get("state"), "size_bytes": s.get("size_bytes"),
                          "created": created, "age_s": None if created is None else now - created,
                          "path": s.get("path"), "milestone": bool(s.get("milestone")), "reason": s.get("reason")})
        snaps.sort(key=lambda s: s["step"])
        updated = finite_number(doc.get("updated"))
        updated = _mtime(path) if updated is None else updated
        nodes.append({"node": node, "updated": updated, "age_s": None if updated is None else now - updated,
                      "snapshots": snaps, "counts": _count_states(snaps)})
    return nodes


def _read_shared(run_dir: str, configured: str | None, milestone_every: int, now: float,
                 bad: list[BadLine]) -> dict[str, Any]:
    """The shared tier's snapshots (``scan``: the records beside the data), in the index's snapshot form; an entry
    named like a snapshot that is none (``step-`` and eleven digits, a step name that is a file) is one bad line."""
    where = shared_dir(run_dir, configured)
    odd: list[tuple[str, str]] = []
    snaps = [{"node": SHARED_SOURCE, "step": r.step, "state": r.state, "size_bytes": r.size_bytes,
              "created": r.created, "age_s": now - r.created, "path": r.path, "milestone": r.milestone,
              "reason": r.reason} for r in scan(where, milestone_every, bad=odd)]
    bad.extend(BadLine(path, 0, why) for path, why in odd)
    return {"dir": where, "snapshots": snaps, "counts": _count_states(snaps)}


def _read_json(path: str, bad: list[BadLine]) -> Any:
    """The JSON document at ``path``; ``None`` when it is missing, or with one bad line when it is not a regular
    file of at most :data:`~accelpact_slurm.core.events.JSON_FILE_LIMIT` bytes (a FIFO must not block the status)."""
    try:
        data = read_file(path, JSON_FILE_LIMIT)
    except FileNotFoundError:
        return None
    except NotRegular as exc:
        bad.append(BadLine(path, 0, exc.why))
        return None
    except OSError as exc:
        bad.append(BadLine(path, 0, f"cannot read: {exc.strerror or exc}"))
        return None
    try:
        return parse_json(data)
    except TooDeep as exc:  # json's RecursionError, which crashed the status, or deep enough to crash --json
        bad.append(BadLine(path, 1, str(exc)))
        return None
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        bad.append(BadLine(path, getattr(exc, "lineno", 1), f"not JSON ({exc.__class__.__name__})"))
        return None


def _count_states(snaps: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in snaps:
        counts[str(s.get("state"))] = counts.get(str(s.get("state")), 0) + 1
    return counts


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _with_age(d: dict[str, Any], now: float) -> dict[str, Any]:
    return dict(d, age_s=None if d.get("ts") is None else now - d["ts"])


def _by_ts(d: dict[str, Any]) -> float:
    return d.get("ts") or 0.0

