"""L1 repair benchmark, the command line and the run (``benchmarks/parts/repair.py`` is the entry point).

``repair_setup`` starts the job, ``repair_entry`` is its entry point (what its ranks run), ``repair_analysis``
and ``repair_report`` turn their records into the result and its markdown block.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.repair_analysis import analyse, summary_rows
from benchmarks.parts.repair_report import markdown
from benchmarks.parts.repair_setup import MARK, NODES, PART, RPN, run_job

__all__ = ["build_parser", "main", "markdown"]


def build_parser(doc: str = "") -> argparse.ArgumentParser:
    head, _, rest = (doc or __doc__).partition("\n\n")
    p = argparse.ArgumentParser(prog="bench_repair.py", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    h.output_args(p, f"runs/bench/{h.today()}/repair.json")
    p.add_argument("--repairs", type=int, default=8, help="injected repairs paired with a floor (default: %(default)s)")
    p.add_argument("--floor-samples", type=int, default=5,
                   help="floor samples beside each repair, each timed on every member (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up updates before the first repair (default: %(default)s)")
    p.add_argument("--guard-pairs", type=int, default=16, help="guarded/unguarded block pairs (default: %(default)s)")
    p.add_argument("--guard-block", type=int, default=6, help="updates per block (default: %(default)s)")
    p.add_argument("--layers", default="4,8,16,32,64", help="model depths of the rebinding sweep (default: %(default)s)")
    p.add_argument("--rebind-reps", type=int, default=4,
                   help="rounds over the depths, one injected repair per depth per round (default: %(default)s)")
    p.add_argument("--sweep-width", type=int, default=32, help="model width in the sweep (default: %(default)s)")
    p.add_argument("--sweep-warmup", type=int, default=1, help="warm-up updates per depth (default: %(default)s)")
    p.add_argument("--collective-timeout", type=float, default=2.0, metavar="S",
                   help="Gloo collective timeout = fault detection time per injected fault (default: %(default)s)")
    p.add_argument("--control-timeout", type=float, default=30.0, metavar="S",
                   help="control-plane deadline (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=60.0, metavar="S",
                   help="rendezvous deadline (default: %(default)s)")
    p.add_argument("--deadline", type=float, default=270.0, metavar="S",
                   help="the whole job is killed after this many seconds (default: %(default)s)")
    return p


def _write_markdown(res: dict[str, Any], target: str) -> None:
    path = h.write_markdown(target, MARK, markdown(res))
    if path:
        print(f"[bench] markdown block written to {path}")


def main(argv: list[str] | None = None, doc: str = "") -> int:
    args = build_parser(doc).parse_args(argv)
    if args.render:
        res = h.read_result(args.render)
        _write_markdown(res, args.markdown)
        if not args.markdown:
            print(markdown(res))
        return 0
    layers = [int(x) for x in args.layers.split(",") if x.strip()]
    if min(args.repairs, args.floor_samples, args.guard_pairs, args.guard_block, args.rebind_reps) < 1 or not layers:
        raise SystemExit("--repairs, --floor-samples, --guard-pairs, --guard-block, --rebind-reps and --layers "
                         "must be >= 1")
    if args.collective_timeout >= args.control_timeout:
        raise SystemExit("--collective-timeout must be shorter than --control-timeout")
    plan = {"nodes": NODES, "ranks_per_node": RPN, "repairs": args.repairs,
            "floor_samples": args.floor_samples, "warmup": args.warmup,
            "guard_pairs": args.guard_pairs, "guard_block": args.guard_block, "layers": layers,
            "rebind_reps": args.rebind_reps, "sweep_width": args.sweep_width, "sweep_warmup": args.sweep_warmup,
            "collective_s": args.collective_timeout, "control_s": args.control_timeout,
            "startup_s": args.startup_timeout,
            # bench_all.py's deadline: leave room for the analysis
            "deadline_s": h.outer_deadline(args.deadline, margin_s=30.0, floor_s=30.0)}
    h.stop_on_signals("bench")  # unwind, so the launcher stops the ranks
    machine = h.machine()
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="bench-repair-"))
    try:
        ranks = run_job(plan, workdir)
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"[bench] FAILED: {exc}\n[bench] rank logs kept in {workdir / 'logs'}", file=sys.stderr, flush=True)
        return 1
    res: dict[str, Any] = {"part": PART, "date": h.today(), "machine": machine, "plan": plan,
                           "json": args.json, "main_model": ranks[0]["main_model"],
                           "init_s": max(r["init_s"] for r in ranks)}
    res.update(analyse(ranks, plan))
    res["total_wall_s"] = time.monotonic() - t0
    h.finish(res)
    res["rows"] = summary_rows(res)
    out = h.write_result(res, args.json)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"[bench] result written to {out} ({res['total_wall_s']:.0f} s)")
    for r in res["rows"]:
        print(f"[bench]   {r['what']}: {h.fmt(r['ratio'], '{:.3f}')} ({r['spread']}) vs {r['baseline']}; {r['note']}")
    _write_markdown(res, args.markdown)
    return 0
