#!/usr/bin/env python3
"""Time ``accelpact-status`` on a run directory with 10,000 events and 100 snapshots.

Usage::

    PYTHONPATH=. python scripts/bench_status.py [--events 10000] [--snapshots 100] [--repeat 5] [--keep DIR]

Reports the in-process time of one collection (median of ``--repeat``) and the
wall time of the command in a fresh interpreter (what a user on a login node
waits for, interpreter start included).  The target is under 0.5 s.  Tests call
:func:`build_run_dir` but never assert a time: test machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_run_dir(path: str, events: int = 10_000, snapshots: int = 100, nodes: int = 2, t0: float = 1.7e9) -> str:
    """Write a realistic run directory: steps from every rank, checkpoints, repairs, restarts, an index per node."""
    os.makedirs(os.path.join(path, "ckpt-index"), exist_ok=True)
    ranks = nodes * 2
    lines, t, step, restart, gen = [], t0, 0, 0, 0

    def ev(kind: str, rank: int = 0, **fields) -> None:
        rec = {"ts": round(t, 3), "event": kind, "job_id": "4242", "restart": restart, "rank": rank,
               "node": rank // 2}
        rec.update(fields)
        lines.append(json.dumps(rec, separators=(",", ":")))

    ev("job_start", config={"checkpoint": {"every_steps": 50}}, world_size=ranks, nodes=nodes,
       ranks_per_node=2, hostnames=[f"node{i + 1}" for i in range(nodes)])
    while len(lines) < events:
        step += 1
        t += 1.5
        for r in range(ranks):
            ev("step", rank=r, step=step, loss=3.0, tokens_per_s=1e4, step_s=1.5)
        if step % 50 == 0:
            ev("checkpoint", step=step, state="committed", size_bytes=10**9, path=f"/nvme/{step}", reason=None,
               blocking_s=0.4)
            ev("checkpoint", step=step, state="verified", size_bytes=10**9, path=f"/nvme/{step}", reason=None)
        if step % 97 == 0:
            gen += 1
            ev("fault", phase="committed", step=step, fault_rank=1, error="Connection closed by peer")
            for r in range(ranks):
                ev("repair", rank=r, generation=gen, frontier=step, ranks=[1, 3], rebound=10,
                   phases={"observe": 0.001, "agree": 0.004, "replace": 0.02, "rebind": 0.002, "validate": 0.006},
                   total_s=0.033, decision="preserve", key="cpu/2x2/committed/bitwise")
        if step % 701 == 0:
            ev("fail_stop", reason="fault in uncommitted compute", exit_code=75, phase="backward", frontier=step,
               decision_s=0.02)
            restart += 1
            t += 120
            ev("restart_load", step=step - step % 50, reason="newest verified", skipped=[])
    with open(os.path.join(path, "events.jsonl"), "w") as fh:
        fh.write("\n".join(lines[:events]) + "\n")
    per_node = max(1, snapshots // nodes)
    for n in range(nodes):
        snaps = [{"step": 50 * (i + 1), "state": "verified" if i % 7 else "rejected", "size_bytes": 10**9,
                  "created": t0 + 75 * (i + 1), "path": f"/nvme/{50 * (i + 1)}", "milestone": i % 10 == 0,
                  "reason": None if i % 7 else "checksum mismatch"} for i in range(per_node)]
        with open(os.path.join(path, "ckpt-index", f"node{n + 1}.json"), "w") as fh:
            json.dump({"node": f"node{n + 1}", "updated": t, "snapshots": snaps}, fh)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=10_000)
    p.add_argument("--snapshots", type=int, default=100)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--keep", metavar="DIR", help="build the run directory here and keep it")
    args = p.parse_args(argv)
    sys.path.insert(0, REPO)
    from accelpact_slurm import status as st

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = build_run_dir(args.keep or os.path.join(tmp, "4242"), args.events, args.snapshots)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            info = st.collect(run_dir, now=time.time())
            times.append(time.perf_counter() - start)
        env = dict(os.environ, PYTHONPATH=REPO)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "accelpact_slurm.cli.status", run_dir, "--no-slurm", "--json"],
                              capture_output=True, text=True, env=env, timeout=60)
        wall = time.perf_counter() - start
    print(f"run dir: {info['events']} events, {sum(len(n['snapshots']) for n in info['snapshots']['nodes'])} "
          f"snapshots, {info['l1']['count']} repairs, {info['restarts']} restarts")
    print(f"collect (in process): median {statistics.median(times) * 1000:.1f} ms over {args.repeat}")
    print(f"accelpact-status --json (fresh interpreter): {wall * 1000:.1f} ms, exit {proc.returncode}")
    verdict = "OK" if wall < 0.5 else "SLOW"
    print(f"{verdict}: target is under 500 ms")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
