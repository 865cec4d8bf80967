"""Peers benchmark, the command line and the repeats (``benchmarks/parts/peers.py`` is the entry point).

``peers_venvs`` installs the peers, ``peers_runs`` runs each system once (``peers_entry``: our ranks'
overhead loop, the entry point of its job), ``peers_report`` turns the repeats into the result and its
markdown block.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.peers_report import MARK, PART, analyse, markdown
from benchmarks.parts.peers_runs import FAULT, FAULT_STEP, PEERS, REPO, STEPS

__all__ = ["build_parser", "main", "markdown"]

DEFAULT_BUDGET_S = 400  # bench_all.py gives the part 480 s; a first run also makes the venvs (about 2 min)


def build_parser(doc: str = "") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_peers.py", description=doc or __doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    h.output_args(ap, f"runs/bench/{h.today()}/peers.json")
    ap.add_argument("--repeats", type=int, default=3, help="paired repeats (default: %(default)s)")
    ap.add_argument("--short-timeout", type=float, default=1.0,
                    help="second detection timeout, seconds, for both ours and torchft (default: %(default)s)")
    ap.add_argument("--peers", default="torchft,nvrx", help="peers to run, comma-separated (default: %(default)s)")
    ap.add_argument("--setup-only", action="store_true",
                    help="only make (or check) the peers' venvs, print what each got, and stop")
    ap.add_argument("--recheck-peers", action="store_true",
                    help="ask the package index again about candidate releases that failed before")
    ap.add_argument("--overhead-rounds", type=int, default=4,
                    help="interleaved segment pairs per repeat, ours and torchft (default: %(default)s)")
    ap.add_argument("--overhead-steps", type=int, default=10, help="updates per segment (default: %(default)s)")
    ap.add_argument("--window-steps", type=int, default=40,
                    help="nvidia-resiliency-ext: timed updates after the experiment, wrapped and plain "
                         "(default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="stop starting repeats that would not fit (default: %(default)s s; lowered to "
                         "$ACCELPACT_BENCH_DEADLINE_S - 30 when that is set)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs, records)")
    return ap


def write_markdown(res: dict[str, Any], target: str) -> None:
    h.write_markdown(target, MARK, markdown(res))


def params_of(args: argparse.Namespace, budget: float) -> dict[str, Any]:
    """What every system runs: the reference job file's model, timeouts and cadence, and the options."""
    from accelpact_slurm.core.config import load_config
    from benchmarks.parts.peers_runs import job_file
    from benchmarks.parts.workload import param_count

    base = load_config(job_file())
    T, S = float(base.timeouts.collective_s), float(args.short_timeout)
    if S >= base.timeouts.control_s:
        raise SystemExit("--short-timeout must be shorter than the job file's timeouts.control_s")
    m = base.params
    return {"repeats": args.repeats, "steps": STEPS, "fault_step": FAULT_STEP, "fault": FAULT,
            "main_timeout_s": T, "short_timeout_s": S, "control_s": base.timeouts.control_s,
            "checkpoint_every": base.checkpoint.every_steps, "layers": m["layers"], "width": m["width"],
            "heads": m["heads"], "vocab": m["vocab"], "seq_len": m["seq_len"], "batch_per_rank": m["batch_per_rank"],
            "param_count": param_count(m),
            "overhead_rounds": args.overhead_rounds, "overhead_steps": args.overhead_steps,
            "window_steps": args.window_steps,
            "topology": {"ours": f"{base.topology.nodes}x{base.topology.ranks_per_node}", "torchft": "2x1",
                         "torchft_overhead": "2x2", "nvrx": "2", "nvrx_injob": "1x2"}, "budget_s": budget}


def tasks_of(args: argparse.Namespace, res: dict[str, Any], work: Path
             ) -> list[tuple[str, Callable[[Path, int], dict[str, Any]]]]:
    """The runs of one repeat, by name (the peers that could not be installed left out)."""
    from benchmarks.parts.peers_runs import (run_nvrx, run_nvrx_injob, run_ours_fault, run_ours_overhead, run_torchft,
                                  run_torchft_hsdp_overhead, write_config)

    T, S = res["params"]["main_timeout_s"], res["params"]["short_timeout_s"]
    every = res["params"]["checkpoint_every"]
    py = {n: REPO / res["peers"][n]["venv"] / "bin" / "python" for n in PEERS if res["peers"][n]["status"] == "ok"}
    feature = {n: {k for k, f in res["peers"][n].get("features", {}).items() if f.get("ok")} for n in py}
    cfg_T, cfg_S = work / "job-main.yaml", work / "job-short.yaml"
    write_config(cfg_T, T)
    write_config(cfg_S, S)
    ovh = (args.overhead_rounds, args.overhead_steps)
    tasks: list[tuple[str, Callable[[Path, int], dict[str, Any]]]] = [
        ("ours_T", lambda w, i: run_ours_fault(cfg_T, T, w, f"T{i}")),
        ("ours_S", lambda w, i: run_ours_fault(cfg_S, S, w, f"S{i}")),
        ("ours_overhead", lambda w, i: run_ours_overhead(T, w, *ovh)),
    ]
    if "manager" in feature.get("torchft", ()):
        tasks += [("torchft_T", lambda w, i: run_torchft(py["torchft"], T, w, f"T{i}", None)),
                  ("torchft_S", lambda w, i: run_torchft(py["torchft"], S, w, f"S{i}", None)),
                  ("torchft_hsdp_overhead", lambda w, i: run_torchft_hsdp_overhead(cfg_T, w / f"hsdp-{i}", ovh))]
    if "inprocess" in feature.get("nvrx", ()):
        tasks += [("nvrx", lambda w, i: run_nvrx(py["nvrx"], "wrapped", T, w, f"w{i}", args.window_steps)),
                  ("nvrx_plain", lambda w, i: run_nvrx(py["nvrx"], "plain", T, w, f"p{i}", args.window_steps))]
    if "injob" in feature.get("nvrx", ()):
        tasks += [("nvrx_injob", lambda w, i: run_nvrx_injob(py["nvrx"], T, w, f"j{i}", every))]
    return tasks


def main(argv: list[str] | None = None, doc: str = "") -> int:
    args = build_parser(doc).parse_args(argv)
    if args.render:
        res = h.read_result(args.render)
        if args.markdown:
            write_markdown(res, args.markdown)
        else:
            print(markdown(res))
        return 0
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    from benchmarks.parts.peers_runs import PROCS
    from benchmarks.parts.peers_venvs import ensure_venv

    budget = h.Budget(h.outer_deadline(args.budget_s, margin_s=30.0))
    log = h.logger("peers", budget.t0)
    h.stop_on_signals("peers", (signal.SIGTERM,))  # bench_all's deadline: stop, clean up, keep what is written
    res = h.new_result(PART, json=args.json, params=params_of(args, budget.budget_s), peers={}, runs=[],
                       repeats_done=0, commit=commit_of())
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    wanted = [x.strip() for x in args.peers.split(",") if x.strip()]
    for w in wanted:
        if w not in PEERS:
            raise SystemExit(f"--peers: unknown peer {w!r} (known: {', '.join(PEERS)})")
    try:
        for name in PEERS:
            if name not in wanted:
                res["peers"][name] = {"status": "skipped", "reason": "not selected (--peers)", "pin": None,
                                      "title": PEERS[name]["name"], "attempts": []}
                continue
            res["peers"][name] = info = ensure_venv(name, log, recheck=args.recheck_peers)
            if info["status"] != "ok":
                log(f"SKIPPING {info['title']}: {info['reason']}")
                continue
            log(f"{info['title']} ({info['pin']}, torch {info['torch']}, {info['venv']})"
                + (f"; newer candidates that do not work here: {', '.join(info['fallback_from'])}"
                   if info["fallback_from"] else ""))
            for feat, f in info["features"].items():
                if not f["ok"]:
                    log(f"SKIPPING {info['title']} {feat}: {f['reason']}")
        if args.setup_only:
            print(json.dumps(res["peers"], indent=1), flush=True)
            return 0
        tasks = tasks_of(args, res, work)
        t_runs = time.monotonic()
        for i in range(args.repeats):
            if i and not budget.fits(1.15):
                log(f"stopping after {i} repeat(s): the next would not fit the {budget.budget_s:.0f} s budget")
                res["stopped_early"] = f"after {i} of {args.repeats} repeats ({budget.budget_s:.0f} s budget)"
                break
            t_rep = time.monotonic()
            rep: dict[str, Any] = {}
            for name, fn in h.rotate(tasks, i):  # rotated order
                wdir = work / f"r{i}"
                wdir.mkdir(exist_ok=True)
                t0 = time.monotonic()
                try:
                    rep[name] = fn(wdir, i)
                except (OSError, RuntimeError, ValueError, KeyError, TimeoutError) as exc:
                    rep[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                finally:
                    PROCS.kill_all()
                rep[name]["wall_s"] = time.monotonic() - t0
                log(f"repeat {i + 1}/{args.repeats} {name}: " + _brief(rep[name]))
            res["runs"].append(rep)
            res["repeats_done"] = i + 1
            budget.record(time.monotonic() - t_rep)
            res["total_wall_s"] = budget.elapsed()
            res["runs_wall_s"] = time.monotonic() - t_runs
            analyse(res)
            h.write_result(res, args.json)  # partial result after every repeat
    finally:
        PROCS.kill_all()
        if args.keep:
            print(f"[peers] working directory kept: {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    res["total_wall_s"] = budget.elapsed()
    h.finish(res)
    analyse(res)
    out = h.write_result(res, args.json)
    write_markdown(res, args.markdown)
    log(f"result written to {out} ({res['total_wall_s']:.0f} s)")
    for r in res["rows"]:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"  {r['what']}: {ratio} ({r['spread']}) vs {r['baseline']} [{r.get('abs')}]", flush=True)
    return 0


def commit_of() -> dict[str, Any]:
    """The commit the benchmark's code and the library were at, and whether either had local changes."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, check=False, capture_output=True, text=True,
                                  timeout=30).stdout.rstrip("\n")
        except (OSError, subprocess.TimeoutExpired):
            return ""

    sha = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--", "accelpact_slurm", "examples/decoder", "benchmarks/parts/peers.py",
                "benchmarks/parts/peers_*", "benchmarks/harness/common.py", "benchmarks/parts/workload.py", "scripts/peers")
    return {"sha": sha.strip() or None, "short": sha.strip()[:10] or None,
            "dirty": sorted({ln[3:] for ln in dirty.splitlines() if len(ln) > 3})}


def _brief(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"FAILED ({(r.get('error') or '')[:300]})"
    bits = [f"{k} {r[k]:.3f}" for k in ("fault_to_resume_s", "step_s", "rejoin_s", "relaunch_s", "replay_s")
            if r.get(k) is not None]
    if r.get("ratios"):
        bits.append("ratios " + ", ".join(f"{x:.2f}" for x in r["ratios"]))
    if r.get("overhead", {}).get("ratios"):
        bits.append("overhead " + ", ".join(f"{x:.2f}" for x in r["overhead"]["ratios"]))
    return f"ok, {r['wall_s']:.1f} s: " + ", ".join(bits)
