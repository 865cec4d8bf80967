"""Checkpoint benchmark, the command line and the run (``benchmarks/parts/ckpt.py`` is the entry point).

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

from benchmarks.harness import common as h
from benchmarks.parts.ckpt_analysis import daemon_latencies, goals, rows, summarize_steps
from benchmarks.parts.ckpt_report import analysis_lines, markdown
from benchmarks.parts.ckpt_setup import MARK, MODEL, MODES, MachineWatch, launch, rotated_orders, write_config
from benchmarks.parts.ckpt_soak import memory_goal

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
    ap.add_argument("--bw-pairs", type=int, default=6)
    ap.add_argument("--skip-steps", action="store_true", help="only the bandwidth part")
    ap.add_argument("--soak", type=int, default=200, metavar="N",
                    help="snapshots of the memory soak (ckpt_soak.py; 0: skip it)")
    ap.add_argument("--soak-every", type=int, default=2, metavar="K", help="updates between the soak's snapshots")
    ap.add_argument("--work", help="work directory (default: a new one under /tmp, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    h.output_args(ap, None, "output JSON (default runs/bench/<date>/ckpt.json)")
    return ap


def complete(res: dict[str, Any]) -> dict[str, Any]:
    """Goals, reading and overview rows, from the measurements alone."""
    res["goals"] = goals(res["steps"], res["bandwidth"])
    memory = memory_goal(res.get("soak"))
    if memory:
        res["goals"]["memory"] = memory
    g = res["goals"]
    cpu = g.get("daemon_cpu") or {}
    if cpu.get("cpu_s_per_gib") is not None and cpu.get("ceiling_write") is not None:
        rest = cpu["cpu_s_per_gib"] - cpu["ceiling_write"] - 2 * (cpu.get("digest_alone") or 0)
        cpu["cause"] = (f"the kernel's own cost of writing the bytes this way (the ceiling's CPU) "
                        f"{cpu['ceiling_write']:.2f} s per GiB, the digest {cpu.get('digest_alone') or 0:.2f} s per "
                        f"GiB once on write and once on verification, the rest (DCP's serialisation, the re-read, "
                        f"coverage) {rest:.2f} s")
    dl = res.get("daemon_latency") or {}
    committed = (dl.get("committed") or {}).get("median")
    step = ((res["steps"].get("none") or {}).get("mean_step_s") or {}).get("median")
    if committed is not None and step:
        interval = res["plan"]["every"] * step
        g["commit_in_interval"] = {
            "goal": "a snapshot committed (both nodes) before the next one is due", "committed_s": committed,
            "verified_s": (dl.get("verified") or {}).get("median"), "interval_s": interval,
            "pass": committed < interval,
            "cause": (f"each node's daemon writes a {(dl.get('node_snapshot_bytes') or 0) / 2**30:.2f} GiB copy on "
                      f"the two cores the four ranks train on, at the lowest priority"
                      if committed >= interval else None)}
    bg = g.get("background") or {}
    if bg.get("pass") is False and cpu.get("cpu_s_per_gib") is not None:
        bg["cause"] = (f"the daemons' {cpu['cpu_s_per_gib']:.2f} CPU-s per GiB written and verified, "
                       f"{(dl.get('node_snapshot_bytes') or 0) / 2**30:.2f} GiB per node per snapshot, run on the "
                       f"same two cores as the four ranks (daemon_nice lowers their priority, not their work)")
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

    from benchmarks.parts.ckpt_bandwidth import bench_bandwidth
    from benchmarks.parts.ckpt_soak import soak
    from benchmarks.parts.workload import param_count

    t_start = time.monotonic()
    modes = [m for m in MODES if m == "none" or m in args.modes.split(",")]
    model = dict(MODEL, layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="accelpact-bench-ckpt-"))
    work.mkdir(parents=True, exist_ok=True)
    json_path = h.out_path(args.json or f"runs/bench/{h.today()}/ckpt.json")
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
        if args.soak > 0:
            res["soak"] = soak(work, args.soak, args.soak_every)
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
