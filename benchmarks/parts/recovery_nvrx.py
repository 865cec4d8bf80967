"""nvidia-resiliency-ext's in-job restart on our HSDP job, one injected fault per trial: a peer measurement of the
recovery benchmark, next to ``recovery_torchft.py``.

Why: our recovery times are only comparable with NVRx's when NVRx restarts the same job on the same ranks.
``run_trial`` starts NVRx's launcher, ``ft_launcher --nproc-per-node 4`` (one emulated node; torchrun's agent with
a rank monitor per local rank), on four ranks of ``benchmarks/parts/peers_workers/nvrx_hsdp_worker.py`` (FSDP1 ``HYBRID_SHARD`` on
the 2-D mesh ``("replicate", "shard") = (2, 2)`` over Gloo, our project's default wrapping; the decoder example's
model, optimizer, schedule and data) in NVRx's own venv (``peers_venvs.ensure_venv``: the first of
``peers_runs.PEERS["nvrx"]``'s candidates that installs here, 0.4.1 on this machine), injects one fault on one
rank at one update, and lets NVRx do what it does: a rank that exits other than cleanly makes the launcher stop
the other three (SIGTERM, SIGKILL after ``workers_stop_timeout``) and start all four again (``--max-restarts``);
a rank whose heartbeat (sent after every committed update) is late by ``rank_heartbeat_timeout`` is SIGKILLed by
its rank monitor (checked every ``workload_check_interval``), which the launcher then sees as an exit.  The
restarted ranks have nothing in memory: they resume from the newest complete checkpoint (every ``ckpt_every``
updates, per-rank local shards) and train the updates after it again.  Every wait is bounded by the trial's
``timeout_s``; the launcher's process group and every rank it started (in sessions of their own: adopted by pid)
are SIGKILLed at the end.

It returns, per rank, the first commit of an update at or past the fault's after the injection (``time.time()``)
and the seconds to it, the slowest rank's "injection -> next committed update" (``recover_s``), when all four
next committed one update together, the restart's timeline (detection, relaunch, imports, process groups, load,
the replayed updates), what detected the fault (an exit seen by the launcher, a rank monitor's heartbeat timeout,
a Gloo timeout in a peer), whether the fault was handled and, if not, why; with NVRx's version and every timeout
used (NVRx's shipped defaults unless one would make a trial exceed about 90 s; ``TIMEOUT_NOTES`` says which are
lowered and why).

``KINDS`` are the faults (``link kill stop bug``); ``FAULTS`` maps the recovery benchmark's fault classes to them,
as ``recovery_torchft.FAULTS`` does (``run_trial(FAULTS[cls], ...)``, then ``recover_s`` and ``handled``).

CLI: ``python benchmarks/parts/recovery_nvrx.py --fault kill --trials 1`` prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
for _p in (str(_REPO),):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from benchmarks.harness import common as h  # noqa: E402
from benchmarks.parts.peers_runs import PROCS, REPO, WORKERS, clean_env, read_jsonl, tail, wait_for  # noqa: E402
from benchmarks.parts.recovery_runs import EVERY, U  # noqa: E402

KINDS = ("link", "kill", "stop", "bug")  # the faults run_trial injects (nvrx_hsdp_worker.py's --fault)
#: The recovery benchmark's fault classes (``recovery_runs.CLASSES``) that have an NVRx counterpart -> its kind.
#: ``link-boundary`` has none: a plain FSDP loop runs no collective between updates (NVRx adds none: heartbeats
#: go to the rank's own monitor over a local socket), so the first collective a broken link fails is the
#: backward's replication all-reduce; ``daemon-kill`` has none either (NVRx has no checkpoint daemon to kill).
FAULTS = {"link-backward": "link", "kill": "kill", "stop": "stop", "bug": "bug"}
WORKER = WORKERS / "nvrx_hsdp_worker.py"
MARKER = "nvrx_hsdp_worker"  # in an adopted rank's command line: it is still ours when it is killed


def _ours() -> dict[str, float]:
    """Our job's timeouts (the decoder example's job file): what the lowered ones are set to, like for like."""
    from accelpact_slurm.core.config import load_config
    from benchmarks.parts.workload import JOB_FILE

    t = load_config(JOB_FILE).timeouts
    return {"heartbeat_s": float(t.heartbeat_s), "collective_s": float(t.collective_s),
            "startup_s": float(t.startup_s)}


#: NVRx 0.4.1's shipped defaults (``FaultToleranceConfig``, ``ft_launcher``'s options), and, for the process
#: groups the training script makes, torch's (Gloo: 30 min); the ones lowered for the trials are in ``TIMEOUTS``.
SHIPPED = {"workload_check_interval": 5.0, "initial_rank_heartbeat_timeout": 3600.0,
           "rank_heartbeat_timeout": 2700.0, "workers_stop_timeout": 30.0, "monitor_interval": 0.1,
           "collective_s": 1800.0, "startup_s": 1800.0}
_O = _ours()
TIMEOUTS = {**SHIPPED, "rank_heartbeat_timeout": _O["heartbeat_s"], "collective_s": _O["collective_s"],
            "startup_s": _O["startup_s"]}
TIMEOUT_NOTES = {
    "rank_heartbeat_timeout": f"ships with 2700 s (45 min): a stopped or hung rank would be noticed after 45 min; "
                              f"lowered to {_O['heartbeat_s']:g} s, our job's timeouts.heartbeat_s, so both call a "
                              f"rank hung after the same silence (NVRx's monitor checks it every "
                              f"workload_check_interval, shipped 5 s, kept)",
    "collective_s": f"not NVRx's: the training script's Gloo groups (world, replicate, shard), torch's default "
                    f"1800 s; a withheld all-reduce would fail after 30 min; lowered to {_O['collective_s']:g} s, "
                    f"our job's timeouts.collective_s (the same Gloo timeout our ranks train with)",
    "startup_s": f"not NVRx's: the same groups until the ranks' start barrier (process group, mesh, checkpoint "
                 f"load), torch's default 1800 s; {_O['startup_s']:g} s, our job's timeouts.startup_s, so a "
                 f"rank still importing never times a peer out, and a start-up hang ends within a trial",
}
#: ft_launcher options that are not timeouts, and why they are set.
LAUNCHER_NOTES = {"--ft-enable-nic-monitor false": "no NICs or GPU topology on this CPU machine to monitor",
                  "--nnodes 1 --nproc-per-node 4": "one emulated node for the launcher (all four ranks on one "
                                                   "agent; our embedded default emulates 2 nodes x 2 ranks)"}

_VENV: dict[str, Any] = {}


def nvrx_venv(log=lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """NVRx's venv (created on first use by ``peers_venvs.ensure_venv``): ``{"python", "version", "pin", ...}``."""
    if not _VENV:
        from benchmarks.parts.peers_venvs import ensure_venv

        r = ensure_venv("nvrx", log)
        if r["status"] != "ok":
            raise RuntimeError(f"no nvidia-resiliency-ext venv: {r['reason']}")
        if not r.get("features", {}).get("injob", {}).get("ok"):
            raise RuntimeError(f"nvidia-resiliency-ext {r['version']} has no in-job restart here: "
                               f"{r['features'].get('injob')}")
        _VENV.update(r, python=str(REPO / r["venv"] / "bin" / "python"))
    return _VENV


def _first(recs: list[dict[str, Any]], ev: str, **match: Any) -> dict[str, Any] | None:
    return next((x for x in recs if x["ev"] == ev and all(x.get(k) == v for k, v in match.items())), None)


def _kill_adopted(pids: list[int]) -> None:
    """SIGKILL this trial's adopted ranks, each only while its command line still names the worker."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if MARKER.encode() not in fh.read():
                    continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _state(pid: int) -> str | None:
    """The process's state letter (``T``: stopped), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def run_trial(fault: str, *, step: int, rank: int, workdir: Path, timeout_s: float, steps: int | None = None,
              timeouts: dict[str, float] | None = None, max_restarts: int = 1, ckpt_every: int = EVERY,
              link_hold_s: float = 0.0, exit_on_error: bool = False, config: str | None = None) -> dict[str, Any]:
    """One trial: ``fault`` (link | kill | stop | bug) on global rank ``rank`` at update ``step``; everything ends
    within ``timeout_s`` (plus a few seconds of teardown).

    ``steps``: the ranks train until this update is committed (default ``step + 4``).  ``timeouts``: overrides of
    ``TIMEOUTS``.  ``max_restarts``: ft_launcher's ``--max-restarts``.  ``ckpt_every``: the checkpoint cadence
    (default: our recovery benchmark's snapshot cadence, ``recovery_runs.EVERY``).  ``link_hold_s``: how long the
    ``link`` rank sits in the all-reduce (0: until it is killed).  ``exit_on_error``: a rank whose loop raises
    exits at once (``os._exit``) instead of through interpreter shutdown.  Returns a dict (see the module's doc).
    """
    if fault not in KINDS:
        raise ValueError(f"fault must be one of {KINDS}, not {fault!r}")
    if not 0 <= rank < 4 or step < 2:
        raise ValueError("rank must be 0..3 and step >= 2 (update 1 is the start)")
    venv = nvrx_venv()
    py = Path(venv["python"])
    tmo = {**TIMEOUTS, **(timeouts or {})}
    unknown = set(tmo) - set(SHIPPED)
    if unknown:
        raise ValueError(f"unknown timeouts {sorted(unknown)}")
    steps = steps or step + 4
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out, log, ckpt = workdir / "ranks.jsonl", workdir / "launcher.log", workdir / "ckpt"
    ckpt.mkdir(exist_ok=True)
    port = h.free_ports(1)[0]
    res: dict[str, Any] = {
        "system": "nvrx", "nvrx": venv["version"], "nvrx_pin": venv["pin"], "torch": venv["torch"],
        "fault": fault, "step": step, "rank": rank, "steps": steps, "ckpt_every": ckpt_every,
        "timeout_s": timeout_s, "timeouts": tmo, "exit_on_error": exit_on_error, "max_restarts": max_restarts,
        "timeouts_lowered": {k: TIMEOUT_NOTES[k] if tmo[k] == TIMEOUTS[k] and k in TIMEOUT_NOTES
                             else "set by the caller" for k in tmo if tmo[k] != SHIPPED[k]},
        "launcher": f"ft_launcher (restart policy any-failed, max {max_restarts} restart(s)): any rank exiting "
                    f"non-zero -> all four stopped and started again; a rank whose heartbeat is late is SIGKILLed "
                    f"by its rank monitor; restarted ranks resume from the newest checkpoint",
        "launcher_options": LAUNCHER_NOTES,
        "form": "FSDP1 HYBRID_SHARD on the 2-D device mesh (replicate, shard) = (2, 2), Gloo, use_orig_params, "
                "one unit per Block; per-rank local-shard checkpoint (torch.save) every ckpt_every updates",
    }
    cmd = [str(py.parent / "ft_launcher"), "--nnodes", "1", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"recovery-nvrx-{os.getpid()}-{time.time_ns()}",
           "--max-restarts", str(max_restarts), "--monitor-interval", f"{tmo['monitor_interval']:g}",
           "--workers-stop-timeout", f"{tmo['workers_stop_timeout']:g}",
           "--ft-workload-check-interval", f"{tmo['workload_check_interval']:g}",
           "--ft-initial-rank-heartbeat-timeout", f"{tmo['initial_rank_heartbeat_timeout']:g}",
           "--ft-rank-heartbeat-timeout", f"{tmo['rank_heartbeat_timeout']:g}", "--ft-enable-nic-monitor", "false",
           str(WORKER), "--out", str(out), "--steps", str(steps), "--fault", fault, "--fault-step", str(step),
           "--fault-rank", str(rank), "--ckpt-dir", str(ckpt), "--ckpt-every", str(ckpt_every),
           "--collective-s", f"{tmo['collective_s']:g}", "--startup-s", f"{tmo['startup_s']:g}",
           "--link-hold-s", f"{link_hold_s:g}", "--deadline-s", f"{timeout_s + 5:g}"]
    if config:
        cmd += ["--config", config]
    if exit_on_error:
        cmd.append("--exit-on-error")
    env = clean_env()
    env["OMP_NUM_THREADS"] = "1"  # four ranks on a shared CPU: one thread each, as our embedded default runs them
    t_begin = time.time()
    deadline = time.monotonic() + timeout_s
    p = PROCS.spawn(cmd, log, env=env, cwd=WORKERS)
    adopted: list[int] = []
    stopped_left: list[int] = []
    timed_out = False

    def adopt_and_check() -> bool:
        # ft_launcher starts its ranks in sessions of their own: adopt each by pid as soon as it names itself
        recs = read_jsonl(out)
        for x in recs:
            if x["ev"] == "started" and x["pid"] not in adopted:
                adopted.append(x["pid"])
                PROCS.adopt(x["pid"], MARKER)
        return p.poll() is not None

    try:
        try:
            wait_for(adopt_and_check, max(1.0, deadline - time.monotonic()), "nvrx trial: launcher exit", 0.05)
        except TimeoutError:
            timed_out = True
    finally:
        adopt_and_check()
        stopped_left = [pid for pid in adopted if _state(pid) == "T"]
        PROCS.kill(p)  # the launcher's group: it, its rank monitors
        _kill_adopted(adopted)
    res["wall_s"] = time.time() - t_begin
    res["timed_out"] = timed_out
    res["launcher_rc"] = p.returncode if not timed_out else None
    return {**res, **_analyse(fault, step, rank, read_jsonl(out), log, timed_out, stopped_left, tmo,
                              max_restarts)}


_LOG_TS = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")
_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_ESCALATE = re.compile(r"Unable to shutdown process (\d+) via (\d+), forcefully exiting via (\d+)")
_RANK_ERR = re.compile(r"^\[rank(\d+)\]: (\w+(?:Error|Exception)\b.*)$")


def _log_events(log: Path) -> dict[str, Any]:
    """What ft_launcher's log says: the exits it saw, its restarts, rank monitors' heartbeat timeouts (epoch s),
    and each rank's last printed exception (torch prefixes a rank's traceback with ``[rankN]:``)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    ev: dict[str, Any] = {"exits": [], "restarts": [], "hb_timeouts": [], "escalations": [], "rank_errors": {}}
    for ln in lines:
        m = _LOG_TS.match(ln)
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000 if m else None
        if (e := _EXIT.search(ln)) and t:
            ev["exits"].append({"t": t, "exitcode": int(e.group(1)), "local_rank": int(e.group(2))})
        elif (k := _ESCALATE.search(ln)) and t:
            ev["escalations"].append({"t": t, "pid": int(k.group(1))})
        elif "will restart worker group" in ln and t:
            ev["restarts"].append({"t": t})
        elif ("Did not get subsequent heartbeat" in ln or "Did not get initial heartbeat" in ln) and t:
            who = re.search(r"RankMonServer\d+@[^:\]]*:(\d+)\]", ln)
            ev["hb_timeouts"].append({"t": t, "local_rank": int(who.group(1)) if who else None})
        elif (r := _RANK_ERR.match(ln)):
            ev["rank_errors"][int(r.group(1))] = r.group(2)[:240]
    return ev


def _analyse(fault: str, step: int, rank: int, recs: list[dict[str, Any]], log: Path, timed_out: bool,
             stopped_left: list[int], tmo: dict[str, float], max_restarts: int) -> dict[str, Any]:
    fault_rec = _first(recs, "fault", incarnation=0)
    if fault_rec is None:
        last = max((x["u"] for x in recs if x["ev"] == "commit"), default=None)
        return {"ok": False, "handled": False,
                "error": f"the fault was never injected (last update committed: {last}): {tail(log, 4)}"}
    t_inj, fu = fault_rec["t"], fault_rec["u"]
    per_rank: dict[int, dict[str, Any]] = {}
    for r in range(4):
        mine = sorted((x for x in recs if x["rank"] == r), key=lambda x: x["t"])
        # the update the fault hit, or a later one: a peer's commit of update N-1 can land just after a kill at
        # the start of N, and is no recovery
        c = next((x for x in mine if x["ev"] == "commit" and x["t"] > t_inj and x["u"] >= fu), None)
        per_rank[r] = {"first_commit_t": c["t"] if c else None, "after_s": (c["t"] - t_inj) if c else None,
                       "u": c["u"] if c else None, "incarnation": c["incarnation"] if c else None,
                       "last_u": max((x["u"] for x in mine if x["ev"] == "commit"), default=0),
                       "done": any(x["ev"] == "done" for x in mine)}
    by_u: dict[int, list[dict[str, Any]]] = {}
    for x in recs:
        if x["ev"] == "commit" and x["t"] > t_inj and x["u"] >= fu:
            by_u.setdefault(x["u"], []).append(x)
    both = sorted(u for u, xs in by_u.items() if len({x["rank"] for x in xs}) == 4)
    together = {"u": both[0], "after_s": max(x["t"] for x in by_u[both[0]]) - t_inj} if both else None
    after = [v["after_s"] for v in per_rank.values()]
    handled = all(a is not None for a in after)
    incs = sorted({x["incarnation"] for x in recs})
    ev = _log_events(log)
    exits = [x for x in ev["exits"] if x["t"] >= t_inj - 1.0]  # log stamps are ms, a second's slack for clocks
    hbs = [x for x in ev["hb_timeouts"] if x["t"] >= t_inj - 1.0]
    out: dict[str, Any] = {
        "ok": True, "handled": handled, "t_inject": t_inj, "fault_u": fu, "per_rank": per_rank,
        "slowest_s": max(after) if handled else None,
        "recover_s": max(after) if handled else None,  # the same, under the recovery benchmark's name
        "slowest_rank": max(per_rank, key=lambda r: per_rank[r]["after_s"]) if handled else None,
        "all_four_together": together, "incarnations": len(incs), "restarts_done": len(ev["restarts"]),
    }
    # What noticed the fault: the first non-zero exit the launcher saw, and why that rank exited.
    first_exit = exits[0] if exits else None
    if first_exit:
        lr = first_exit["local_rank"]
        hb = next((x for x in hbs if x["local_rank"] == lr and x["t"] <= first_exit["t"] + 0.5), None)
        if hb:
            how = f"rank {lr}'s monitor: heartbeat timeout ({tmo['rank_heartbeat_timeout']:g} s), rank SIGKILLed"
        elif lr == rank and fault in ("kill", "bug"):
            how = f"rank {lr}'s own exit ({'SIGKILL' if fault == 'kill' else 'the uncaught ValueError'})"
        else:
            how = f"rank {lr} exited {first_exit['exitcode']}: {ev['rank_errors'].get(lr, 'no error printed')}"
        out["detected_by"] = how
        out["detect_s"] = first_exit["t"] - t_inj
    out["launcher_saw"] = [{"local_rank": x["local_rank"], "exitcode": x["exitcode"], "after_s": x["t"] - t_inj}
                           for x in exits[:8]]
    out["heartbeat_timeouts"] = [{"local_rank": x["local_rank"], "after_s": x["t"] - t_inj} for x in hbs]
    out["rank_errors"] = ev["rank_errors"]
    # A rank that outlived the launcher's SIGTERM (a stopped one keeps it pending) holds the restart back until
    # the launcher's SIGKILL, workers_stop_timeout later.
    pid_rank = {x["pid"]: (x["rank"], x["incarnation"]) for x in recs if x["ev"] == "started"}
    out["sigkilled_after_stop_timeout"] = [
        {"rank": pid_rank.get(x["pid"], (None,))[0], "pid": x["pid"], "after_s": x["t"] - t_inj,
         "workers_stop_timeout": tmo["workers_stop_timeout"]} for x in ev["escalations"] if x["t"] >= t_inj - 1.0]
    # The restarted incarnation's timeline, seconds after the injection (the latest of the four ranks).
    rs = []
    for i in incs[1:]:
        new = [x for x in recs if x["incarnation"] == i]

        def latest(e: str) -> float | None:
            ts = [next((x["t"] for x in new if x["ev"] == e and x["rank"] == r), None) for r in range(4)]
            return max(ts) - t_inj if None not in ts else None

        loaded = _first(new, "loaded", rank=0)
        c0 = [x for x in new if x["ev"] == "commit" and x["rank"] == 0]
        replay = [x for x in c0 if x["u"] < fu]
        first_c = _first(new, "commit", rank=0)
        rs.append({"incarnation": i,
                   # the launcher logs the failed rank and its decision to restart in the same millisecond
                   "detect_s": (ev["restarts"][i - 1]["t"] - t_inj) if len(ev["restarts"]) >= i else None,
                   # the interpreter start of the last of the four new processes (each records its own)
                   "spawn_s": (max(x["started"] for x in new if x["ev"] == "started") - t_inj)
                   if sum(1 for x in new if x["ev"] == "started") == 4 else None,
                   "imported_s": latest("imported"), "monitor_s": latest("monitor"), "pg_ready_s": latest("pg_ready"),
                   "ready_s": latest("ready"), "loaded_s": latest("loaded"), "training_s": latest("train"),
                   "resumed_from": loaded["u"] if loaded else 0, "load_s": loaded["load_s"] if loaded else None,
                   "replayed_updates": len(replay), "replay_s": sum(x["dt"] for x in replay),
                   "first_commit_u": first_c["u"] if first_c else None,
                   "first_commit_s": latest("commit")})
    out["restarts"] = rs
    # as recovery_torchft reports them: a restart that found no checkpoint began again at update 1
    out["started_over"] = sorted({x["rank"] for x in recs if x["ev"] == "commit" and x["incarnation"] > 0
                                  and x["u"] == 1})
    out["progress_lost"] = bool(out["started_over"])
    out["replayed_updates"] = rs[-1]["replayed_updates"] if rs else 0
    g = rank // 2  # the faulty rank's shard group (an emulated node); the other group had no fault
    others = [r for r in range(4) if r // 2 != g]
    out["other_group_resume_s"] = (max(per_rank[r]["after_s"] for r in others)
                                   if all(per_rank[r]["after_s"] is not None for r in others) else None)
    ck = [x for x in recs if x["ev"] == "checkpoint" and x["rank"] == 0]
    out["checkpoints"] = sorted({x["u"] for x in ck})
    out["save_s"] = sorted(x["save_s"] for x in ck)[len(ck) // 2] if ck else None
    normal = sorted(x["dt"] for x in recs if x["ev"] == "commit" and x["incarnation"] == 0 and x["u"] > 1)
    out["step_s"] = normal[len(normal) // 2] if normal else None
    if not handled:
        stuck = [r for r, v in per_rank.items() if v["after_s"] is None]
        why = []
        if stopped_left:
            why.append(f"rank {rank} was still stopped (SIGSTOP) at the end: alive, so no exit for the launcher "
                       f"to see, and no heartbeat timeout killed it")
        if not exits and not hbs:
            why.append("the launcher saw no rank exit and no rank monitor timed out")
        last_restart = ev["restarts"][-1]["t"] if ev["restarts"] else None
        gave_up = [x for x in exits if last_restart is None or x["t"] > last_restart]
        if len(ev["restarts"]) >= max_restarts and gave_up:
            x = gave_up[0]
            why.append(f"rank {x['local_rank']} exited {x['exitcode']} {x['t'] - t_inj:.1f} s "
                       f"after the injection with no restart left (--max-restarts {max_restarts}): the launcher "
                       f"gave up and the job failed")
        if timed_out and not why:
            why.append(f"ranks {stuck} had not committed update {fu} again when the trial's deadline passed")
        out["not_handled_because"] = "; ".join(why) or f"ranks {stuck} never committed again"
        out["stuck_ranks"] = stuck
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fault", choices=KINDS, required=True)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--step", type=int, default=U, help="the update the fault hits (the recovery benchmark's U)")
    ap.add_argument("--rank", type=int, default=1, help="global rank")
    ap.add_argument("--max-restarts", type=int, default=1, help="ft_launcher's --max-restarts")
    ap.add_argument("--ckpt-every", type=int, default=EVERY, help="checkpoint cadence in updates")
    ap.add_argument("--timeout-s", type=float, default=90.0, help="bound of one trial")
    ap.add_argument("--link-hold-s", type=float, default=0.0, help="link: seconds in the all-reduce (0: forever)")
    ap.add_argument("--workdir", default=None, help="keep the trials' records and logs here (default: a temp dir)")
    ap.add_argument("--exit-on-error", action="store_true", help="a rank whose loop raises exits at once")
    ap.add_argument("--shipped-timeouts", action="store_true", help="NVRx's (and torch's) shipped defaults")
    ap.add_argument("--timeout", action="append", default=[], metavar="NAME=VALUE",
                    help=f"override a timeout ({', '.join(TIMEOUTS)})")
    args = ap.parse_args(argv)
    over = dict(SHIPPED) if args.shipped_timeouts else {}
    over.update({k: float(v) for k, v in (s.split("=", 1) for s in args.timeout)})
    unknown = set(over) - set(TIMEOUTS)
    if unknown:
        ap.error(f"unknown timeouts {sorted(unknown)}")
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="recovery-nvrx-"))
    trials = []
    try:
        for i in range(args.trials):
            trials.append(run_trial(args.fault, step=args.step, rank=args.rank, workdir=base / f"{args.fault}-{i}",
                                    timeout_s=args.timeout_s, timeouts=over, ckpt_every=args.ckpt_every,
                                    max_restarts=args.max_restarts,
                                    link_hold_s=args.link_hold_s, exit_on_error=args.exit_on_error))
    finally:
        PROCS.kill_all()
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"fault": args.fault, "trials": trials}, indent=1))
    return 0 if all(t.get("ok") for t in trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
