"""Checkpoint benchmark, the command line and the run (``scripts/bench_ckpt.py`` is the entry point).

Part 1 runs one job (``ckpt_setup.launch``, its entry point ``ckpt_entry``, baselines ``ckpt_dcp``), part 2 the
bandwidth pair (``ckpt_bandwidth``); ``ckpt_analysis`` and ``ckpt_report`` turn the records into the result
and its markdown block.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness as h
from bench.ckpt_analysis import daemon_latencies, goals, rows, summarize_steps
from bench.ckpt_report import analysis_lines, markdown
from bench.ckpt_setup import MARK, MODEL, MODES, MachineWatch, launch, rotated_orders, write_config

DESCRIPTION = ("Checkpoint-service acceptance benchmark: our snapshot path against stock DCP, side by side in "
               "one job.")

__all__ = ["main", "markdown"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_ckpt.py", description=DESCRIPTION)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=3, help="K: snapshot every K updates")
    ap.add_argument("--windows", type=int, default=1,
                    help="K-update windows per segment, each starting with a snapshot")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default=",".join(m for m in MODES if m != "dcp_stager_shm"),
                    help="comma-separated subset of %s (none is always run)" % ",".join(MODES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=MODEL["layers"])
    ap.add_argument("--width", type=int, default=MODEL["width"])
    ap.add_argument("--heads", type=int, default=MODEL["heads"])
    ap.add_argument("--vocab", type=int, default=MODEL["vocab"])
    ap.add_argument("--seq-len", type=int, default=MODEL["seq_len"])
    ap.add_argument("--bw-pairs", type=int, default=8)
    ap.add_argument("--skip-steps", action="store_true", help="only the bandwidth part")
    ap.add_argument("--work", help="work directory (default: a new one under /tmp, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    h.output_args(ap, None, "output JSON (default benchmarks/results/<date>-ckpt.json)")
    return ap


def complete(res: dict[str, Any]) -> dict[str, Any]:
    """Goals, reading and overview rows, from the measurements alone."""
    res["goals"] = goals(res["steps"], res["bandwidth"])
    res["analysis"] = analysis_lines(res)
    res["rows"] = rows(res)
    return res


def run_steps(res: dict[str, Any], args: argparse.Namespace, modes: list[str], model: dict[str, Any],
              work: Path) -> None:
    """Part 1: the job, its rank 0 records, the paired step-time summary and the daemons' latencies."""
    plan = {"every": args.every, "windows": args.windows, "warmup": args.warmup, "rounds": args.rounds,
            "modes": modes, "orders": rotated_orders(modes, args.rounds),
            "out": str(work / "bench-out"), "dcp_dir": str(work / "run" / "dcp")}
    os.makedirs(plan["out"], exist_ok=True)
    res["plan"] = plan
    config = work / "bench.yaml"
    write_config(config, plan, model, args.batch)
    t = time.monotonic()
    with MachineWatch(str(work / "run")) as watch:
        code = launch(config, work / "run")
    res["steps_wall_s"] = time.monotonic() - t
    res["machine_during_steps"] = watch.summary()
    rank0 = json.loads((Path(plan["out"]) / "rank-0.json").read_text())
    res["raw"] = {"records": rank0["records"], "segments": rank0["segments"]}
    res["exit_code"] = code
    res["dcp_process_start"] = rank0["extra"].get("dcp_process_start")
    res["ours_first_snapshot"] = rank0["extra"].get("ours_first_snapshot")
    res["steps"] = summarize_steps(rank0["records"], rank0["segments"], plan)
    res["daemon_latency"] = daemon_latencies(work / "run" / "events.jsonl", rank0["records"])
    if code != 0:
        print(f"[bench] the job exited with code {code}; logs under {work / 'run' / 'logs'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        res = complete(h.read_result(args.render))
        h.write_markdown(args.markdown, MARK, markdown(res))
        print(markdown(res))
        return 0

    from bench.ckpt_bandwidth import bench_bandwidth
    from bench.workload import param_count

    t_start = time.monotonic()
    modes = [m for m in MODES if m == "none" or m in args.modes.split(",")]
    model = dict(MODEL, layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="accelpact-bench-ckpt-"))
    work.mkdir(parents=True, exist_ok=True)
    json_path = h.out_path(args.json or f"benchmarks/results/{h.today()}-ckpt.json")
    nparams = param_count(model)
    state_bytes = nparams * 4 * 3  # fp32 weights + two AdamW moments
    print(f"[bench] model: {nparams / 1e6:.1f}M parameters ({state_bytes / 2**30:.2f} GiB with AdamW); work {work}",
          flush=True)
    res = h.new_result("ckpt", params=model, param_count=nparams, state_bytes=state_bytes, batch=args.batch,
                       json=h.json_field(json_path))
    try:
        if not args.skip_steps:
            run_steps(res, args, modes, model, work)
        else:
            res["plan"] = {"every": args.every, "windows": args.windows, "warmup": args.warmup, "rounds": 0}
            res["steps"] = {}
        t = time.monotonic()
        res["bandwidth"] = bench_bandwidth(model, work, args.bw_pairs)
        res["bandwidth_wall_s"] = time.monotonic() - t
        complete(res)
        res["total_wall_s"] = time.monotonic() - t_start
        h.finish(res)
        failed = res.get("exit_code", 0) != 0  # keep the last good result; write this one beside it
        print(f"[bench] wrote {h.write_result(res, json_path, failed=failed)}", flush=True)
        if args.markdown and failed:
            print("[bench] the job failed: docs not updated", flush=True)
        elif args.markdown:
            print(f"[bench] updated {h.write_markdown(args.markdown, MARK, markdown(res))}", flush=True)
        print(markdown(res))
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if res.get("exit_code", 0) == 0 else 1
