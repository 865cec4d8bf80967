"""Recovery benchmark, the running half: one of our jobs with one fault, and its timings (``benchmarks/parts/recovery.py``).

A job is ``accelpact-run JOB.yaml`` itself (the decoder example's job file, the shipped default timeouts, a
snapshot every :data:`EVERY` updates (:data:`EVERY_L1` for the link classes), the timed entry point ``recovery_entry``), started in its own session
and killed with its whole group when it passes its deadline.  The fault of a class:

==================  ====================================================================================
``link-boundary``   rank 1 stays in the guard's replication all-reduce at the boundary after update
                    ``U-1`` while its part never arrives (a stalled link: every member waits inside it)
``link-backward``   rank 1's first replication all-reduce of update ``U``'s backward stalls the same way
``kill``            rank 3 is killed with SIGKILL as update ``U`` begins (``ACCELPACT_TEST_CRASH_AT``)
``stop``            rank 3 is stopped with SIGSTOP as update ``U`` begins (``ACCELPACT_TEST_HANG_AT``)
``bug``             rank 1's training code raises ``ValueError`` in update ``U`` (the entry point)
``daemon-kill``     node 2's checkpoint daemon is killed with SIGKILL once update ``U-1`` committed
==================  ====================================================================================

What is measured, from the ranks' own records (wall clock of this one machine) and ``events.jsonl``: the
moment of the injection (the faulting rank's record just before it; the harness's own clock for the daemon),
each rank's first commit after it (a restart's first, or the faulted update's), and so the slowest rank's
injection -> next committed update; for a bug, injection -> the last rank's exit (its ``fail_stop``, written
just before it), with the launcher's own exit beside it (after the daemons finished the snapshot in flight).  Beside it: the first and last ``fail_stop`` after the injection
(detection), their cause and culprit, the repairs, and the starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h

CLASSES = ("link-boundary", "link-backward", "kill", "stop", "bug", "daemon-kill")
#: What each class's cost is measured to: the next committed update, or (a bug) the job's exit.
TO_EXIT = {"bug"}
U = 8  # the update the fault is about
STEPS = 12
EVERY = 4  # a snapshot at 4 and 8: a restart reloads 4 (update 8 never committed) and trains again from 5
#: The link classes (an L1 repair, no restart): a snapshot at 5 and 10, none in update U, which they redo and the
#: peers' trials take no snapshot in (the interval from detection to the next commit holds the same work on both
#: sides; with EVERY, ours added a snapshot's blocking, ~15 ms, to it).
EVERY_L1 = 5
L1_CLASSES = ("link-boundary", "link-backward")
RUN_DEADLINE_S = 150.0
SCRUB = ("SLURM_", "ACCELPACT_")


def write_config(path: Path, out: Path, cls: str, deadline_s: float) -> Path:
    from benchmarks.parts.workload import entry_of, write_job

    plan = {"out": str(out), "deadline_s": deadline_s, "bug": [U, 1] if cls == "bug" else None}
    every = EVERY_L1 if cls in L1_CLASSES else EVERY
    return write_job(path, {"steps": STEPS, "checkpoint.every_steps": every, "recovery.max_restarts": 2,
                            "faults": []}, entry=entry_of("recovery_entry"), params={"bench": plan})


def _inject_args(cls: str) -> tuple[list[str], dict[str, str]]:
    if cls == "link-boundary":
        return ["--inject-fault", f"boundary-stuck:{U - 1}:1"], {}
    if cls == "link-backward":
        return ["--inject-fault", f"backward-stuck:{U}:1"], {}
    if cls == "kill":
        return [], {"ACCELPACT_TEST_CRASH_AT": f"{U}:3"}
    if cls == "stop":
        return [], {"ACCELPACT_TEST_HANG_AT": f"{U}:3"}
    return [], {}


def run_ours(cls: str, work: Path, tag: str, deadline_s: float = RUN_DEADLINE_S) -> dict[str, Any]:
    """One job with the fault of class ``cls``; see the module docstring.  ``ok`` and the timings, or ``error``."""
    name = f"ours-{cls}-{tag}"
    run_dir, out = work / name, work / f"{name}-rec"
    cfg = write_config(work / f"{name}.yaml", out, cls, deadline_s)
    args, extra = _inject_args(cls)
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    env.update({"PYTHONPATH": os.pathsep.join([str(h.REPO), str(h.REPO)]), "PYTHONUNBUFFERED": "1", **extra})
    log = work / f"{name}.log"
    t0 = time.monotonic()
    injected_by_us = None
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", str(cfg), "--run-dir", str(run_dir),
                                 *args], cwd=h.REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    rc = None
    try:
        if cls == "daemon-kill":
            injected_by_us = _kill_daemon_after(run_dir, U - 1, "node2", t0 + deadline_s)
        rc = proc.wait(timeout=max(1.0, deadline_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if rc is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=10)
    ended = time.time()
    wall = time.monotonic() - t0
    res: dict[str, Any] = {"cls": cls, "tag": tag, "rc": rc, "wall_s": round(wall, 1)}
    recs = {r: h.read_jsonl(out / f"rank-{r}.jsonl") for r in range(4)}
    events = _events(run_dir)
    inject = injected_by_us if cls == "daemon-kill" else _injection(cls, recs)
    if inject is None:
        return {**res, "ok": False, "error": f"{name}: the injection left no record (rc {rc}): "
                                             f"{h.tail(log, 8, sep=' | ', limit=800)}"}
    res["inject_t"] = inject
    stops = [e for e in events if e.get("event") == "fail_stop" and e.get("ts", 0) >= inject and e.get("rank") is not None]
    res["fail_stop"] = {"first_s": min((e["ts"] - inject for e in stops), default=None),
                        "last_s": max((e["ts"] - inject for e in stops), default=None),
                        "causes": sorted({str(e.get("cause")) for e in stops}),
                        "culprits": sorted({e["culprit"] for e in stops if isinstance(e.get("culprit"), int)})}
    res["repairs"] = [{"scope": e.get("scope"), "fault_to_resume_s": e.get("fault_to_resume_s")}
                      for e in events if e.get("event") == "repair"]
    res["starts"] = sorted({e["restart"] for e in events if e.get("event") == "job_start"})
    if cls in TO_EXIT:  # the ranks' exit (each writes its fail_stop just before it exits); the launcher's beside it
        res["per_rank_s"] = {e["rank"]: e["ts"] - inject for e in stops}
        res["recover_s"] = res["fail_stop"]["last_s"]
        res["launcher_exit_s"] = ended - inject  # includes the daemons finishing the snapshot they write
        res["ok"] = rc is not None and res["recover_s"] is not None and len(res["starts"]) == 1
        return res if res["ok"] else {**res, "error": f"{name}: rc {rc}, starts {res['starts']}"}
    per_rank = {}
    for r, rr in recs.items():  # the next update: a restart's first, or one past the fault's (not the one before)
        after = [x["t"] for x in rr if x.get("ev") == "commit" and x["t"] > inject
                 and (x.get("restart", 0) > 0 or x.get("u", 0) >= U)]
        per_rank[r] = (min(after) - inject) if after else None
    res["per_rank_s"] = per_rank
    if any(v is None for v in per_rank.values()):
        return {**res, "ok": False, "error": f"{name}: rank(s) {[r for r, v in per_rank.items() if v is None]} "
                                             f"committed nothing after the fault (rc {rc}): "
                                             f"{h.tail(log, 8, sep=' | ', limit=800)}"}
    res["recover_s"] = max(per_rank.values())
    res["slowest_rank"] = max(per_rank, key=lambda r: per_rank[r])
    if cls in L1_CLASSES:
        res.update(detection(events, inject, res["recover_s"]))
    res["ok"] = rc == 0
    return res if res["ok"] else {**res, "error": f"{name}: exit code {rc}: {h.tail(log, 8, sep=' | ', limit=800)}"}


def detection(events: list[dict[str, Any]], inject: float, recover_s: float) -> dict[str, Any]:
    """Detection -> the next commit of an L1 class: every rank's ``fault`` event of update U after the injection
    (``detected_ts``: the moment its detector gave the collective up, else the event's own), the first of them
    (the job's detection), the last (every rank knows), and the slowest rank's next commit (``recover_s`` after the
    injection) from each; the peers' harnesses report the same fields."""
    seen = {e["rank"]: e.get("detected_ts") or e["ts"] for e in events
            if e.get("event") == "fault" and e.get("step") == U and e.get("ts", 0) >= inject}
    if not seen:
        return {"detect_per_rank_s": {}, "detect_first_s": None, "detect_to_commit_s": None,
                "known_to_commit_s": None}
    first, last = min(seen.values()), max(seen.values())
    commit = inject + recover_s
    return {"detect_per_rank_s": {r: t - inject for r, t in sorted(seen.items())}, "detect_first_s": first - inject,
            "detect_to_commit_s": commit - first, "known_to_commit_s": commit - last}


def _injection(cls: str, recs: dict[int, list[dict[str, Any]]]) -> float | None:
    """The moment of the fault, from the faulting rank's records of the first start."""
    def first(rank: int, ev: str) -> float | None:
        return next((x["t"] for x in recs[rank] if x.get("ev") == ev and x.get("u") == U and x.get("restart") == 0),
                    None)

    if cls == "link-boundary":  # the guard's all-reduce runs in update U's vote, right after its backward
        return first(1, "backward")
    if cls == "link-backward":  # the first replication all-reduce of the backward, right after the forward
        return first(1, "forward")
    if cls in ("kill", "stop"):
        return first(3, "enter")
    if cls == "bug":
        return first(1, "bug")
    return None


def _events(run_dir: Path) -> list[dict[str, Any]]:
    from accelpact_slurm.core.events import read_events

    path = run_dir / "events.jsonl"
    return list(read_events(path)) if path.exists() else []


def _kill_daemon_after(run_dir: Path, step: int, node: str, deadline: float) -> float | None:
    """SIGKILL ``node``'s checkpoint daemon once update ``step`` committed; the moment (``time.time()``)."""
    log = run_dir / "logs" / f"ckptd-{node}.log"
    while time.monotonic() < deadline:
        if any(e.get("event") == "step" and e.get("step", 0) >= step for e in _events(run_dir)):
            m = re.search(r"accelpact-ckptd: serving .* \(pid (\d+)[;)]", log.read_text()) if log.exists() else None
            if m:
                t = time.time()
                try:
                    os.kill(int(m.group(1)), signal.SIGKILL)
                except ProcessLookupError:
                    return None
                return t
        time.sleep(0.05)  # polling the event log against a deadline
    return None


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Per class: the slowest rank's seconds (median, min-max over trials), detection, starts."""
    out: dict[str, Any] = {}
    for cls in CLASSES:
        ok = [t for t in trials if t["cls"] == cls and t.get("ok")]
        out[cls] = {"recover_s": h.spread(t["recover_s"] for t in ok),
                    "detected_s": h.spread(t["fail_stop"]["first_s"] for t in ok if t["fail_stop"]["first_s"] is not None),
                    "repair_s": h.spread(r["fault_to_resume_s"] for t in ok for r in t["repairs"]),
                    "restarts": sorted({len(t["starts"]) - 1 for t in ok}),
                    "causes": sorted({c for t in ok for c in t["fail_stop"]["causes"]}),
                    "failed": [t.get("error", "?")[:300] for t in trials if t["cls"] == cls and not t.get("ok")]}
    return out


def dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))


def run_first_snapshot(work: Path, tag: str, deadline_s: float = 420.0) -> dict[str, Any]:
    """The first snapshot after a restart against the regular ones, on the checkpoint part's 110M-parameter model.

    One job: snapshots every 3 updates; the first start stops once snapshot 6 is settled
    (``ACCELPACT_CKPT_EXIT_AFTER_VERIFIED``: exit 75, the launcher relaunches), the restart reloads 6 and takes 9, 12
    and 15.  Each snapshot's blocking time is rank 0's ``snapshot`` event; the restart's first (9) is compared with
    the regular ones after it, and the first start's first (3, with the capture proof) with its second (6), each
    without its wait for a slot the daemon still writes (``parts_s.wait_slot``: the disk's backpressure, the same
    for any snapshot).
    """
    from benchmarks.parts.ckpt_setup import MODEL, TRAIN
    from benchmarks.parts.workload import entry_of, write_job

    name = f"first-snapshot-{tag}"
    run_dir, out = work / name, work / f"{name}-rec"
    cfg = write_job(work / f"{name}.yaml", {
        "steps": 15, "log_every": 10_000, "faults": [], "checkpoint.every_steps": 3, "recovery.max_restarts": 1,
        "timeouts": {"collective_s": 120, "control_s": 600, "startup_s": 600, "shutdown_s": 30}},
        entry=entry_of("recovery_entry"), params={**MODEL, **TRAIN, "batch_per_rank": 2,
                                                  "bench": {"out": str(out), "deadline_s": deadline_s}})
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    env.update({"PYTHONPATH": os.pathsep.join([str(h.REPO), str(h.REPO)]), "PYTHONUNBUFFERED": "1",
                "ACCELPACT_CKPT_EXIT_AFTER_VERIFIED": "6"})
    t0 = time.monotonic()
    log = work / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", str(cfg), "--run-dir", str(run_dir)],
                                cwd=h.REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        rc = proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        rc = None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    snaps = {(e["restart"], e["step"]): e for e in _events(run_dir) if e.get("event") == "snapshot"
             and not e.get("skipped")}
    # What the snapshot itself blocks: its time less the wait for a slot the daemon still writes (backpressure from
    # the disk, the same for any snapshot taken while the previous one is being written).
    own = {k: e["blocking_s"] - (e.get("parts_s") or {}).get("wait_slot", 0.0) for k, e in snaps.items()}
    res: dict[str, Any] = {"tag": tag, "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
                           "blocking_s": {f"{r}:{s}": e["blocking_s"] for (r, s), e in sorted(snaps.items())},
                           "own_s": {f"{r}:{s}": v for (r, s), v in sorted(own.items())},
                           "proof": {f"{r}:{s}": e.get("capture_proof") for (r, s), e in sorted(snaps.items())
                                     if e.get("capture_proof")}}
    regular = [own[(1, s)] for s in (12, 15) if (1, s) in own]
    if rc != 0 or (1, 9) not in snaps or not regular:
        return {**res, "ok": False, "error": f"{name}: rc {rc}, snapshots {sorted(snaps)}: "
                                             f"{h.tail(log, 8, sep=' | ', limit=800)}"}
    res["restart_first_over_regular"] = own[(1, 9)] / h.med(regular)
    if (0, 3) in own and (0, 6) in own:
        res["start_first_over_second"] = own[(0, 3)] / own[(0, 6)]
    res["ok"] = True
    return res
