"""L1 backward benchmark, the running half: one of our jobs, one torchft experiment (``benchmarks/parts/l1backward.py``).

Our jobs are started by ``accelpact-run`` itself (``python -m accelpact_slurm.cli.run JOB.yaml --run-dir DIR
--inject-fault PHASE:STEP:RANK``), the job file being the decoder example's with the timed entry point
``l1backward_entry`` (and ``recovery.max_restarts: 0``: a fault that goes to L2 ends the job at its
fail-stop; the relaunch that would follow is not what is measured).  torchft runs in its own venv
(``peers_venvs``): a lighthouse and two replica groups of ``benchmarks/parts/peers_workers/torchft_withhold_worker.py``.
Every child is started in its own session and killed with its whole group when its run ends or passes its
deadline (``peers_runs.PROCS``).  Each ``run_*`` returns a dict with ``ok`` and its measurements, or
``error``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.peers_runs import PROCS, WORKERS, clean_env, port_open, read_jsonl, tail, wait_for

STEPS = 25
#: The update the faults are about.  ``backward:16`` withholds update 16's backward all-reduces;
#: ``boundary:15`` is the boundary collective after update 15, which the guard runs at update 16's decision
#: (``BoundaryGuard.decide``: ``injector.fires("boundary", step - 1)``); ``backward:17`` is the next update's
#: backward (a link that failed after update 16's boundary collective is first seen there).
FAULT_U = 16
FAULTS = {"backward": f"backward:{FAULT_U}:1", "boundary": f"boundary:{FAULT_U - 1}:1",
          "next": f"backward:{FAULT_U + 1}:1", "xnode": None, "forward": f"forward:{FAULT_U}:1", "step": None}
#: The update each class's fault lands in.
FAULT_UPDATE = {"backward": FAULT_U, "boundary": FAULT_U, "next": FAULT_U + 1, "forward": FAULT_U, "step": FAULT_U}
STEP_FAULT = (FAULT_U, 1)  # the optimizer step's fault: rank 1's step of update 16 raises (entry point)
XNODE_RANK = 1  # the capture proof's fault: rank 1 withholds its part (entry point); the update is the first snapshot
RUN_DEADLINE_S = 90


def first_snapshot() -> int:
    """The first update a start snapshots (the job file's ``checkpoint.every_steps``): its snapshot runs the
    capture proof."""
    from accelpact_slurm.core.config import load_config
    from benchmarks.parts.workload import JOB_FILE

    return load_config(JOB_FILE).checkpoint.every_steps


def fault_update(cls: str) -> int:
    return first_snapshot() if cls == "xnode" else FAULT_UPDATE[cls]


def write_config(path: Path, collective_s: float, out: Path, step_fault: tuple[int, int] | None,
                 xnode_fault: tuple[int, int] | None = None) -> Path:
    """The decoder example's job file with the timed entry point, ``collective_s``, no relaunch, no faults
    in the file (they come from ``--inject-fault``), the plan in ``params.bench``."""
    from benchmarks.parts.workload import entry_of, write_job

    plan = {"out": str(out), "deadline_s": RUN_DEADLINE_S, "step_fault": list(step_fault) if step_fault else None,
            "xnode_fault": list(xnode_fault) if xnode_fault else None}
    return write_job(path, {"steps": STEPS, "timeouts.collective_s": collective_s, "recovery.max_restarts": 0,
                            "faults": []}, entry=entry_of("l1backward_entry"), params={"bench": plan})


def run_ours(cls: str, collective_s: float, work: Path, tag: str) -> dict[str, Any]:
    """One ``accelpact-run`` job with the fault of class ``cls`` (``backward``, ``boundary``, ``next``,
    ``xnode``, ``forward``, ``step``); its outcome (``l1``/``l2``) from ``events.jsonl`` and the job's exit code,
    its update timings from the entry point."""
    from accelpact_slurm.core.errors import EXIT_REQUEUE

    name = f"ours-{cls}-{tag}"
    run_dir, timings = work / name, work / f"{name}-timing.jsonl"
    fu = fault_update(cls)
    cfg = write_config(work / f"{name}.yaml", collective_s, timings, STEP_FAULT if cls == "step" else None,
                       (fu, XNODE_RANK) if cls == "xnode" else None)
    fault = FAULTS[cls]
    cmd = [sys.executable, "-m", "accelpact_slurm.cli.run", str(cfg), "--run-dir", str(run_dir)]
    if fault:
        cmd += ["--inject-fault", fault]
    log = work / f"{name}.log"
    t0 = time.monotonic()
    p = PROCS.spawn(cmd, log, env=clean_env(), cwd=h.REPO)
    events = lambda: read_jsonl(run_dir / "events.jsonl")  # noqa: E731
    ended = lambda: any(e["event"] in ("job_end", "fail_stop") for e in events())  # noqa: E731
    try:
        wait_for(lambda: p.poll() is not None or ended(), RUN_DEADLINE_S, f"ours ({cls}): job end", 0.1)
        # Over: the per-node daemons may still verify the last snapshot, which is not measured.
        wait_for(lambda: p.poll() is not None, 3.0, f"ours ({cls}): exit", 0.1)
    except TimeoutError:
        pass
    finally:
        PROCS.kill(p)
    wall = time.monotonic() - t0
    ev = events()
    described = {"step": f"optimizer step of update {STEP_FAULT[0]} raises on rank {STEP_FAULT[1]} (entry point)",
                 "xnode": f"rank {XNODE_RANK} withholds its part of the capture proof's cross-node collective "
                          f"after update {fu} (entry point)"}
    r: dict[str, Any] = {"system": "ours", "class": cls, "fault": fault or described[cls], "fault_u": fu,
                         "wall_s": wall, "collective_s": collective_s, "exit_code": p.returncode,
                         "timings": read_jsonl(timings)}
    if not ev:
        return {**r, "ok": False, "error": f"no events (exit code {p.returncode}): {tail(log)}"}
    steps = {e["step"]: e for e in ev if e["event"] == "step" and e.get("restart", 0) == 0}
    repairs = [e for e in ev if e["event"] == "repair"]
    stops = [e for e in ev if e["event"] == "fail_stop"]
    loads = [e for e in ev if e["event"] == "restart_load"]
    faults = [e for e in ev if e["event"] == "fault" and e.get("step") == fu]
    job_ended = any(e["event"] == "job_end" for e in ev)
    r.update(repairs=[{k: e.get(k) for k in ("scope", "frontier", "discarded_update", "replayed_updates",
                                             "total_s", "ranks", "rebound")} for e in repairs],
             fail_stops=len(stops), restart_loads=len(loads), fault_events=len(faults),
             fault_phases=sorted({e.get("phase") for e in faults}),
             stop_reason=(stops[0].get("reason") or "")[:300] if stops else None,
             stop_exit=stops[0].get("exit_code") if stops else None, last_step=max(steps) if steps else None)
    if repairs and not stops and not loads and fu in steps and STEPS in steps:
        r["outcome"] = "l1"
    elif stops or loads:
        r["outcome"] = "l2"
    elif not job_ended and p.returncode == EXIT_REQUEUE:  # ranks crashed: the launcher asks for a requeue
        r["outcome"] = "l2"
        r["stop_reason"] = f"no `fail_stop`: the ranks exited with an error ({crash_line(run_dir)}); the launcher " \
                           f"exits {EXIT_REQUEUE} (requeue, reload the newest snapshot)"
        r["stop_exit"] = p.returncode
    else:
        return {**r, "ok": False, "error": f"neither L1 nor L2 (repairs {len(repairs)}, last step "
                                           f"{r['last_step']}, exit code {p.returncode}): {tail(log)}"}
    clean = [e["step_s"] for s, e in steps.items() if s not in (1, fu, fu + 1) and s % 10 != 0
             and s - 1 not in (10, 20)]  # nor the snapshot updates and the ones after them
    r["update_s"] = statistics.median(clean) if clean else None
    if r["outcome"] == "l1" and faults:
        ts = sorted(e["ts"] for e in faults)
        t_commit = steps[fu]["ts"]
        rep = next((e for e in repairs if e.get("discarded_update") == fu), repairs[0])
        r.update(detect_to_commit_s=t_commit - ts[-1], inject_to_commit_s=t_commit - ts[0],
                 detect_spread_s=ts[-1] - ts[0], repair_total_s=rep.get("total_s"),
                 repair_phases=rep.get("phases"), redo_update_s=steps[FAULT_U].get("step_s"))
    return {**r, "ok": True}


def crash_line(run_dir: Path) -> str:
    """The injected fault's error line if a rank log has one, else the last error line of the first that has."""
    found = []
    for log in sorted((run_dir / "logs").glob("rank-*.log")):
        lines = [x.strip() for x in h.tail(log, 60).splitlines() if "Error" in x or "Fault" in x]
        found += [(("injected" not in x), log.stem, x) for x in lines[-1:]]
    if not found:
        return "no error line in the rank logs"
    _, rank, line = min(found)
    return f"{rank}: {line[:240]}"


def run_torchft(py: Path, timeout_s: float, work: Path, tag: str) -> dict[str, Any]:
    """Lighthouse + two replica groups; group 1 withholds its part of update 16's all-reduce."""
    lh_port, start_port = h.free_ports(2)
    files = {rid: work / f"torchft-{tag}-{rid}.jsonl" for rid in (0, 1)}
    r: dict[str, Any] = {"system": "torchft", "timeout_s": timeout_s}
    t0 = time.monotonic()
    lh = PROCS.spawn([str(py.parent / "torchft_lighthouse"), "--min_replicas", "1", "--bind",
                      f"127.0.0.1:{lh_port}"], work / f"torchft-{tag}-lighthouse.log", env=clean_env())
    try:
        wait_for(lambda: port_open(lh_port) or lh.poll() is not None, 20, "torchft lighthouse")
        if lh.poll() is not None:
            return {**r, "ok": False, "error": f"lighthouse exited: {tail(work / f'torchft-{tag}-lighthouse.log')}"}
        procs = []
        for rid in (0, 1):
            cmd = [str(py), str(WORKERS / "torchft_withhold_worker.py"), "--replica-id", str(rid),
                   "--lighthouse", f"http://127.0.0.1:{lh_port}", "--start-port", str(start_port),
                   "--out", str(files[rid]), "--steps", str(STEPS), "--withhold-step", str(FAULT_U),
                   "--timeout-s", str(timeout_s), "--deadline-s", str(RUN_DEADLINE_S - 10)]
            procs.append(PROCS.spawn(cmd, work / f"torchft-{tag}-{rid}.log", env=clean_env(), cwd=WORKERS))
        try:
            wait_for(lambda: all(p.poll() is not None for p in procs), RUN_DEADLINE_S, "torchft replica groups", 0.1)
        except TimeoutError as exc:
            return {**r, "ok": False, "error": f"{exc}: {tail(work / f'torchft-{tag}-0.log', 3)}"}
        finally:
            for p in procs:
                PROCS.kill(p)
    finally:
        PROCS.kill(lh)  # it ignores SIGTERM
    r["wall_s"] = time.monotonic() - t0
    recs = {rid: read_jsonl(f) for rid, f in files.items()}
    withhold = next((x for x in recs[1] if x["ev"] == "withhold"), None)
    errors = [x for rid in (0, 1) for x in recs[rid] if x["ev"] == "error" and x["u"] == FAULT_U]
    survivor_err = next((x for x in recs[0] if x["ev"] == "error" and x["u"] == FAULT_U), None)
    commits = {rid: [x for x in recs[rid] if x["ev"] == "commit"] for rid in (0, 1)}
    c16 = [next((x for x in commits[rid] if x["u"] == FAULT_U), None) for rid in (0, 1)]
    done = [any(x["ev"] == "done" and x["u"] == STEPS for x in recs[rid]) for rid in (0, 1)]
    if withhold is None or survivor_err is None or None in c16 or not all(done):
        return {**r, "ok": False, "error": f"incomplete (withheld {withhold is not None}, survivor's error "
                                           f"{survivor_err is not None}, update {FAULT_U} committed "
                                           f"{[c is not None for c in c16]}, done {done}): "
                                           f"{tail(work / f'torchft-{tag}-0.log', 3)}"}
    t_commit = max(c["t"] for c in c16)  # the update is committed once both groups have committed it
    t_detect = max(x["t"] for x in errors)
    aborts = [x for rid in (0, 1) for x in recs[rid] if x["ev"] == "abort"]
    clean = [x["dt"] for x in commits[0] if 1 < x["u"] < FAULT_U]
    r.update(ok=True, detect_to_commit_s=t_commit - t_detect, inject_to_commit_s=t_commit - withhold["t"],
             detect_spread_s=t_detect - withhold["t"], update_s=statistics.median(clean) if clean else None,
             aborted={str(rid): sorted(x["u"] for x in aborts if x["replica"] == rid) for rid in (0, 1)},
             survivor_error=survivor_err.get("error"), redo_update_s=c16[0]["dt"],
             participants_at_16=[c["participants"] for c in c16])
    return r
