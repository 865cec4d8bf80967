"""torchft's recovery on our HSDP job, one injected fault per trial: the peer measurement of the recovery benchmark.

Why: our recovery times are only comparable with torchft's when torchft drives the same job on the same ranks.
``run_trial`` starts torchft's lighthouse and four ranks of ``benchmarks/parts/peers_workers/torchft_hsdp_worker.py`` (2 replica
groups x 2 ranks, CPU/Gloo; FSDP2 within a group, torchft's managed all-reduce across groups; the decoder
example's model, optimizer, schedule and data) in torchft's own venv (``peers_venvs.ensure_venv``: the first of
``peers_runs.PEERS["torchft"]``'s candidates that works here), injects one fault on one rank at one update, and
does what torchft's users' launcher does (torchelastic's policy, one agent per replica group): when any process
of a replica group exits other than cleanly, the rest of that group is SIGKILLed and the whole group is started
again (``--restarted``: it joins the next quorum and heals from the survivors); a process that is alive but
stuck is not noticed (a launcher only sees exits).  Every wait is bounded by the trial's ``timeout_s``.

It returns, per rank, the first commit after the injection (``time.time()``) and the seconds to it, the slowest
rank's "injection -> next committed update", when all four ranks next committed one update together, the restart
timings, whether the fault was handled and, if not, why; with torchft's version and every timeout used
(torchft's shipped defaults unless one would make a trial exceed about a minute; ``TIMEOUT_NOTES`` says which
are lowered and why).

``KINDS`` are the faults (``link kill stop bug``); ``FAULTS`` maps the recovery benchmark's fault classes to them
(``bench/recovery_main.py`` calls ``run_trial(FAULTS[cls], ...)`` and reads ``recover_s`` and ``handled``).

CLI: ``python benchmarks/parts/recovery_torchft.py --fault link --trials 1`` prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
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
from benchmarks.parts.peers_runs import PROCS, REPO, WORKERS, clean_env, port_open, read_jsonl, tail, wait_for  # noqa: E402

KINDS = ("link", "kill", "stop", "bug")  # the faults run_trial injects (torchft_hsdp_worker.py's --fault)
#: The recovery benchmark's fault classes (``recovery_runs.CLASSES``) that have a torchft counterpart -> its kind.
#: ``link-boundary`` has none: torchft runs no collective between updates (its quorum and commit vote go over
#: gRPC to the ManagerServer and lighthouse), so the first collective a broken link fails is the backward's.
FAULTS = {"link-backward": "link", "kill": "kill", "stop": "stop", "bug": "bug"}
WORKER = WORKERS / "torchft_hsdp_worker.py"
#: torchft's shipped defaults (Manager, its ProcessGroupGloo, the lighthouse) and the replica group's own Gloo
#: group's (torch's default); the ones lowered for the trials are overridden in ``TIMEOUTS``.
SHIPPED = {"lighthouse_heartbeat_timeout_ms": 5000, "lighthouse_join_timeout_ms": 60000,
           "lighthouse_quorum_tick_ms": 100, "manager_heartbeat_interval_ms": 100, "manager_timeout_s": 60.0,
           "quorum_timeout_s": 60.0, "connect_timeout_s": 60.0, "pg_timeout_s": 60.0, "group_timeout_s": 1800.0}
TIMEOUTS = {**SHIPPED, "pg_timeout_s": 5.0, "group_timeout_s": 10.0, "quorum_timeout_s": 10.0}
TIMEOUT_NOTES = {
    "pg_timeout_s": "torchft's ProcessGroupGloo (the replicate dimension's all-reduce) ships with 60 s: a "
                    "stalled all-reduce would take 60 s to fail, a trial well over a minute; lowered to 5 s, "
                    "our job's collective_s (examples/decoder/job.yaml), so both detect a silent link alike",
    "group_timeout_s": "not torchft's: the replica group's own Gloo group (FSDP's all-gather/reduce-scatter), "
                       "torch's default 1800 s; a rank whose group peer is stopped (SIGSTOP) only fails, and so "
                       "only gets its group restarted, when this expires; lowered to 10 s, twice pg_timeout_s, "
                       "since a rank's FSDP collective may legitimately wait while its group peer sits in a "
                       "stalled replication all-reduce for pg_timeout_s",
    "quorum_timeout_s": "ships with 60 s; it decides the stop trials: a rank whose group peer is stopped fails in "
                        "FSDP's collective after group_timeout_s but its process only exits once its own quorum "
                        "request (waiting in its group's ManagerServer for the stopped peer) expires, because "
                        "interpreter exit joins the Manager's quorum thread; and while that group's ManagerServer "
                        "still heartbeats, the lighthouse gives the other group no quorum (with 2 groups, 1 "
                        "participant is not more than half of 2 healthy ones), so the survivors' own quorum "
                        "request expires at the same moment and they crash too; measured with 60 s: both groups "
                        "restarted 61 s after the stop, a 76 s trial, training back at update 1. Lowered to 10 s: "
                        "the same outcome 50 s sooner (and a stopped rank 0 is replaced 50 s sooner)",
}
POLL_S = 0.05  # the launcher's monitor interval (torchelastic polls its workers every 0.1 s by default)

_VENV: dict[str, Any] = {}


def torchft_venv(log=lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """torchft's venv (created on first use by ``peers_venvs.ensure_venv``): ``{"python", "version", "pin", ...}``."""
    if not _VENV:
        from benchmarks.parts.peers_venvs import ensure_venv

        r = ensure_venv("torchft", log)
        if r["status"] != "ok":
            raise RuntimeError(f"no torchft venv: {r['reason']}")
        _VENV.update(r, python=str(REPO / r["venv"] / "bin" / "python"))
    return _VENV


def _first(recs: list[dict[str, Any]], ev: str, **match: Any) -> dict[str, Any] | None:
    return next((x for x in recs if x["ev"] == ev and all(x.get(k) == v for k, v in match.items())), None)


def run_trial(fault: str, *, step: int, rank: int, workdir: Path, timeout_s: float, steps: int | None = None,
              timeouts: dict[str, float] | None = None, max_restarts: int = 1, exit_on_error: bool = False,
              config: str | None = None, overhead: tuple[int, int] | None = None) -> dict[str, Any]:
    """One trial: ``fault`` (link | kill | stop | bug) on global rank ``rank`` (= 2 * group + rank in group) at
    update ``step``; everything ends within ``timeout_s`` (plus a few seconds of teardown).

    ``steps``: the ranks stop after the first committed update at or past it that follows three updates all four
    committed together after the fault (default ``step + 4``).  ``timeouts``: overrides of ``TIMEOUTS``.
    ``max_restarts``: restarts of each replica group the launcher allows.  ``exit_on_error``: a rank whose
    training loop raises exits at once (``os._exit``) instead of through interpreter shutdown, which waits for
    the Manager's quorum thread (up to ``quorum_timeout_s``): not what a plain script does, so off by default.
    ``overhead``: ``(rounds, steps)`` with ``fault="none"``: the per-update cost instead, ABBA segments of managed
    and plain updates on the four ranks after the run (:func:`overhead_of`).
    Returns a dict (see the module's doc).
    """
    if overhead is not None and fault != "none":
        raise ValueError("overhead runs take fault='none'")
    if fault not in KINDS and overhead is None:
        raise ValueError(f"fault must be one of {KINDS}, not {fault!r}")
    if not 0 <= rank < 4 or step < 2:
        raise ValueError("rank must be 0..3 and step >= 2 (update 1 is the start)")
    venv = torchft_venv()
    py = venv["python"]
    tmo = {**TIMEOUTS, **(timeouts or {})}
    steps = steps or step + 4
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lh_port, start_port, *group_ports = h.free_ports(2 + 2 * (1 + max_restarts))
    port_iter = iter(group_ports)
    faulty_group = rank // 2
    res: dict[str, Any] = {
        "system": "torchft", "torchft": venv["version"], "torchft_pin": venv["pin"], "torch": venv["torch"],
        "fault": fault, "step": step, "rank": rank, "faulty_group": faulty_group, "steps": steps,
        "timeout_s": timeout_s, "timeouts": tmo, "exit_on_error": exit_on_error,
        "timeouts_lowered": {k: TIMEOUT_NOTES[k] if tmo[k] == TIMEOUTS[k] and k in TIMEOUT_NOTES else "set by the caller"
                             for k in tmo if tmo[k] != SHIPPED.get(k)},
        "launcher": f"restart a replica group when any of its processes exits non-zero (max {max_restarts} per "
                    f"group; a stopped or hung process is not an exit)",
        "form": "FSDP2 fully_shard per replica group (2 ranks) + torchft ManagedProcessGroup all-reduce in "
                "FSDP2's all_reduce_hook (replicate dimension); one Manager per rank",
    }
    lh_log = workdir / "lighthouse.log"
    t_begin = time.time()
    deadline = time.monotonic() + timeout_s
    lh = PROCS.spawn([str(Path(py).parent / "torchft_lighthouse"), "--min_replicas", "1",
                      "--bind", f"127.0.0.1:{lh_port}",
                      "--heartbeat_timeout_ms", str(int(tmo["lighthouse_heartbeat_timeout_ms"])),
                      "--join_timeout_ms", str(int(tmo["lighthouse_join_timeout_ms"])),
                      "--quorum_tick_ms", str(int(tmo["lighthouse_quorum_tick_ms"]))], lh_log, env=clean_env())
    procs: dict[int, subprocess.Popen] = {}  # global rank -> its current process
    inc = {0: 0, 1: 0}  # each group's incarnation
    files: dict[tuple[int, int], Path] = {}
    restarts: list[dict[str, Any]] = []
    failed_groups: dict[int, str] = {}

    def spawn_group(g: int) -> None:
        port = next(port_iter)
        for gr in (0, 1):
            r = 2 * g + gr
            files[(r, inc[g])] = out = workdir / f"rank{r}-inc{inc[g]}.jsonl"
            cmd = [py, str(WORKER), "--group", str(g), "--group-rank", str(gr), "--group-port", str(port),
                   "--start-port", str(start_port), "--lighthouse", f"http://127.0.0.1:{lh_port}", "--out", str(out),
                   "--steps", str(steps), "--fault", fault, "--fault-step", str(step), "--fault-rank", str(rank),
                   "--pg-timeout-s", str(tmo["pg_timeout_s"]), "--manager-timeout-s", str(tmo["manager_timeout_s"]),
                   "--quorum-timeout-s", str(tmo["quorum_timeout_s"]),
                   "--connect-timeout-s", str(tmo["connect_timeout_s"]),
                   "--group-timeout-s", str(tmo["group_timeout_s"]),
                   "--deadline-s", str(max(10.0, deadline - time.monotonic() + 5))]
            if config:
                cmd += ["--config", config]
            if overhead is not None:
                cmd += ["--overhead-rounds", str(overhead[0]), "--overhead-steps", str(overhead[1])]
            if inc[g]:
                cmd.append("--restarted")
            if exit_on_error:
                cmd.append("--exit-on-error")
            procs[r] = PROCS.spawn(cmd, workdir / f"rank{r}-inc{inc[g]}.log", env=clean_env(), cwd=WORKERS)

    timed_out = False
    try:
        wait_for(lambda: port_open(lh_port) or lh.poll() is not None, 20, "torchft lighthouse")
        if lh.poll() is not None:
            return {**res, "ok": False, "error": f"lighthouse exited: {tail(lh_log)}"}
        for g in (0, 1):
            spawn_group(g)
        while True:
            if all(p.poll() is not None for p in procs.values()) and all(
                    g in failed_groups or procs[2 * g].returncode == procs[2 * g + 1].returncode == 0 for g in (0, 1)):
                break  # every group done, or down with no restart left
            if time.monotonic() > deadline:
                timed_out = True
                break
            if lh.poll() is not None:
                res["lighthouse_exit"] = lh.returncode
                break
            for g in (0, 1):
                mine = [procs[2 * g], procs[2 * g + 1]]
                bad = [(2 * g + i, p.returncode) for i, p in enumerate(mine) if p.poll() not in (None, 0)]
                if not bad or g in failed_groups:
                    continue
                t_detect = time.time()
                if sum(1 for x in restarts if x["group"] == g) >= max_restarts:
                    failed_groups[g] = f"rank {bad[0][0]} exited {bad[0][1]}, no restart left"
                    continue
                for p in mine:  # the rest of the group goes too, as torchelastic stops all its workers
                    PROCS.kill(p)
                inc[g] += 1
                spawn_group(g)
                restarts.append({"group": g, "exited": bad, "t_detect": t_detect, "t_spawn": time.time(),
                                 "incarnation": inc[g]})
            time.sleep(POLL_S)
    except TimeoutError as exc:
        return {**res, "ok": False, "error": str(exc)}
    finally:
        alive = {r: p.poll() is None for r, p in procs.items()}
        stopped = {}
        for r, p in procs.items():
            try:
                stat = Path(f"/proc/{p.pid}/stat").read_text()
                stopped[r] = alive[r] and stat.rsplit(")", 1)[1].split()[0] == "T"  # SIGSTOPped: state T
            except OSError:
                stopped[r] = False
            PROCS.kill(p)
        PROCS.kill(lh)  # it ignores SIGTERM
    res["wall_s"] = time.time() - t_begin
    res["timed_out"] = timed_out
    if overhead is not None:
        return {**res, **overhead_of(files, timed_out, workdir)}
    return {**res, **_analyse(fault, step, rank, files, restarts, failed_groups, timed_out, alive, stopped, tmo,
                              workdir)}


def _analyse(fault: str, step: int, rank: int, files: dict[tuple[int, int], Path], restarts: list[dict[str, Any]],
             failed_groups: dict[int, str], timed_out: bool, alive: dict[int, bool], stopped: dict[int, bool],
             tmo: dict[str, float], workdir: Path) -> dict[str, Any]:
    recs = {key: read_jsonl(f) for key, f in files.items()}
    every = [x for rs in recs.values() for x in rs]
    fault_rec = _first(every, "fault")
    if fault_rec is None:
        first_commits = sorted(x["u"] for x in every if x["ev"] == "commit")
        return {"ok": False, "handled": False,
                "error": f"the fault was never injected (last update committed: "
                         f"{first_commits[-1] if first_commits else None}): "
                         f"{tail(workdir / f'rank{rank}-inc0.log', 4)}"}
    t_inj = fault_rec["t"]
    # a restarted rank that commits an update before the fault's started over: it found no group to heal from,
    # and none of its commits is a recovery
    over_keys = {key for key, rs in recs.items() if key[1] > 0
                 and any(x["ev"] == "commit" and x["t"] > t_inj and x["u"] < fault_rec["u"] for x in rs)}
    over = sorted({r for r, _ in over_keys})
    per_rank: dict[int, dict[str, Any]] = {}
    for r in range(4):
        mine = sorted((x for (rr, i), rs in recs.items() if rr == r and (rr, i) not in over_keys for x in rs),
                      key=lambda x: x["t"])
        # the update the fault hit, or a later one: a peer's commit of update N-1 can land just after a kill at
        # the start of N, and is no recovery
        c = next((x for x in mine if x["ev"] == "commit" and x["t"] > t_inj and x["u"] >= fault_rec["u"]), None)
        aborts = [x for x in mine if x["ev"] == "abort" and x["t"] > t_inj]
        per_rank[r] = {"first_commit_t": c["t"] if c else None, "after_s": (c["t"] - t_inj) if c else None,
                       "u": c["u"] if c else None, "incarnation": c["incarnation"] if c else None,
                       "participants": c["participants"] if c else None, "aborts_after": len(aborts),
                       "abort_errors": sorted({x["error"] for x in aborts if x.get("error")})[:2],
                       "last_u": max((x["u"] for x in mine if x["ev"] == "commit"), default=0),
                       "done": any(x["ev"] == "done" for x in mine)}
    # the first update after the fault that all four ranks committed with both groups taking part
    by_u: dict[int, list[dict[str, Any]]] = {}
    for x in (y for key, rs in recs.items() if key not in over_keys for y in rs):
        if x["ev"] == "commit" and x["t"] > t_inj and x["participants"] == 2:
            by_u.setdefault(x["u"], []).append(x)
    both = sorted(u for u, xs in by_u.items() if len({x["rank"] for x in xs}) == 4)
    together = {"u": both[0], "after_s": max(x["t"] for x in by_u[both[0]]) - t_inj} if both else None
    after = [v["after_s"] for v in per_rank.values()]
    handled = all(a is not None for a in after) and not over
    g = rank // 2
    others = [r for r in range(4) if r // 2 != g]
    out: dict[str, Any] = {
        "ok": True, "handled": handled, "t_inject": t_inj, "fault_u": fault_rec["u"], "per_rank": per_rank,
        "slowest_s": max(after) if handled else None,
        "recover_s": max(after) if handled else None,  # the same, under the recovery benchmark's name
        "slowest_rank": max(per_rank, key=lambda r: per_rank[r]["after_s"]) if handled else None,
        "other_group_resume_s": (max(per_rank[r]["after_s"] for r in others)
                                 if all(per_rank[r]["after_s"] is not None for r in others) else None),
        "all_four_together": together,
        "aborted_updates": sorted({x["u"] for x in every if x["ev"] == "abort" and x["t"] > t_inj}),
        "started_over": over, "progress_lost": bool(over),
    }
    rs = []
    for x in restarts:  # each restarted group: when its two new processes got where (seconds after the fault)
        new = [rr for key, rr in recs.items() if key[1] == x["incarnation"] and key[0] // 2 == x["group"]]

        def latest(ev: str) -> float | None:
            ts = [next((y["t"] for y in rr if y["ev"] == ev), None) for rr in new]
            return max(ts) - t_inj if len(ts) == 2 and None not in ts else None

        first = [next((y for y in rr if y["ev"] == "commit"), None) for rr in new]
        rs.append({"group": x["group"], "exited": x["exited"], "error": _last_error(
                       workdir / f"rank{x['exited'][0][0]}-inc{x['incarnation'] - 1}.log"),
                   "detect_s": x["t_detect"] - t_inj,
                   "spawn_s": x["t_spawn"] - t_inj, "imported_s": latest("imported"), "ready_s": latest("ready"),
                   "first_commit_s": latest("commit"),
                   "first_commit_u": first[0]["u"] if first and first[0] else None})
    out["restarts"] = rs
    out.update(detection(every, fault_rec["u"], t_inj, out["recover_s"]))
    if not handled:
        stuck = [r for r, v in per_rank.items() if v["after_s"] is None]
        why = []
        if over:
            why.append(f"replica groups {sorted({x['group'] for x in restarts})} were restarted (exits: "
                       f"{[x['exited'] for x in restarts]}), so no replica group kept the job's progress: ranks "
                       f"{over} began again at update 1 and any other restarted rank healed from them (torchft "
                       f"keeps no checkpoint of its own)")
        for x in rs:
            if x["group"] != rank // 2:
                why.append(f"group {x['group']}, which had no fault, failed too {x['detect_s']:.1f} s after it "
                           f"({x['error'] or 'no error printed'})")
        if any(stopped.get(r) for r in stuck):
            why.append(f"rank {rank} is stopped (SIGSTOP): alive, so the launcher never restarts its group")
        if fault == "stop" and not restarts:
            why.append(f"its group peer did not fail within the trial (its FSDP collective waits "
                       f"{tmo['group_timeout_s']:g} s); the job hangs until the deadline")
        if failed_groups:
            why += [f"group {k}: {v}" for k, v in failed_groups.items()]
        if not restarts and fault in ("kill", "bug") and not failed_groups:
            why.append("the process died and nothing restarted it")
        if timed_out and not why:
            why.append(f"ranks {stuck} had not committed when the trial's deadline passed "
                       f"(alive: {[r for r in stuck if alive.get(r)]}); torchft waits for its timeouts")
        out["not_handled_because"] = "; ".join(why) or f"ranks {stuck} never committed again"
        out["stuck_ranks"] = stuck
    return out


def detection(every: list[dict[str, Any]], u: int, t_inj: float, recover_s: float | None) -> dict[str, Any]:
    """Detection -> the next commit, as ``recovery_runs.detection`` measures ours: each rank's ``detect`` record of
    update ``u`` (its replication all-reduce failed), the first of them (the job's detection) and, per rank, when it
    knew the update was lost (its detection, or its ``abort`` at ``should_commit`` for a rank whose own collectives
    all completed; the last of these: every rank knows), and the slowest rank's next commit from each."""
    seen: dict[int, float] = {}
    known: dict[int, float] = {}
    for x in sorted(every, key=lambda y: y["t"]):
        if x.get("u") != u or x["t"] < t_inj:
            continue
        if x["ev"] == "detect":
            seen.setdefault(x["rank"], x["t"])
        if x["ev"] in ("detect", "abort"):
            known.setdefault(x["rank"], x["t"])
    if not seen or recover_s is None:
        return {"detect_per_rank_s": {r: t - t_inj for r, t in sorted(seen.items())},
                "detect_first_s": min(seen.values()) - t_inj if seen else None,
                "detect_to_commit_s": None, "known_to_commit_s": None}
    commit = t_inj + recover_s
    return {"detect_per_rank_s": {r: t - t_inj for r, t in sorted(seen.items())},
            "detect_first_s": min(seen.values()) - t_inj, "detect_to_commit_s": commit - min(seen.values()),
            "known_to_commit_s": commit - max(known.values()) if len(known) == 4 else None}


def overhead_of(files: dict[tuple[int, int], Path], timed_out: bool, workdir: Path) -> dict[str, Any]:
    """Per round and mode, every rank's segment time and the slowest rank's (a segment ends at a barrier of all
    four, so they differ by the barrier's skew only); ``ratios``: managed / plain per round, slowest rank's each;
    ``added_ms``: (managed - plain) per update, per round."""
    segs: dict[tuple[int, str], dict[int, dict[str, Any]]] = {}
    for (r, _inc), f in files.items():
        for x in read_jsonl(f):
            if x["ev"] == "segment":
                segs.setdefault((x["round"], x["mode"]), {})[r] = x
    rounds = sorted({rd for rd, _m in segs})
    out: dict[str, Any] = {"per_rank_seg_s": {}, "ratios": [], "test_step_s": [], "base_step_s": [], "added_ms": []}
    for rd in rounds:
        m, pl = segs.get((rd, "managed"), {}), segs.get((rd, "plain"), {})
        if len(m) != 4 or len(pl) != 4:
            continue
        out["per_rank_seg_s"][str(rd)] = {"managed": {str(k): v["seg_s"] for k, v in sorted(m.items())},
                                          "plain": {str(k): v["seg_s"] for k, v in sorted(pl.items())}}
        tm, tp = max(v["seg_s"] for v in m.values()), max(v["seg_s"] for v in pl.values())
        n = len(next(iter(m.values()))["dts"])
        out["ratios"].append(tm / tp)
        out["test_step_s"].append(tm / n)
        out["base_step_s"].append(tp / n)
        out["added_ms"].append((tm - tp) / n * 1000)
    ok = bool(out["ratios"])
    return {"ok": ok, "handled": None, **out,
            **({} if ok else {"error": f"no complete segments (timed out: {timed_out}): "
                                       f"{tail(workdir / 'rank0-inc0.log', 4)}"})}


def _last_error(log: Path) -> str | None:
    """The last line of a rank's log that names an exception (what it died of)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    hits = [ln.split("]: ", 1)[-1] for ln in lines if "Error" in ln and ":" in ln and "File " not in ln]
    return hits[-1][:240] if hits else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fault", choices=KINDS, required=True)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--step", type=int, default=5, help="the update the fault hits")
    ap.add_argument("--rank", type=int, default=1, help="global rank (2 * group + rank in group)")
    ap.add_argument("--timeout-s", type=float, default=80.0, help="bound of one trial")
    ap.add_argument("--workdir", default=None, help="keep the trials' records and logs here (default: a temp dir)")
    ap.add_argument("--exit-on-error", action="store_true", help="a rank whose loop raises exits at once")
    ap.add_argument("--shipped-timeouts", action="store_true", help="torchft's shipped defaults, none lowered")
    ap.add_argument("--timeout", action="append", default=[], metavar="NAME=VALUE",
                    help=f"override a timeout ({', '.join(TIMEOUTS)})")
    args = ap.parse_args(argv)
    over = dict(SHIPPED) if args.shipped_timeouts else {}
    over.update({k: float(v) for k, v in (s.split("=", 1) for s in args.timeout)})
    unknown = set(over) - set(TIMEOUTS)
    if unknown:
        ap.error(f"unknown timeouts {sorted(unknown)}")
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="recovery-torchft-"))
    trials = []
    try:
        for i in range(args.trials):
            trials.append(run_trial(args.fault, step=args.step, rank=args.rank, workdir=base / f"{args.fault}-{i}",
                                    timeout_s=args.timeout_s, timeouts=over,
                                    exit_on_error=args.exit_on_error))
    finally:
        PROCS.kill_all()
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"fault": args.fault, "trials": trials}, indent=1))
    return 0 if all(t.get("ok") for t in trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
