#!/usr/bin/env python3
"""Time ``accelpact-status`` on a run directory with 10,000 events and 100 snapshots, against plain parsing.

Usage::

    .venv/bin/python benchmarks/parts/status.py [--events 10000] [--snapshots 100] [--repeat 31] [--cmd-repeat 15]
                                             [--json PATH] [--markdown FILE] [--keep DIR]
    .venv/bin/python benchmarks/parts/status.py --render runs/bench/<date>/status.json   (markdown only)

Two paired measurements on the same run directory, order alternated within each pair:

- in process: ``status.collect`` against the least any reader of the directory must do, ``json.loads`` of every
  line of ``events.jsonl`` plus ``json.load`` of every index file (``plain_parse``);
- as a command: ``accelpact-status DIR --no-slurm --json`` in a fresh interpreter against a fresh interpreter
  that does the same plain parse and prints a JSON document (what a user on a login node waits for,
  interpreter start included in both).

Figures are medians of the paired ratios (min–max); absolute times are printed beside them for this run only.
The command's own target is under 0.5 s (reported, never compared across runs).  Tests call
:func:`build_run_dir` but never assert a time: test machines are noisy.

Output: ``--json`` (default ``runs/bench/<date>/status.json``) and the block between
``<!-- status-bench -->`` markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts' summaries).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import common as bl  # noqa: E402

MARK = "<!-- status-bench -->"
TARGET_S = 0.5

# The baseline command: a fresh interpreter reading the same files plainly and printing a JSON document.
PLAIN_CMD = (
    "import json, os, sys\n"
    "d = sys.argv[1]\n"
    "with open(os.path.join(d, 'events.jsonl'), 'rb') as fh:\n"
    "    ev = [json.loads(ln) for ln in fh if ln.strip()]\n"
    "idx = os.path.join(d, 'ckpt-index')\n"
    "snaps = [s for f in sorted(os.listdir(idx)) for s in json.load(open(os.path.join(idx, f)))['snapshots']]\n"
    "print(json.dumps({'events': len(ev), 'snapshots': len(snaps)}))\n"
)


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


def plain_parse(run_dir: str) -> tuple[int, int]:
    """The baseline: ``json.loads`` of every event line and ``json.load`` of every index file, nothing else."""
    with open(os.path.join(run_dir, "events.jsonl"), "rb") as fh:
        events = [json.loads(ln) for ln in fh if ln.strip()]
    idx = os.path.join(run_dir, "ckpt-index")
    snaps = []
    for name in sorted(os.listdir(idx)):
        with open(os.path.join(idx, name), encoding="utf-8") as fh:
            snaps.extend(json.load(fh)["snapshots"])
    return len(events), len(snaps)


def _timed_cmd(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    return time.perf_counter() - start, proc


def measure(run_dir: str, repeat: int, cmd_repeat: int) -> dict[str, Any]:
    """Paired timings, order alternated per pair; one untimed warm-up of each first (page cache, imports)."""
    from accelpact_slurm.ops import status as st

    plain_parse(run_dir)
    info = st.collect(run_dir, now=time.time())
    collect_s, plain_s = [], []
    for i in range(repeat):
        pair: dict[str, float] = {}
        for which in bl.abba(i, "collect", "plain"):
            start = time.perf_counter()
            if which == "collect":
                info = st.collect(run_dir, now=time.time())
            else:
                plain_parse(run_dir)
            pair[which] = time.perf_counter() - start
        collect_s.append(pair["collect"])
        plain_s.append(pair["plain"])

    env = dict(os.environ, PYTHONPATH=REPO)
    status_argv = [sys.executable, "-m", "accelpact_slurm.cli.status", run_dir, "--no-slurm", "--json"]
    plain_argv = [sys.executable, "-c", PLAIN_CMD, run_dir]
    _timed_cmd(status_argv, env)
    _timed_cmd(plain_argv, env)
    cmd_s, cmd_plain_s = [], []
    for i in range(cmd_repeat):
        pair = {}
        for which in bl.abba(i, "status", "plain"):
            wall, proc = _timed_cmd(status_argv if which == "status" else plain_argv, env)
            pair[which] = wall
            if proc.returncode != 0:
                raise SystemExit(f"{which} command exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        cmd_s.append(pair["status"])
        cmd_plain_s.append(pair["plain"])
    return {
        "run_dir": {"events": info["events"],
                    "snapshots": sum(len(n["snapshots"]) for n in info["snapshots"]["nodes"]),
                    "repairs": info["l1"]["count"], "restarts": info["restarts"],
                    "bytes": sum(p.stat().st_size for p in Path(run_dir).rglob("*") if p.is_file())},
        "collect_s": collect_s, "plain_s": plain_s, "cmd_s": cmd_s, "cmd_plain_s": cmd_plain_s,
        "collect_ratio": [a / b for a, b in zip(collect_s, plain_s)],
        "cmd_ratio": [a / b for a, b in zip(cmd_s, cmd_plain_s)],
    }


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Add the spreads and the overview rows to a result (from its raw timings alone)."""
    m = res["measured"]
    res["summary"] = {k: bl.spread(m[k]) for k in ("collect_s", "plain_s", "cmd_s", "cmd_plain_s",
                                                  "collect_ratio", "cmd_ratio")}
    s = res["summary"]
    cmd_med = s["cmd_s"]["median"]
    res["target"] = {"limit_s": TARGET_S, "median_s": cmd_med,
                     "met": None if cmd_med is None else cmd_med < TARGET_S}
    rd = m["run_dir"]
    size = f"{rd['events']:,} events, {rd['snapshots']} snapshots"
    res["rows"] = [
        bl.row(f"`status.collect` in process ({size})",
               "`json.loads` of every event line + `json.load` of every index file, same process",
               s["collect_ratio"], note=f"{bl.fmt(_ms(s['collect_s']['median']), '{:.1f}')} ms vs "
                                        f"{bl.fmt(_ms(s['plain_s']['median']), '{:.1f}')} ms (absolute, for reference)"),
        bl.row(f"`accelpact-status DIR --no-slurm --json` as a command ({size})",
               "fresh interpreter doing the same plain parse and printing JSON",
               s["cmd_ratio"], note=f"{bl.fmt(_ms(cmd_med), '{:.0f}')} ms vs "
                                    f"{bl.fmt(_ms(s['cmd_plain_s']['median']), '{:.0f}')} ms (absolute, for reference); "
                                    f"target < {TARGET_S * 1000:.0f} ms"),
    ]
    return res


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def markdown(res: dict[str, Any]) -> str:
    s, rd, tgt = res["summary"], res["measured"]["run_dir"], res["target"]

    def ms(d: dict[str, Any]) -> str:
        return bl.fmt_spread({k: (v * 1000 if isinstance(v, float) else v) for k, v in d.items()}, "{:.1f}")

    met = "n/a" if tgt["met"] is None else ("met" if tgt["met"] else "**missed**")
    lines = [
        MARK,
        "## accelpact-status on a large run directory",
        "",
        (f"Written by `benchmarks/parts/status.py` on {res['date']} ({res['machine'].get('cpus')} CPU cores, load average "
         f"at start {', '.join(f'{x:.1f}' for x in res['machine'].get('loadavg_start') or [])}). The run directory "
         f"holds {rd['events']:,} events from 4 ranks ({rd['repairs']} L1 repairs, {rd['restarts']} restarts) and "
         f"{rd['snapshots']} snapshots in 2 node indexes, {rd['bytes'] / 2**20:.1f} MiB. Pairs alternate their order; "
         "one untimed warm-up of each first. Ratios are medians of the paired ratios (min–max); milliseconds are "
         "this run's only."),
        "",
        "| what | baseline | ratio (median, min–max) | n | ours, ms | baseline, ms |",
        "|---|---|---:|---:|---:|---:|",
        (f"| `status.collect` in process | `json.loads` of every line + the index files, same process | "
         f"{bl.fmt_spread(s['collect_ratio'])} | {s['collect_ratio']['n']} | {ms(s['collect_s'])} | "
         f"{ms(s['plain_s'])} |"),
        (f"| `accelpact-status DIR --no-slurm --json`, fresh interpreter | a fresh interpreter doing the same plain "
         f"parse | {bl.fmt_spread(s['cmd_ratio'])} | {s['cmd_ratio']['n']} | {ms(s['cmd_s'])} | "
         f"{ms(s['cmd_plain_s'])} |"),
        "",
        (f"The command's own target, under {tgt['limit_s'] * 1000:.0f} ms as a command: {met} in this run "
         f"(median {bl.fmt(_ms(tgt['median_s']), '{:.0f}')} ms; an absolute time on a shared machine, for reference)."),
        "",
        MARK,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=10_000)
    p.add_argument("--snapshots", type=int, default=100)
    p.add_argument("--repeat", type=int, default=31, help="in-process pairs (default 31)")
    p.add_argument("--cmd-repeat", type=int, default=15, help="command pairs, fresh interpreters (default 15)")
    p.add_argument("--keep", metavar="DIR", help="build the run directory here and keep it")
    bl.output_args(p, None, "result file (default runs/bench/<date>/status.json)")
    args = p.parse_args(argv)
    if args.render:
        res = summarize(bl.read_result(args.render))
    else:
        sys.path.insert(0, REPO)
        res = bl.new_result("status", params={"events": args.events, "snapshots": args.snapshots,
                                              "repeat": args.repeat, "cmd_repeat": args.cmd_repeat})
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="accelpact-bench-status-") as tmp:
            run_dir = build_run_dir(args.keep or os.path.join(tmp, "4242"), args.events, args.snapshots)
            res["measured"] = measure(run_dir, args.repeat, args.cmd_repeat)
        res["wall_s"] = time.monotonic() - t0
        bl.finish(res)
        summarize(res)
        out = bl.write_result(res, args.json or f"runs/bench/{res['date']}/status.json")
        print(f"[status] wrote {out} ({res['wall_s']:.1f} s)", flush=True)
    block = markdown(res)
    print(block)
    if args.markdown:
        print(f"[status] updated {bl.write_markdown(args.markdown, MARK, block)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
