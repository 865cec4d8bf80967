"""Node loss: a spare's heal against L2 on the same job and the same fault, side by side.

The decoder example on the embedded default (2 nodes x 2 ranks, a snapshot every 3 updates), each update paced to
``--pace`` seconds so that the runs' clocks are comparable; every rank of node 1 SIGKILLs itself at a fault point
(``ACCELPACT_TEST_KILL_NODE``: at update K's vote, as its forward begins, as its backward begins), or every rank of
node 0 at the vote (phase ``node0-vote``: rank 0's node, whose job store goes with it; its standby serves on).
Each trial runs the job twice, in ABBA order: with one spare node (the heal: no restart) and without (today's
path: fail stop, relaunch, reload the newest verified snapshot, replay).  Both use the same ``timeouts.heartbeat_s`` (a node lost
whole is named gone by the job's store, which sees its processes' connections close, or else by its silence).

Measured per run, from the product's own records: the moment of the loss (the dead ranks' log line, its
``time.time()``), the moment update K commits (rank 0's ``step`` event), the restarts, every part of the heal (the
``heal`` events: detect, membership, groups, adopt, transfer, packet, certificate), the bytes streamed and the
transfer's rate, and whether the job ended in the uninterrupted run's ``final_state_digest``.

Usage::

    .venv/bin/python -m benchmarks.parts.nodeloss [--trials 5] [--phases vote,forward,backward,node0-vote] \
        --json RAW.json
    .venv/bin/python -m benchmarks.parts.nodeloss --render RAW.json     (the section only)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import common as h  # noqa: E402
from benchmarks.harness import stats as st  # noqa: E402

MARK = "<!-- nodeloss-bench -->"
JOB = REPO / "examples" / "decoder" / "job.yaml"
KILLED_AT = re.compile(r"fault injection: node \d+ loses this rank \(SIGKILL\) in \w+ of \d+ at (\d+\.\d+)")
PARTS = ("detect", "membership", "groups", "adopt", "transfer", "packet", "certificate", "total")


def job_file(where: Path, spares: int, heartbeat_s: float) -> Path:
    text = JOB.read_text()
    text = re.sub(r"^entry: (\w+):(\w+)", lambda m: f"entry: {JOB.parent / m.group(1)}.py:{m.group(2)}", text,
                  count=1, flags=re.M)
    text = text.replace("  every_steps: 10 ", "  every_steps: 3 ")
    text = text.replace("  shutdown_s: 10\n", f"  shutdown_s: 10\n  heartbeat_s: {heartbeat_s:g}\n"
                                              f"  heartbeat_interval_s: {heartbeat_s / 4:g}\n")
    text = text.replace("  nodes: 2\n", f"  nodes: 2\n  spare_nodes: {spares}\n")
    path = where / f"job-{spares}.yaml"
    path.write_text(text)
    return path


def events_of(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def killed_at(run_dir: Path) -> float | None:
    times = []
    for log in (run_dir / "logs").glob("rank-*.log"):
        times += [float(m.group(1)) for m in KILLED_AT.finditer(log.read_text(errors="replace"))]
    return min(times) if times else None


def one_run(where: Path, name: str, job: Path, kill: str, steps: int, pace_s: float) -> dict[str, Any]:
    """One job with the fault ``kill`` (``PHASE:K:NODE``): what it took from the loss to update K committed."""
    run_dir = where / name
    env = h.bench_environ({"ACCELPACT_TEST_KILL_NODE": kill, "ACCELPACT_TEST_PACE": str(pace_s)})
    proc = subprocess.run([sys.executable, "-m", "accelpact_slurm.cli.run", str(job), "--run-dir", str(run_dir),
                           "--steps", str(steps)], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    step = int(kill.split(":")[1])
    rec: dict[str, Any] = {"name": name, "kill": kill, "rc": proc.returncode}
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        return {**rec, "error": (proc.stdout + proc.stderr)[-1500:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    events = events_of(run_dir)
    t0 = killed_at(run_dir)
    back = [e["ts"] for e in events if e.get("event") == "step" and e.get("step") == step and t0 and e["ts"] > t0]
    sources = [e for e in events if e.get("event") == "heal" and e.get("role") == "source"]
    heals = [min(sources, key=lambda e: e.get("rank", 0))] if sources else []  # the lowest survivor's
    heal = heals[0] if heals else None
    transfer = (heal or {}).get("transfer") or {}
    return {**rec, "digest": summary.get("final_state_digest"), "restarts": summary.get("restart_count"),
            "back_s": back[0] - t0 if back and t0 else None,
            "heal": None if heal is None else {
                "seconds": heal.get("seconds"), "certified": heal.get("certified"),
                "bytes": transfer.get("tensor_bytes"), "rate_mb_s": transfer.get("rate_mb_s"),
                "noticed_s": heal["ts"] - (heal.get("seconds") or {}).get("total", 0.0) - t0 if t0 else None}}


def measure(args: argparse.Namespace, where: Path) -> dict[str, Any]:
    heal_job, l2_job = job_file(where, 1, args.heartbeat), job_file(where, 0, args.heartbeat)
    ref = one_run(where, "reference", l2_job, "vote:999:1", args.steps, args.pace)  # never fires: uninterrupted
    runs = []
    for phase in args.phases:
        for t in range(args.trials):
            k = 4 + t % 3  # the update the node dies in (its vote, forward or backward)
            node, point = (0, phase[len("node0-"):]) if phase.startswith("node0-") else (1, phase)
            kill = f"{point}:{k}:{node}"
            for mode in st.abba(t, "heal", "l2"):
                job = heal_job if mode == "heal" else l2_job
                r = one_run(where, f"{phase}-{t}-{mode}", job, kill, args.steps, args.pace)
                r.update(phase=phase, trial=t, mode=mode, bitwise=r.get("digest") == ref.get("digest"))
                runs.append(r)
                print(f"nodeloss: {phase} trial {t} {mode}: back {st.fmt(r.get('back_s'))} s, restarts "
                      f"{r.get('restarts')}, bitwise {r['bitwise']}", flush=True)
    return {"reference": ref, "runs": runs}


def phases_of(res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for phase in res.get("phases") or []:
        rs = [r for r in res.get("runs") or [] if r.get("phase") == phase]
        heal = [r for r in rs if r.get("mode") == "heal"]
        l2 = [r for r in rs if r.get("mode") == "l2"]
        pairs = [(b["back_s"], a["back_s"]) for a in heal for b in l2
                 if a.get("trial") == b.get("trial") and a.get("back_s") and b.get("back_s")]
        parts = {p: st.spread([((r.get("heal") or {}).get("seconds") or {}).get(p) for r in heal]) for p in PARTS}
        out.append({"phase": phase, "heal_back": st.spread([r.get("back_s") for r in heal]),
                    "l2_back": st.spread([r.get("back_s") for r in l2]), "speedup": st.ratio_stats(pairs),
                    "heal_bitwise": sum(bool(r.get("bitwise")) for r in heal), "heal_runs": len(heal),
                    "heal_restarts": sorted({r.get("restarts") for r in heal}, key=str),
                    "l2_restarts": sorted({r.get("restarts") for r in l2}, key=str),
                    "noticed": st.spread([(r.get("heal") or {}).get("noticed_s") for r in heal]), "parts": parts,
                    "bytes": st.med([(r.get("heal") or {}).get("bytes") for r in heal]),
                    "rate": st.spread([(r.get("heal") or {}).get("rate_mb_s") for r in heal])})
    return out


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    return [st.row(f"node loss ({p['phase']}): L2's time back to training / the heal's", "L2 on the same job and "
                   f"fault (fail stop, relaunch, reload, replay)", p["speedup"],
                   note=f"heal {st.fmt_spread(p['heal_back'])} s, L2 {st.fmt_spread(p['l2_back'])} s; heal bitwise "
                        f"{p['heal_bitwise']}/{p['heal_runs']}, restarts {p['heal_restarts']} vs {p['l2_restarts']}")
            for p in phases_of(res)]


def markdown(res: dict[str, Any]) -> str:
    lines = [MARK, "## Node loss: a spare's heal against L2", "",
             f"Written by `benchmarks/parts/nodeloss.py` on {res.get('date')} (raw data: `{res.get('json')}`): the "
             f"decoder example, 2 nodes x 2 ranks, a snapshot every 3 updates, updates paced to {res.get('pace')} s, "
             f"`timeouts.heartbeat_s` {res.get('heartbeat')} s; node 1's ranks (phase node0-vote: node 0's, and "
             f"the job's store with them) SIGKILL themselves in update K (4-6); {res.get('trials')} trials per phase, each the heal (one spare node) and L2 (none) in ABBA "
             "order. Time back: from the loss to update K committed.", "",
             "| phase | heal: time back, median (min–max) | L2: time back | L2 / heal | heal bitwise | restarts "
             "(heal / L2) | loss noticed after | heal's parts (median s) | bytes streamed | rate MB/s |",
             "|---|---|---|---|---|---|---|---|---:|---|"]
    for p in phases_of(res):
        parts = ", ".join(f"{k} {st.fmt(v.get('median'), '{:.3f}')}" for k, v in p["parts"].items()
                          if v.get("median") is not None)
        lines.append(f"| {p['phase']} | {st.fmt_spread(p['heal_back'])} s | {st.fmt_spread(p['l2_back'])} s | "
                     f"{st.fmt_spread(p['speedup'])}x | {p['heal_bitwise']}/{p['heal_runs']} | "
                     f"{p['heal_restarts']} / {p['l2_restarts']} | {st.fmt_spread(p['noticed'])} s | {parts} | "
                     f"{st.fmt(p['bytes'], '{:.0f}')} | {st.fmt_spread(p['rate'], '{:.0f}')} |")
    return "\n".join([*lines, "", MARK])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.output_args(ap, None, "where the result goes (default runs/bench/<date>/nodeloss.json)")
    ap.add_argument("--trials", type=int, default=5, help="trials per phase, each a heal and an L2 run (default 5)")
    ap.add_argument("--phases", default="vote,forward,backward,node0-vote",
                    type=lambda s: [p for p in s.split(",") if p], help="fault points (default vote,forward,backward,node0-vote: node 0 at the vote)")
    ap.add_argument("--steps", type=int, default=8, help="updates per run (default 8)")
    ap.add_argument("--pace", type=float, default=0.2, help="seconds each update is paced to (default 0.2)")
    ap.add_argument("--heartbeat", type=float, default=2.0, help="timeouts.heartbeat_s of both (default 2)")
    args = ap.parse_args(argv)
    if args.render:
        print(markdown(h.read_result(args.render)))
        return 0
    bad = [p for p in args.phases if p not in ("vote", "forward", "backward", "node0-vote")]
    if bad or args.trials < 1:
        ap.error(f"--phases {','.join(args.phases)} / --trials {args.trials}: phases vote, forward, backward, "
                 f"node0-vote; at least one trial")
    raw = h.out_path(args.json or f"runs/bench/{h.today()}/nodeloss.json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nodeloss-") as tmp:
        got = measure(args, Path(tmp))
    res = h.new_result("nodeloss", trials=args.trials, phases=args.phases, steps=args.steps, pace=args.pace,
                       heartbeat=args.heartbeat, json=h.json_field(raw), **got)
    res["rows"] = summary_rows(res)
    h.write_result(h.finish(res), raw)
    if args.markdown:
        h.write_markdown(args.markdown, MARK, markdown(res))
    print(markdown(res), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
