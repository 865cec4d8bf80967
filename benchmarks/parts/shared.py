#!/usr/bin/env python3
"""Shared-tier benchmark: what uploading snapshots to the shared tier costs the training loop.

Paired jobs on the embedded default (2 emulated nodes x 2 ranks, the per-node checkpoint daemons, the
decoder example's model, optimizer and data at the reference job's size unless ``--layers``/``--width``
say otherwise), started by the library's own launcher (``harness.launch_job``) with the benchmark's entry
point (``benchmarks/parts/shared_entry.py``: the example's update body inside ``with run.update()``):

    shared   ``checkpoint.shared_every: 1``: every snapshot also goes to the shared tier, once per job,
             the uploading node rotating (the most the shared tier can cost)
    off      ``checkpoint.shared_every: 0``: the same job, nothing uploaded (the baseline)

Both snapshot every ``--every`` updates to the node directories, so the only difference is the upload
(and the shared tier's retention after it), on the daemons' ``ckptd-tier`` threads.  The figure is, per
pair, the ratio of the mean update time (rank 0: end of one update to the end of the next, snapshot
hand-over included; the first ``--warmup`` updates left out) of ``shared`` to ``off``; pairs alternate
their order (ABBA).  Median (min–max) over the pairs; absolute times and the uploads' bytes and seconds
(from the daemons' ``shared_upload`` events) are printed beside it for this run only.

Usage::

    .venv/bin/python benchmarks/parts/shared.py [--pairs 3] [--steps 40] [--every 2] [--warmup 6]
                                             [--layers L] [--width W] [--json PATH] [--markdown FILE]
    .venv/bin/python benchmarks/parts/shared.py --quick --markdown ''    (one pair of short jobs: a smoke run)
    .venv/bin/python benchmarks/parts/shared.py --render runs/bench/<date>/shared.json

Output: ``--json`` (default ``runs/bench/<date>/shared.json``) and the block between
``<!-- shared-bench -->`` markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts' summaries).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as h  # noqa: E402

h.add_paths()

MARK = "<!-- shared-bench -->"
PART = "shared"
MODES = {"shared": 1, "off": 0}  # checkpoint.shared_every of each mode
QUICK = {"pairs": 1, "steps": 14, "warmup": 4}


def write_job(path: Path, mode: str, args: argparse.Namespace, out: Path, deadline_s: float) -> Path:
    """The reference job file with the benchmark's entry point, the mode's ``shared_every`` and the plan."""
    from benchmarks.parts.workload import entry_of, write_job as write

    model = {k: v for k, v in (("layers", args.layers), ("width", args.width)) if v is not None}
    return write(path, {
        "name": f"bench-shared-{mode}", "steps": args.steps, "log_every": 100_000, "faults": [],
        "topology.nodes": 2, "topology.ranks_per_node": 2, "topology.threads_per_rank": 1,
        "checkpoint.every_steps": args.every, "checkpoint.keep_last": 2, "checkpoint.milestone_every": 0,
        "checkpoint.shared_every": MODES[mode], "checkpoint.shared_keep": 2,
    }, entry=entry_of("shared_entry"), params={**model, "bench": {"out": str(out), "deadline_s": deadline_s}})


def run_one(work: Path, pair: int, mode: str, args: argparse.Namespace, deadline_s: float) -> dict[str, Any]:
    """One job of one mode; its rank 0's update times and its daemons' uploads."""
    run_dir = work / f"{pair}-{mode}"
    out = work / f"{pair}-{mode}.json"
    config = write_job(work / f"{pair}-{mode}.yaml", mode, args, out, deadline_s)
    t0 = time.monotonic()
    code = h.launch_job(config, run_dir, echo=h.LineFilter(("[bench]",)), job_id=f"bench-shared-{pair}-{mode}")
    wall = time.monotonic() - t0
    if code != 0 or not out.exists():
        raise RuntimeError(f"the {mode} job of pair {pair} exited {code}; rank 0's log ends:\n"
                           f"{h.tail(run_dir / 'logs' / 'rank-0.log', 25)}")
    update_s = h.read_result(out)["update_s"]
    timed = update_s[args.warmup:]
    ups = [e for e in h.read_jsonl(run_dir / "events.jsonl") if e.get("event") == "shared_upload"]
    snaps = [e for e in h.read_jsonl(run_dir / "events.jsonl") if e.get("event") == "checkpoint"
             and e.get("state") == "verified"]
    return {"pair": pair, "mode": mode, "exit_code": code, "wall_s": wall, "updates": len(update_s),
            "timed": len(timed), "mean_s": h.mean(timed), "median_s": h.med(timed),
            "verified": len(snaps), "uploads": sum(1 for e in ups if e.get("ok")),
            "upload_failed": sum(1 for e in ups if not e.get("ok")),
            "upload_bytes": [e.get("size_bytes") for e in ups if e.get("ok")],
            "upload_s": [e.get("copy_s") for e in ups if e.get("ok")],
            "uploaders": sorted({e.get("hostname") for e in ups if e.get("ok")})}


def measure(args: argparse.Namespace, work: Path, log: Any) -> list[dict[str, Any]]:
    deadline = h.outer_deadline(300.0, margin_s=20.0, floor_s=60.0)
    runs = []
    for i in range(args.pairs):
        for mode in h.abba(i, "shared", "off"):
            r = run_one(work, i, mode, args, deadline)
            runs.append(r)
            log(f"pair {i + 1}/{args.pairs} {mode:<6} mean update {r['mean_s'] * 1000:.1f} ms over {r['timed']} "
                f"updates, {r['uploads']} upload(s) ({r['wall_s']:.0f} s)")
    return runs


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Paired ratios, spreads and the overview row, from the runs alone."""
    runs = res["runs"]
    by = {(r["pair"], r["mode"]): r for r in runs}
    pairs = sorted({r["pair"] for r in runs})
    ratio = h.ratio_stats([(by[p, "shared"]["mean_s"], by[p, "off"]["mean_s"]) for p in pairs
                           if (p, "shared") in by and (p, "off") in by])
    shared = [r for r in runs if r["mode"] == "shared"]
    sizes = [b for r in shared for b in r["upload_bytes"] if b]
    secs = [s for r in shared for s in r["upload_s"] if s is not None]
    res["summary"] = {"ratio": ratio, "upload_bytes": h.spread(sizes), "upload_s": h.spread(secs),
                      "uploads_per_job": h.spread([r["uploads"] for r in shared]),
                      "verified_per_job": h.spread([r["verified"] for r in shared]),
                      "uploads_off": sum(r["uploads"] for r in runs if r["mode"] == "off")}
    note = (f"{h.fmt(_ms(ratio['abs_test']), '{:.1f}')} ms vs {h.fmt(_ms(ratio['abs_base']), '{:.1f}')} ms per update; "
            f"uploads {_mib(res['summary']['upload_bytes']['median'])} in "
            f"{h.fmt(_ms(res['summary']['upload_s']['median']), '{:.0f}')} ms (medians, absolute, for reference)")
    res["rows"] = [h.row("mean update time, every snapshot also uploaded to the shared tier (`shared_every: 1`)",
                         "the same job with `shared_every: 0`", ratio, note=note)]
    return res


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def markdown(res: dict[str, Any]) -> str:
    s, p = res["summary"], res["params"]
    m = res["machine"]
    size = ", ".join(f"{k} {v}" for k, v in (("layers", p.get("layers")), ("width", p.get("width"))) if v) \
        or "the reference job's size"
    lines = [
        MARK,
        "## Shared tier: what the uploads cost the training loop",
        "",
        (f"Written by `benchmarks/parts/shared.py` on {res['date']} ({m.get('cpus')} CPU cores, load average at start "
         f"{', '.join(f'{x:.1f}' for x in m.get('loadavg_start') or [])}){' in its quick mode' if p.get('quick') else ''}. "
         f"Jobs on the embedded default (2 emulated nodes x 2 ranks, per-node daemons), the decoder example at "
         f"{size}, {p['steps']} updates, a snapshot every {p['every']} updates; {p['pairs']} pair(s) of jobs, "
         f"ABBA order; the first {p['warmup']} updates of each job left out. Rank 0 times every update from the end "
         "of the previous one (snapshot hand-over included)."),
        "",
        "| what | baseline | ratio (median, min–max) | n | ours, ms | baseline, ms |",
        "|---|---|---:|---:|---:|---:|",
        (f"| mean update time, `shared_every: 1` (every snapshot uploaded once per job) | `shared_every: 0` | "
         f"{h.fmt_spread(s['ratio'])} | {s['ratio']['n']} | {h.fmt(_ms(s['ratio']['abs_test']), '{:.1f}')} | "
         f"{h.fmt(_ms(s['ratio']['abs_base']), '{:.1f}')} |"),
        "",
        (f"Uploads per `shared` job: {h.fmt(s['uploads_per_job']['median'], '{:.0f}')} of "
         f"{h.fmt(s['verified_per_job']['median'], '{:.0f}')} verified node snapshots (one copy per snapshot for "
         f"the job, not one per node); each {_mib(s['upload_bytes']['median'])} in "
         f"{h.fmt(_ms(s['upload_s']['median']), '{:.0f}')} ms (median; "
         f"{h.fmt(_ms(s['upload_s']['min']), '{:.0f}')}–{h.fmt(_ms(s['upload_s']['max']), '{:.0f}')} ms) on the "
         f"daemons' `ckptd-tier` threads; the `off` jobs uploaded {s['uploads_off']}."),
        "",
        MARK,
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="bench_shared.py", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="pairs of jobs, shared and off (default: %(default)s)")
    p.add_argument("--steps", type=int, default=40, help="updates per job (default: %(default)s)")
    p.add_argument("--every", type=int, default=2, help="checkpoint.every_steps (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=6, help="updates left out at the start of a job (default: %(default)s)")
    p.add_argument("--layers", type=int, help="the decoder's depth (default: the reference job's)")
    p.add_argument("--width", type=int, help="the decoder's width (default: the reference job's)")
    p.add_argument("--quick", action="store_true",
                   help=f"one pair of short jobs ({', '.join(f'--{k} {v}' for k, v in QUICK.items())}): a smoke run")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    h.output_args(p, None, "result file (default runs/bench/<date>/shared.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        res = summarize(h.read_result(args.render))
    else:
        if args.quick:
            for k, v in QUICK.items():
                setattr(args, k, v)
        if args.pairs < 1 or args.every < 1 or args.steps <= args.warmup + args.every:
            raise SystemExit("--pairs and --every must be >= 1, and --steps must leave timed updates after --warmup")
        h.stop_on_signals("bench")  # unwind, so the launcher stops the ranks and daemons
        log = h.logger(PART, time.monotonic())
        res = h.new_result(PART, params={"pairs": args.pairs, "steps": args.steps, "every": args.every,
                                         "warmup": args.warmup, "layers": args.layers, "width": args.width,
                                         "quick": args.quick})
        work = Path(tempfile.mkdtemp(prefix="accelpact-bench-shared-"))
        t0 = time.monotonic()
        try:
            res["runs"] = measure(args, work, log)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            else:
                log(f"work directory kept: {work}")
        res["wall_s"] = time.monotonic() - t0
        h.finish(res)
        summarize(res)
        out = h.write_result(res, args.json or f"runs/bench/{res['date']}/{PART}.json")
        log(f"wrote {out} ({res['wall_s']:.0f} s)")
    block = markdown(res)
    print(block)
    if args.markdown:
        print(f"[{PART}] updated {h.write_markdown(args.markdown, MARK, block)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
