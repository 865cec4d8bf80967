#!/usr/bin/env python3
"""The paper's whole-run experiment on the dev cluster: L1 Preserve against L2 cold restart.

25 updates, a verified checkpoint at update 10, a replication fault after update 15
(rank 1 withholds its part of the boundary collective).  Each pair runs the same job
once with L1 allowed (the shipped envelope; the baseline) and once forced to L2 (an
empty envelope: the fault fails stop, rank 0 asks Slurm to requeue, the restarted job
reloads checkpoint 10 and replays updates 11-15); the order alternates from pair to
pair.  Both runs go through ``sbatch_templates/hsdp.sbatch`` on the real dev cluster
(``scripts/dev-cluster.sh``), each submitted once both nodes are idle.  A cluster that
is not running is started and, unless ``--keep-cluster``, stopped again at the end; a
running one is reused and left running.

Reports, for each run: fault-to-frontier time (from the fault to the moment the job
is again past update 15) and whole-run time (submission to completion); the figures
are the medians of the paired ratios L2/L1 (min–max).  Pairs stop early when the next
one would not fit ``--budget-s`` (or the deadline ``make bench`` passes in
``ACCELPACT_BENCH_DEADLINE_S``).

Output: ``--json`` (default ``runs/bench/<date>/paper.json``) and the block
between ``<!-- paper-experiment -->`` markers of ``--markdown`` (default
``''``: none; ``make bench`` renders the docs from the parts' summaries).

Usage: .venv/bin/python benchmarks/parts/paper.py [--repeats 5] [--budget-s 270] [--json PATH] [--markdown FILE]
       .venv/bin/python benchmarks/parts/paper.py --render runs/bench/<date>/paper.json   (markdown only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.harness import common as bl  # noqa: E402

from accelpact_slurm.core.events import read_events  # noqa: E402

JOB_DEADLINE_S = 180
MARK = "<!-- paper-experiment -->"
DEV_CLUSTER = REPO / "scripts" / "dev-cluster.sh"
COLLECTIVE_S = 2
FAULT = "boundary:15:1"


def state_dir() -> Path:
    return Path(os.environ.get("ACCELPACT_DEV_CLUSTER_DIR") or "/tmp/accelpact-dev-cluster")


def dev_cluster(cmd: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(DEV_CLUSTER), cmd, "--state-dir", str(state_dir())], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, check=False)


def cluster_up() -> bool:
    return dev_cluster("status", timeout=60).returncode == 0


def client_env() -> dict[str, str]:
    """The environment for the cluster's clients and jobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update({"SLURM_CONF": str(state_dir() / "slurm.conf"), "ACCELPACT_PYTHON": sys.executable,
                "PYTHONPATH": str(REPO)})
    return env


def ensure_cluster() -> None:
    """``dev-cluster.sh start`` (a no-op on a running cluster), tried twice."""
    for attempt in (1, 2):
        proc = dev_cluster("start")
        if proc.returncode == 0:
            break
        out = (proc.stdout + proc.stderr)[-3000:]
        if attempt == 2:
            raise SystemExit(f"dev-cluster.sh start exited {proc.returncode} twice:\n{out}")
        print(f"[paper] dev-cluster.sh start exited {proc.returncode}; trying once more in 5 s:\n{out}", flush=True)
        time.sleep(5)


def cred_expire_s() -> int | None:
    try:
        m = re.search(r"cred_expire=(\d+)", (state_dir() / "slurm.conf").read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else 120


def job_file(work: Path) -> Path:
    """The decoder example's job file (its entry made absolute: the job runs from ``work``) with the
    experiment's collective timeout and fault."""
    from benchmarks.parts.workload import write_job

    return write_job(work / "experiment.yaml", {"timeouts.collective_s": COLLECTIVE_S, "faults": [FAULT]})


def job_state(job_id: str, env: dict[str, str]) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True, check=False,
                         timeout=30).stdout
    for item in out.split():
        if item.startswith("JobState="):
            return item.split("=", 1)[1]
    return "UNKNOWN"


def wait_idle(env: dict[str, str], timeout_s: float = 30) -> None:
    """Until both nodes are idle (the previous job's clean-up done), so that no run starts behind another's."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True,
                             timeout=30, check=False).stdout.split()
        states = out[1::2]
        if states and all(st == "idle" for st in states):
            return
        time.sleep(0.2)


def run_once(mode: str, config: Path, work: Path, env: dict[str, str], jobs: list[str]) -> dict[str, Any]:
    """One run of the job; its id is appended to ``jobs`` (every job this experiment submitted)."""
    run_dir = work / f"{mode}-run"
    wait_idle(env)
    job_env = dict(env)
    if mode == "L2":
        empty = work / "empty-envelope.yaml"
        empty.write_text("entries: []\n")
        job_env["ACCELPACT_ENVELOPE"] = str(empty)
    t0 = time.time()
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", str(REPO / "sbatch_templates" / "hsdp.sbatch"),
         str(config), str(run_dir)], env=job_env, cwd=work, capture_output=True, text=True, check=True,
        timeout=60).stdout.strip().split(";")[0]
    jobs.append(job_id)
    deadline = time.monotonic() + JOB_DEADLINE_S
    while True:
        state = job_state(job_id, job_env)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "UNKNOWN"):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{mode} job {job_id} did not finish in {JOB_DEADLINE_S} s (state {state})")
        time.sleep(0.5)
    summary_path = run_dir / "summary.json"
    if state != "COMPLETED" or not summary_path.exists():
        raise SystemExit(f"{mode} job {job_id} ended {state}; see {work}")
    summary = json.loads(summary_path.read_text())
    end = summary_path.stat().st_mtime
    events = list(read_events(run_dir / "events.jsonl"))
    fault = min(e["ts"] for e in events if e["event"] == "fault")
    back = [e["ts"] for e in events if e["event"] == "step" and e["step"] == 16 and e["ts"] > fault]
    return {"mode": mode, "job_id": job_id, "whole_run_s": end - t0, "fault_to_frontier_s": back[0] - fault,
            "restarts": max(e["restart"] for e in events), "digest": summary["final_state_digest"]}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Spreads and overview rows from the raw pairs alone."""
    pairs = res["pairs"]
    s: dict[str, Any] = {}
    for key in ("fault_to_frontier_s", "whole_run_s"):
        s[key] = {"L1": bl.spread([p["L1"][key] for p in pairs]), "L2": bl.spread([p["L2"][key] for p in pairs]),
                  "ratio": bl.spread([p["L2"][key] / p["L1"][key] for p in pairs])}
    res["summary"] = s
    base = "L1 Preserve: the same job and fault, repaired in place"
    cred = res.get("cred_expire_s")

    def note(key: str) -> str:
        return (f"L1 {bl.fmt(s[key]['L1']['median'])} s, L2 {bl.fmt(s[key]['L2']['median'])} s (absolute, for reference); "
                f"cred_expire {cred} s")

    res["rows"] = [
        bl.row("fault-to-frontier: fault after update 15 to update 16 running again, L2 cold restart "
               "(requeue, reload checkpoint 10, replay 11-15)", base, s["fault_to_frontier_s"]["ratio"],
               note=note("fault_to_frontier_s")),
        bl.row("whole run (25 updates, submission to summary), L2 cold restart", base, s["whole_run_s"]["ratio"],
               note=note("whole_run_s")),
    ]
    return res


def markdown(res: dict[str, Any]) -> str:
    s, m = res["summary"], res["machine"]
    load = ", ".join(f"{x:.1f}" for x in m.get("loadavg_start") or [])
    cred = res.get("cred_expire_s")
    lines = [
        MARK,
        "## L1 against L2: the paper's whole-run experiment",
        "",
        (f"Written by `benchmarks/parts/paper.py` on {res['date']} ({res.get('host', 'host')}, {m.get('cpus')} CPU "
         f"cores, load average at start {load}). On the dev cluster (`scripts/dev-cluster.sh`: real Slurm, 2 emulated "
         f"nodes x 2 ranks, CPU/Gloo), the embedded default job (25 updates, checkpoint every 10, collective timeout "
         f"{res.get('collective_s', COLLECTIVE_S)} s) with the fault `{res.get('fault', FAULT)}` (rank 1 withholds its "
         "part of the boundary collective after update 15), submitted through `sbatch_templates/hsdp.sbatch`. "
         "Baseline: L1 Preserve (the shipped envelope). Compared: the same fault forced to L2 (an empty envelope): "
         "fail-stop, Slurm requeue, reload of checkpoint 10, replay of 11-15. Slurm holds a requeued job for "
         f"`cred_expire` ({cred} s here, 120 s by default) before it may start. "
         f"{len(res['pairs'])} paired run(s), order alternated"
         f"{', each submitted once both nodes were idle' if res.get('submit_when_idle') else ''}; every pair ended "
         "in the same final state digest."),
        "",
        "| what | baseline | L2/L1 (median, min–max) | n | L1, s | L2, s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, name in (("fault_to_frontier_s", "fault-to-frontier (fault → update 16 runs)"),
                      ("whole_run_s", "whole run (submission → summary)")):
        d = s[key]
        lines.append(f"| {name} | L1 Preserve | {bl.fmt_spread(d['ratio'])} | {d['ratio']['n']} | "
                     f"{bl.fmt_spread(d['L1'])} | {bl.fmt_spread(d['L2'])} |")
    lines += ["", (f"Seconds are this run's only (medians, min–max); with {cred} s `cred_expire` and tiny updates the "
                   "restart's fixed costs dominate, so the ratios are not the paper's.")]
    if res.get("stopped_early"):
        lines += ["", f"Stopped after {len(res['pairs'])} of {res['repeats']} pairs: {res['stopped_early']}."]
    lines += ["", MARK]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="paired L1/L2 runs (default 5)")
    ap.add_argument("--budget-s", type=float, default=270,
                    help="start no pair that would end past this many seconds from the start (default 270)")
    ap.add_argument("--keep-cluster", action="store_true", help="leave a cluster this run started running")
    bl.output_args(ap, None, "result file (default runs/bench/<date>/paper.json)")
    args = ap.parse_args(argv)
    if args.render:
        res = summarize(bl.read_result(args.render))
    else:
        res = experiment(args)
    block = markdown(res)
    print(block)
    if args.markdown:
        print(f"[paper] updated {bl.write_markdown(args.markdown, MARK, block)}", flush=True)
    return 0


def experiment(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    bl.stop_on_signals("paper", (signal.SIGTERM,))
    # leave time to stop the cluster within make bench's deadline
    budget = bl.outer_deadline(args.budget_s, margin_s=45.0)
    res: dict[str, Any] = bl.new_result("paper", host=platform.node(), repeats=args.repeats, budget_s=budget,
                                        collective_s=COLLECTIVE_S, fault=FAULT, submit_when_idle=True, pairs=[])
    jobs: list[str] = []
    env = client_env()
    started = not cluster_up()
    if started:
        print("[paper] dev cluster not running: starting it (stopped again at the end)", flush=True)
    try:
        ensure_cluster()
        res["cred_expire_s"] = cred_expire_s()
        res["cluster_ready_s"] = time.monotonic() - t_start
        with tempfile.TemporaryDirectory(prefix="accelpact-paper-") as tmp:
            for i in range(args.repeats):
                t_pair = time.monotonic()
                work = Path(tmp) / f"pair-{i}"
                work.mkdir()
                config = job_file(work)
                order = bl.abba(i, "L1", "L2")
                runs = {mode: run_once(mode, config, work, env, jobs) for mode in order}
                l1, l2 = runs["L1"], runs["L2"]
                if l1["digest"] != l2["digest"]:
                    raise SystemExit("L1 and L2 runs ended in different states: the experiment is invalid")
                res["pairs"].append({"order": list(order), "L1": l1, "L2": l2, "wall_s": time.monotonic() - t_pair})
                print(f"[paper] pair {i + 1} ({' then '.join(order)}): L1 fault-to-frontier "
                      f"{l1['fault_to_frontier_s']:.2f} s, whole run {l1['whole_run_s']:.1f} s; L2 "
                      f"{l2['fault_to_frontier_s']:.2f} s, {l2['whole_run_s']:.1f} s ({l2['restarts']} restart); "
                      f"{time.monotonic() - t_start:.0f} s elapsed", flush=True)
                longest = max(p["wall_s"] for p in res["pairs"])
                if i + 1 < args.repeats and time.monotonic() - t_start + 1.2 * longest > budget:
                    res["stopped_early"] = (f"the next pair (up to {1.2 * longest:.0f} s) would have passed the "
                                            f"{budget:.0f} s budget")
                    print(f"[paper] {res['stopped_early']}: stopping", flush=True)
                    break
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            queued = subprocess.run(["squeue", "-h", "-o", "%A"], env=env, capture_output=True, text=True,
                                    timeout=30, check=False).stdout.split()
        except (OSError, subprocess.SubprocessError):
            queued = []
        ours = [j for j in queued if j in jobs]
        if ours:
            subprocess.run(["scancel", *ours], env=env, check=False, timeout=30)
        if started and not args.keep_cluster:
            others = [j for j in queued if j not in jobs]
            if others:  # someone else has started using it meanwhile: leave it to them
                print(f"[paper] left the dev cluster running: other jobs are queued ({' '.join(others)})", flush=True)
            else:
                proc = dev_cluster("stop", timeout=120)
                print(f"[paper] stopped the dev cluster this run started (exit {proc.returncode})", flush=True)
    res["wall_s"] = time.monotonic() - t_start
    bl.finish(res)
    summarize(res)
    out = bl.write_result(res, args.json or f"runs/bench/{res['date']}/paper.json")
    print(f"[paper] wrote {out} ({res['wall_s']:.0f} s)", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
