#!/usr/bin/env python3
"""The paper's whole-run experiment on the dev cluster: L1 Preserve against L2 cold restart.

25 updates, a verified checkpoint at update 10, a replication fault after update 15
(rank 1 withholds its part of the boundary collective).  Run once with L1 allowed
(the shipped envelope) and once forced to L2 (an empty envelope: the fault fails
stop, rank 0 asks Slurm to requeue, the restarted job reloads checkpoint 10 and
replays updates 11-15).  Both runs go through ``sbatch_templates/hsdp.sbatch`` on
the real dev cluster (``scripts/dev-cluster.sh``), side by side in one script.

Reports, for each run: fault-to-frontier time (from the fault to the moment the
job is again past update 15) and whole-run time (submission to completion), and
the ratios L2/L1.  ``--markdown FILE`` writes the table into FILE (replacing the
block between ``<!-- paper-experiment -->`` markers, or appending it).

Usage: python scripts/paper_experiment.py [--repeats N] [--markdown docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from accelpact_slurm.events import read_events  # noqa: E402

DEADLINE_S = 600
MARK = "<!-- paper-experiment -->"


def cluster_env() -> dict[str, str]:
    state = os.environ.get("ACCELPACT_DEV_CLUSTER_DIR", "/tmp/accelpact-dev-cluster")
    subprocess.run(["bash", str(REPO / "scripts" / "dev-cluster.sh"), "start"], check=True, timeout=300,
                   stdout=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update({"SLURM_CONF": f"{state}/slurm.conf", "ACCELPACT_PYTHON": sys.executable,
                "PYTHONPATH": str(REPO)})
    return env


def job_file(work: Path) -> Path:
    text = (REPO / "examples" / "tiny.yaml").read_text()
    text = text.replace("collective_s: 5", "collective_s: 2")
    text = text.replace("faults: []", 'faults: ["boundary:15:1"]')
    path = work / "experiment.yaml"
    path.write_text(text)
    return path


def job_state(job_id: str, env: dict[str, str]) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    for item in out.split():
        if item.startswith("JobState="):
            return item.split("=", 1)[1]
    return "UNKNOWN"


def run_once(mode: str, config: Path, work: Path, env: dict[str, str]) -> dict:
    run_dir = work / f"{mode}-run"
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
    deadline = time.monotonic() + DEADLINE_S
    while True:
        state = job_state(job_id, job_env)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "UNKNOWN"):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{mode} job {job_id} did not finish in {DEADLINE_S} s (state {state})")
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="paired L1/L2 runs (default 1)")
    ap.add_argument("--markdown", metavar="FILE", help="write the result table into FILE")
    args = ap.parse_args()
    env = cluster_env()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="accelpact-paper-") as tmp:
        for i in range(args.repeats):
            work = Path(tmp) / f"pair-{i}"
            work.mkdir()
            config = job_file(work)
            l1 = run_once("L1", config, work, env)
            l2 = run_once("L2", config, work, env)
            if l1["digest"] != l2["digest"]:
                raise SystemExit("L1 and L2 runs ended in different states: the experiment is invalid")
            pairs.append((l1, l2))
            print(f"pair {i + 1}: L1 fault-to-frontier {l1['fault_to_frontier_s']:.2f} s, whole run "
                  f"{l1['whole_run_s']:.1f} s; L2 {l2['fault_to_frontier_s']:.2f} s, {l2['whole_run_s']:.1f} s "
                  f"({l2['restarts']} restart)", flush=True)
    ftf = [b["fault_to_frontier_s"] / a["fault_to_frontier_s"] for a, b in pairs]
    whole = [b["whole_run_s"] / a["whole_run_s"] for a, b in pairs]
    rows = [
        ("fault-to-frontier (fault -> update 16 runs)", [a["fault_to_frontier_s"] for a, _ in pairs],
         [b["fault_to_frontier_s"] for _, b in pairs], ftf),
        ("whole run (submit -> summary)", [a["whole_run_s"] for a, _ in pairs], [b["whole_run_s"] for _, b in pairs],
         whole),
    ]
    lines = [MARK, "", f"Paper's whole-run experiment on the dev cluster ({platform.node()}, {os.cpu_count()} cores, "
             f"2 emulated nodes x 2 ranks, CPU/Gloo, collective timeout 2 s; {len(pairs)} paired run(s); "
             f"{time.strftime('%Y-%m-%d')}). Baseline: L1 Preserve. L2 = the same fault forced to a cold restart "
             f"through the real requeue (Slurm waits `cred_expire`, 10 s here, 120 s by default, before a requeued job "
             f"may start).", "",
             "| what | L1 (s, median) | L2 (s, median) | L2/L1 median | L2/L1 range |", "|---|---:|---:|---:|---:|"]
    for name, a, b, r in rows:
        lines.append(f"| {name} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | "
                     f"{statistics.median(r):.2f}x | {min(r):.2f}-{max(r):.2f}x |")
    lines += ["", MARK]
    block = "\n".join(lines)
    print(block)
    if args.markdown:
        path = Path(args.markdown)
        text = path.read_text() if path.exists() else "# Benchmarks\n"
        if text.count(MARK) >= 2:
            head, _, rest = text.partition(MARK)
            _, _, tail = rest.partition(MARK)
            text = head + block + tail
        else:
            text = text.rstrip() + "\n\n## L1 against L2: the paper's whole-run experiment\n\n" + block + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
