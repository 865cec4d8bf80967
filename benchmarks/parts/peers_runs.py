"""Peers benchmark, the running half: children, one run of each system (``benchmarks/parts/peers.py``).

Runs in the project's venv; the peers' workers (``benchmarks/parts/peers_workers/``) run in the peers' venvs
(``peers_venvs``).  Every child this module spawns is started in its own session and killed with its whole
group (SIGKILL) when its run ends, fails or passes its deadline; the torchft lighthouse ignores SIGTERM,
the nvidia-resiliency-ext Wrapper's monitor processes and the ranks ``ft_launcher`` starts leave the session
(they are adopted by pid and reaped too).  Our own ranks are started by ``accelpact-run`` itself (the fault runs: the decoder example's job file)
or by the library's launcher (``harness.launch_job``: the overhead run, whose job file names the entry point
``peers_entry``).  Each ``run_*`` returns a dict with ``ok`` and either its
measurements or ``error``.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h

REPO = h.REPO
VENVS = REPO / "benchmarks" / ".venvs"
WORKERS = REPO / "benchmarks" / "parts" / "peers_workers"
TORCH_PIN = "torch==2.13.0"
#: Each peer's candidate releases, newest first (``peers_venvs`` uses the first that works here); ``features``:
#: the entry points the benchmark uses, name -> (module, attributes, executable in the venv's bin/ or None);
#: ``title``: the peer's name, then the release in use once ``peers_venvs.ensure_venv`` has chosen it.
_GLIBC_239 = ("the index has it only as manylinux_2_39 wheels (glibc 2.39 or newer){}, and no source "
              "distribution")
PEERS: dict[str, dict[str, Any]] = {
    "torchft": {
        "name": "torchft", "title": "torchft", "module": "torchft",
        "features": {"manager": ("torchft", ("Manager", "ProcessGroupGloo"), "torchft_lighthouse")},
        "candidates": (
            # The nightly build is torchft's newest; its wheel asks for torch>=2.7 and carries no torch binary.
            {"pin": "torchft-nightly==2026.10.26", "dist": "torchft-nightly", "label": "torchft nightly",
             "about": "torchft's newest build, published as `torchft-nightly` (the newest release is 0.2.0)"},
            {"pin": "torchft==0.2.0", "dist": "torchft"},  # the newest release
        ),
    },
    "nvrx": {
        "name": "nvidia-resiliency-ext", "title": "nvidia-resiliency-ext", "module": "nvidia_resiliency_ext",
        "features": {"inprocess": ("nvidia_resiliency_ext.inprocess", ("Wrapper", "CallWrapper"), None),
                     "injob": ("nvidia_resiliency_ext.fault_tolerance", ("RankMonitorClient",), "ft_launcher")},
        "candidates": (
            {"pin": "nvidia-resiliency-ext==0.7.0", "dist": "nvidia-resiliency-ext",
             "note": _GLIBC_239.format(", for CPython 3.12 only")},
            {"pin": "nvidia-resiliency-ext==0.6.0", "dist": "nvidia-resiliency-ext", "note": _GLIBC_239.format("")},
            {"pin": "nvidia-resiliency-ext==0.5.0", "dist": "nvidia-resiliency-ext", "note": _GLIBC_239.format("")},
            {"pin": "nvidia-resiliency-ext==0.4.1", "dist": "nvidia-resiliency-ext"},
        ),
    },
}
STEPS, FAULT_STEP = 25, 15
FAULT = f"boundary:{FAULT_STEP}:1"
RUN_DEADLINE_S = 120  # one run (one job, one torchft experiment, one nvrx launch)
#: What a child must not inherit: it would think it runs inside Slurm or torchrun.
CHILD_SCRUB = ("SLURM_", "ACCELPACT_", "TORCHFT_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK")

read_jsonl = h.read_jsonl


def tail(path: Path, n: int = 6) -> str:
    return h.tail(path, n, sep=" | ", limit=800)


def job_file() -> Path:
    """The reference job file (its ``params`` are what every system trains)."""
    from benchmarks.parts.workload import JOB_FILE

    return JOB_FILE


# ====================================================================== processes


class Procs:
    """Every child this script starts: each in its own session, killed (SIGKILL, whole group) on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pids: list[tuple[int, str]] = []  # (pid, cmdline marker): daemons that left the group

    def spawn(self, cmd: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        with open(log, "ab") as fh:  # the child keeps its own copy of the descriptor
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=env, cwd=cwd, start_new_session=True)
        self.procs.append(p)
        return p

    def adopt(self, pid: int, marker: str) -> None:
        self.pids.append((pid, marker))

    def kill(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def kill_all(self) -> None:
        for p in self.procs:
            self.kill(p)
        for pid, marker in self.pids:  # only if it still is the process we adopted
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if marker.encode() not in fh.read():
                        continue
                os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        self.procs.clear()
        self.pids.clear()


PROCS = Procs()


def wait_for(pred: Callable[[], bool], deadline_s: float, what: str, poll_s: float = 0.05) -> None:
    end = time.monotonic() + deadline_s
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {deadline_s:.0f} s")
        time.sleep(poll_s)


def wait_exit(procs: list[subprocess.Popen], deadline_s: float, what: str) -> list[int | None]:
    try:
        wait_for(lambda: all(p.poll() is not None for p in procs), deadline_s, what, 0.1)
    finally:
        for p in procs:
            PROCS.kill(p)
    return [p.returncode for p in procs]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def clean_env() -> dict[str, str]:
    """This environment less anything that would make a child think it runs inside Slurm or torchrun."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CHILD_SCRUB)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ====================================================================== runs


def write_config(path: Path, collective_s: float, snapshots: bool = True, entry: str | None = None,
                 bench: dict[str, Any] | None = None) -> Path:
    """The reference job file (the decoder example, its entry made absolute) with ``collective_s`` and no
    faults (``snapshots=False``: no checkpoints); ``entry``/``bench``: a benchmark's entry point and its plan."""
    from benchmarks.parts.workload import TRAIN_ENTRY, write_job

    overrides: dict[str, Any] = {"timeouts.collective_s": collective_s, "faults": []}
    if not snapshots:
        overrides["checkpoint.every_steps"] = 0
    if entry:
        overrides["log_every"] = 1_000_000  # no progress lines inside the timed segments
    return write_job(path, overrides, entry=entry or TRAIN_ENTRY, params={"bench": bench} if bench else None)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "events.jsonl")


def run_ours_fault(cfg: Path, timeout_s: float, work: Path, tag: str) -> dict[str, Any]:
    """One ``accelpact-run`` job with the fault; timings from its events.jsonl."""
    run_dir = work / f"ours-{tag}"
    run_dir.mkdir()
    cmd = [sys.executable, "-m", "accelpact_slurm.cli.run", str(cfg), "--run-dir", str(run_dir),
           "--inject-fault", FAULT]
    t_spawn = time.time()
    p = PROCS.spawn(cmd, work / f"ours-{tag}.log", env=clean_env(), cwd=REPO)
    ended = lambda: any(e["event"] in ("job_end", "fail_stop") for e in _events(run_dir))
    try:
        wait_for(lambda: p.poll() is not None or ended(), RUN_DEADLINE_S, "ours: job end", 0.1)
        # The job is over; the per-node daemons may still be verifying the last snapshot in the
        # background: that is not part of the measurement, so it is not waited for long.
        wait_for(lambda: p.poll() is not None, 1.5, "ours: exit", 0.1)
    except TimeoutError:
        pass
    finally:
        PROCS.kill(p)
    ev = [e for e in _events(run_dir)]
    r: dict[str, Any] = {"system": "ours", "timeout_s": timeout_s, "spawn_t": t_spawn}
    if any(e["event"] == "fail_stop" or e.get("restart", 0) > 0 for e in ev):
        why = [f"rank {e.get('rank')}: {e.get('reason')}" for e in ev if e["event"] == "fail_stop"]
        why += [f"fault on rank {e.get('rank')} in {e.get('phase')} of update {e.get('step')}: {e.get('error')}"
                for e in ev if e["event"] == "fault"]
        log = [ln for ln in tail(work / f"ours-{tag}.log", 40).split(" | ") if "exited with code" in ln]
        return {**r, "ok": False, "error": "the job went to L2 (fail-stop / relaunch), not L1: "
                + "; ".join(why + log)[:600]}
    faults = sorted(e["ts"] for e in ev if e["event"] == "fault")
    steps = {e["step"]: e for e in ev if e["event"] == "step"}
    repair = next((e for e in ev if e["event"] == "repair"), None)
    if not faults or repair is None or FAULT_STEP + 1 not in steps or STEPS not in steps:
        return {**r, "ok": False, "error": f"incomplete run (faults {len(faults)}, repair {repair is not None}, "
                                           f"last step {max(steps) if steps else None}): {tail(work / f'ours-{tag}.log')}"}
    t16 = steps[FAULT_STEP + 1]["ts"]
    snaps = {e["step"] for e in ev if e["event"] == "snapshot"}
    normal = [steps[s]["step_s"] for s in steps if s not in (1, FAULT_STEP) and s not in snaps]
    t_first = steps[1]["ts"] - steps[1]["step_s"]
    med = statistics.median(normal)
    return {**r, "ok": True, "fault_to_resume_s": t16 - faults[0], "detect_s": faults[-1] - faults[0],
            "after_detect_s": t16 - faults[-1], "beyond_timeout_s": t16 - faults[0] - timeout_s,
            "recovery_work_s": t16 - faults[0] - timeout_s - med, "resume_step_s": steps[FAULT_STEP + 1]["step_s"],
            "repair_total_s": repair["total_s"], "repair_fault_to_resume_s": repair.get("fault_to_resume_s"),
            "repair_phases": repair.get("phases"), "rebound": repair.get("rebound"),
            "step_s": med, "run_25_s": steps[STEPS]["ts"] - t_first, "goodput": STEPS * med / (steps[STEPS]["ts"] - t_first),
            "snapshots": sorted(snaps), "start_to_first_commit_s": steps[1]["ts"] - t_spawn}


def run_ours_overhead(collective_s: float, work: Path, rounds: int, steps: int) -> dict[str, Any]:
    """Guarded vs plain updates on the job's own ranks (entry point ``peers_entry``, started by the library's
    launcher), from the reference job file without snapshots (no daemons)."""
    from accelpact_slurm.core.config import load_config
    from benchmarks.parts.workload import entry_of

    out = work / "ours-overhead.jsonl"
    run_dir = work / "ours-overhead"
    plan = {"out": str(out), "rounds": rounds, "steps": steps, "warmup": 3, "deadline_s": RUN_DEADLINE_S}
    cfg = write_config(work / "job-overhead.yaml", collective_s, snapshots=False, entry=entry_of("peers_entry"),
                       bench=plan)
    c = load_config(cfg)
    nodes, rpn = c.topology.nodes, c.topology.ranks_per_node
    rc = h.launch_job(cfg, run_dir, scrub=CHILD_SCRUB, echo=h.LineFilter(("[accelpact] rank ",)),
                      job_id=f"bench-peers-{os.getpid()}")
    recs = read_jsonl(out)
    seg = segment_ratios(recs, "guarded", "plain")
    if not seg["ratios"]:
        return {"ok": False, "error": f"no segments (exit code {rc}): {tail(run_dir / 'logs' / 'rank-0.log')}"}
    return {"ok": True, **seg, "world": nodes * rpn}


def segment_ratios(recs: list[dict[str, Any]], test: str, base: str) -> dict[str, Any]:
    """Per round: time of the ``test`` segment / of the ``base`` segment (each timed between two barriers).

    ``test_step_s``/``base_step_s``: the segments' time per update, for reference.
    """
    by = {(r["round"], r["mode"]): r for r in recs if r.get("ev") == "segment"}
    rounds = sorted({k[0] for k in by})
    ratios, t_s, b_s = [], [], []
    for rd in rounds:
        if (rd, test) in by and (rd, base) in by:
            t, b = by[(rd, test)], by[(rd, base)]
            ratios.append(t["seg_s"] / b["seg_s"])
            t_s.append(t["seg_s"] / len(t["dts"]))
            b_s.append(b["seg_s"] / len(b["dts"]))
    return {"ratios": ratios, "test_step_s": t_s, "base_step_s": b_s}


def run_torchft(py: Path, hb_s: float, work: Path, tag: str, overhead: tuple[int, int] | None) -> dict[str, Any]:
    """Lighthouse + two replica groups; group 1 dies after update 15 and is restarted after the survivor resumes."""
    lh_port, plain_port = h.free_ports(2)
    lh_bin = py.parent / "torchft_lighthouse"
    files = {k: work / f"torchft-{tag}-{k}.jsonl" for k in ("A", "B", "B2")}
    r: dict[str, Any] = {"system": "torchft", "heartbeat_s": hb_s}
    lh = PROCS.spawn([str(lh_bin), "--min_replicas", "1", "--bind", f"127.0.0.1:{lh_port}",
                      "--heartbeat_timeout_ms", str(int(hb_s * 1000))], work / f"torchft-{tag}-lighthouse.log",
                     env=clean_env())
    try:
        wait_for(lambda: port_open(lh_port) or lh.poll() is not None, 20, "torchft lighthouse")
        if lh.poll() is not None:
            return {**r, "ok": False, "error": f"lighthouse exited: {tail(work / f'torchft-{tag}-lighthouse.log')}"}

        def worker(rid: int, key: str, *extra: str) -> subprocess.Popen:
            cmd = [str(py), str(WORKERS / "torchft_worker.py"), "--replica-id", str(rid),
                   "--lighthouse", f"http://127.0.0.1:{lh_port}", "--plain-port", str(plain_port),
                   "--out", str(files[key]), "--steps", str(STEPS), "--fault-step", str(FAULT_STEP),
                   "--deadline-s", str(RUN_DEADLINE_S), *extra]
            if overhead:
                cmd += ["--overhead-rounds", str(overhead[0]), "--overhead-steps", str(overhead[1])]
            return PROCS.spawn(cmd, work / f"torchft-{tag}-{key}.log", env=clean_env(), cwd=WORKERS)

        spawn = {"A": time.time()}
        a = worker(0, "A", "--expect-rejoin")
        spawn["B"] = time.time()
        b = worker(1, "B")
        try:
            wait_exit([b], 60, "torchft group 1 reaching the fault")
            wait_for(lambda: any(x.get("u", 0) > FAULT_STEP for x in read_jsonl(files["A"]) if x["ev"] == "commit")
                     or a.poll() is not None, hb_s + 40, "torchft survivor resuming", 0.05)
            spawn["B2"] = time.time()
            b2 = worker(1, "B2", "--restarted")
            wait_exit([a, b2], RUN_DEADLINE_S, "torchft survivor and restarted group")
        except TimeoutError as exc:
            return {**r, "ok": False, "error": f"{exc}: A {tail(work / f'torchft-{tag}-A.log', 3)}"}
    finally:
        PROCS.kill(lh)  # it ignores SIGTERM
    A, B, B2 = (read_jsonl(files[k]) for k in ("A", "B", "B2"))
    fault = next((x for x in B if x["ev"] == "fault"), None)
    ca = [x for x in A if x["ev"] == "commit"]
    c16 = next((x for x in ca if x["u"] == FAULT_STEP + 1), None)
    c25 = next((x for x in ca if x["u"] == STEPS), None)
    if fault is None or c16 is None or c25 is None:
        return {**r, "ok": False, "error": f"incomplete (fault {fault is not None}, survivor update 16 "
                                           f"{c16 is not None}): {tail(work / f'torchft-{tag}-A.log', 3)}"}
    normal = [x["dt"] for x in ca if 1 < x["u"] <= FAULT_STEP]
    med = statistics.median(normal)
    c1 = ca[0]
    t_first = c1["t"] - c1["dt"]
    f2r = c16["t"] - fault["t"]
    r.update(ok=True, fault_to_resume_s=f2r, beyond_timeout_s=f2r - hb_s, recovery_work_s=f2r - hb_s - med,
             resume_step_s=c16["dt"],
             step_s=med, run_25_s=c25["t"] - t_first, goodput=STEPS * med / (c25["t"] - t_first),
             aborted_updates=sum(1 for x in A if x["ev"] == "abort"))
    first_b = next((x for x in B if x["ev"] == "commit"), None)
    first_b2 = next((x for x in B2 if x["ev"] == "commit"), None)
    if first_b and first_b2:
        imp = next((x for x in B2 if x["ev"] == "imported"), {})
        ready = next((x for x in B2 if x["ev"] == "manager_ready"), {})
        r.update(initial_start_s=first_b["t"] - spawn["B"], rejoin_s=first_b2["t"] - spawn["B2"],
                 rejoin_import_s=imp.get("import_s"), rejoin_heal_step_s=first_b2["dt"],
                 rejoin_manager_ready_s=(ready["t"] - spawn["B2"]) if ready else None,
                 rejoined_at_update=first_b2["u"], survivor_updates_before_rejoin=first_b2["u"] - FAULT_STEP)
    else:
        r["rejoin_error"] = f"restarted group did not commit: {tail(work / f'torchft-{tag}-B2.log', 3)}"
    if overhead:
        seg = segment_ratios(A, "managed", "plain")
        r["overhead"] = {"ok": bool(seg["ratios"]), **seg}
    return r


def run_torchft_hsdp_overhead(cfg: Path, work: Path, overhead: tuple[int, int]) -> dict[str, Any]:
    """torchft's per-update cost on our job's four ranks: the recovery benchmark's HSDP worker (FSDP2 in each of 2
    replica groups of 2, torchft's managed all-reduce across them; the job file's model, optimizer and data) with
    no fault, then ABBA segments of managed updates and of the same FSDP2 updates over a plain Gloo group
    (``recovery_torchft.run_trial(..., overhead=...)``); every rank timed, the slowest one's segment counted."""
    from benchmarks.parts.recovery_torchft import run_trial

    r = run_trial("none", step=2, rank=1, workdir=work, timeout_s=RUN_DEADLINE_S, steps=3, config=str(cfg),
                  overhead=overhead)
    return {"system": "torchft", "form": r.get("form"), **{k: r.get(k) for k in (
        "ok", "error", "ratios", "test_step_s", "base_step_s", "added_ms", "per_rank_seg_s", "torchft", "wall_s")}}


def run_nvrx(py: Path, mode: str, collective_s: float, work: Path, tag: str, window: int) -> dict[str, Any]:
    """Two ranks, wrapped (with the fault) or plain (the per-update baseline)."""
    port = h.free_ports(3, consecutive=True)[0]
    out = work / f"nvrx-{tag}.jsonl"
    procs = []
    for rank in range(2):
        env = clean_env()
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)})
        cmd = [str(py), str(WORKERS / "nvrx_worker.py"), "--mode", mode, "--out", str(out), "--steps", str(STEPS),
               "--collective-s", str(collective_s), "--deadline-s", str(RUN_DEADLINE_S),
               "--window-steps", str(window)]
        if mode == "wrapped":
            cmd += ["--fault-step", str(FAULT_STEP)]
        procs.append(PROCS.spawn(cmd, work / f"nvrx-{tag}-{rank}.log", env=env, cwd=WORKERS))
    r: dict[str, Any] = {"system": "nvrx", "mode": mode}
    try:
        # The Wrapper's monitor processes leave the session: adopt them as soon as they are known.
        def adopt_and_check() -> bool:
            for x in read_jsonl(out):
                if x["ev"] == "monitor" and (x["pid"], "nvrx_worker") not in PROCS.pids:
                    PROCS.adopt(x["pid"], "nvrx_worker")
            return all(p.poll() is not None for p in procs)

        wait_for(adopt_and_check, RUN_DEADLINE_S, f"nvrx {mode} ranks", 0.1)
    except TimeoutError as exc:
        return {**r, "ok": False, "error": f"{exc}: {tail(work / f'nvrx-{tag}-0.log', 3)}"}
    finally:
        for p in procs:
            PROCS.kill(p)
    recs = read_jsonl(out)
    c0 = [x for x in recs if x["ev"] == "commit" and x["rank"] == 0]
    done = [x for x in recs if x["ev"] == "done"]
    if len(done) < 2 or not c0 or c0[-1]["u"] != STEPS:
        return {**r, "ok": False, "error": f"incomplete ({len(done)} ranks done): {tail(work / f'nvrx-{tag}-0.log', 3)}"}
    first = next(x for x in c0 if x["u"] == 1)
    last = next(x for x in c0 if x["u"] == STEPS)
    normal = [x["dt"] for x in c0 if x["u"] not in (1, FAULT_STEP + 1)]
    med = statistics.median(normal)
    win = [x["seg_s"] / x["n"] for x in recs if x["ev"] == "window" and x["rank"] == 0]
    r.update(ok=True, step_s=med, run_25_s=last["t"] - (first["t"] - first["dt"]),
             goodput=STEPS * med / (last["t"] - (first["t"] - first["dt"])), window_step_s=win[0] if win else None)
    if mode == "wrapped":
        fault = next((x for x in recs if x["ev"] == "fault"), None)
        c16 = next((x for x in c0 if x["u"] == FAULT_STEP + 1), None)
        if fault is None or c16 is None:
            return {**r, "ok": False, "error": "no fault or no update 16"}
        reentered = [x["t"] for x in recs if x["ev"] == "iteration" and x["iteration"] >= 1]
        pg = [x["t"] for x in recs if x["ev"] == "pg_ready" and x["iteration"] >= 1]
        r.update(fault_to_resume_s=c16["t"] - fault["t"],
                 restart_entered_s=(max(reentered) - fault["t"]) if reentered else None,
                 pg_ready_s=(max(pg) - fault["t"]) if pg else None, resume_step_s=c16["dt"],
                 iterations=1 + max((x["iteration"] for x in recs if x["ev"] == "iteration"), default=0))
    return r


def run_nvrx_injob(py: Path, collective_s: float, work: Path, tag: str, ckpt_every: int) -> dict[str, Any]:
    """Two ranks under ``ft_launcher`` (in-job restart, one restart allowed); rank 1 is killed after update 15,
    the launcher restarts both workers, which resume from their last checkpoint (``nvrx_injob_worker.py``)."""
    port = h.free_ports(1)[0]
    out = work / f"nvrx-injob-{tag}.jsonl"
    ckpt = work / f"nvrx-injob-{tag}-ckpt"
    ckpt.mkdir()
    log = work / f"nvrx-injob-{tag}.log"
    cmd = [str(py.parent / "ft_launcher"), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-peers-{os.getpid()}-{tag}",
           "--max-restarts", "1", "--ft-initial-rank-heartbeat-timeout", "60",
           "--ft-rank-heartbeat-timeout", f"{collective_s:g}", "--ft-enable-nic-monitor", "false",
           str(WORKERS / "nvrx_injob_worker.py"), "--out", str(out), "--steps", str(STEPS),
           "--fault-step", str(FAULT_STEP), "--ckpt-dir", str(ckpt), "--ckpt-every", str(ckpt_every),
           "--collective-s", f"{collective_s:g}", "--deadline-s", str(RUN_DEADLINE_S)]
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"
    r: dict[str, Any] = {"system": "nvrx_injob", "heartbeat_s": collective_s, "checkpoint_every": ckpt_every}
    t_spawn = time.time()
    p = PROCS.spawn(cmd, log, env=env, cwd=WORKERS)

    def adopt_and_check() -> bool:
        # The workers run in sessions of their own (the launcher's process context starts them so): adopt them.
        recs = read_jsonl(out)
        for x in recs:
            if x["ev"] == "started" and (x["pid"], "nvrx_injob_worker") not in PROCS.pids:
                PROCS.adopt(x["pid"], "nvrx_injob_worker")
        return p.poll() is not None or sum(1 for x in recs if x["ev"] == "done") >= 2

    try:
        wait_for(adopt_and_check, RUN_DEADLINE_S, "nvrx in-job restart: launcher and ranks", 0.1)
        try:  # the ranks are done: give the launcher a moment to see it and exit on its own
            wait_for(lambda: p.poll() is not None, 5, "nvrx in-job restart: launcher exit", 0.1)
        except TimeoutError:
            r["launcher_exit"] = "killed 5 s after both ranks were done"
    except TimeoutError as exc:
        return {**r, "ok": False, "error": f"{exc}: {tail(log, 4)}"}
    finally:
        PROCS.kill(p)
    r["launcher_rc"] = p.returncode
    recs = read_jsonl(out)
    inc = {i: [x for x in recs if x.get("incarnation") == i] for i in (0, 1)}
    fault = next((x for x in inc[0] if x["ev"] == "fault"), None)
    c0 = [x for x in inc[0] if x["ev"] == "commit" and x["rank"] == 0]
    c1 = [x for x in inc[1] if x["ev"] == "commit" and x["rank"] == 0]
    c16 = next((x for x in c1 if x["u"] == FAULT_STEP + 1), None)
    c25 = next((x for x in c1 if x["u"] == STEPS), None)
    done = [x for x in inc[1] if x["ev"] == "done"]
    if fault is None or c16 is None or c25 is None or len(done) < 2 or not c0 or c0[0]["u"] != 1:
        return {**r, "ok": False, "error": f"incomplete (fault {fault is not None}, restarted ranks "
                                           f"{len({x['rank'] for x in inc[1]})}, update 16 after the restart "
                                           f"{c16 is not None}, done {len(done)}): {tail(log, 4)}"}
    ckpt_us = {x["u"] for x in recs if x["ev"] == "checkpoint"}
    normal = [x["dt"] for x in c0 if 1 < x["u"] <= FAULT_STEP]
    med = statistics.median(normal)
    first = c0[0]
    t_first = first["t"] - first["dt"]

    def latest(ev: str) -> float | None:  # the later of the two restarted ranks reaching ``ev``
        ts = [x["t"] for x in inc[1] if x["ev"] == ev]
        return (max(ts) - fault["t"]) if len(ts) == 2 else None

    started = [x["started"] for x in inc[1] if x["ev"] == "started"]
    loaded = [x for x in inc[1] if x["ev"] == "loaded" and x["rank"] == 0]
    replay = [x for x in c1 if x["replay"]]
    f2r = c16["t"] - fault["t"]
    r.update(ok=True, fault_to_resume_s=f2r, step_s=med, resume_step_s=c16["dt"],
             relaunch_s=(max(started) - fault["t"]) if len(started) == 2 else None,
             restart_imported_s=latest("imported"), restart_monitor_s=latest("monitor"),
             restart_pg_ready_s=latest("pg_ready"), resumed_from=loaded[0]["u"] if loaded else 0,
             load_s=loaded[0]["load_s"] if loaded else None, replayed_updates=len(replay),
             replay_s=sum(x["dt"] for x in replay), first_commit_after_fault_s=c1[0]["t"] - fault["t"],
             initial_start_s=first["t"] - t_spawn, checkpoints=sorted(ckpt_us),
             save_s=statistics.median([x["save_s"] for x in recs if x["ev"] == "checkpoint"]) if ckpt_us else None,
             run_25_s=c25["t"] - t_first, goodput=STEPS * med / (c25["t"] - t_first))
    return r
