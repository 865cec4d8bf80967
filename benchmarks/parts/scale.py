#!/usr/bin/env python3
"""Snapshots at the size people train: the decoder at ~185M and ~300M parameters on the embedded default.

For each size of ``--sizes`` (:data:`SIZES`: the decoder example at width 1024 and vocabulary 16,384, 12 layers:
184.7M parameters, 21 layers: 298.1M; the reference job's sequence length and batch), on 2 emulated nodes x 2
ranks with the per-node checkpoint daemons, started as a user starts them (``accelpact-run JOB.yaml``, which
relaunches the job in place after a fail-stop; the ranks run the example's entry point through
``benchmarks/parts/scale_entry.py``), each trial runs three jobs of 20 updates with a snapshot every 5
(``benchmarks/parts/scale_runs.py``):

    ref     uninterrupted: the reference ``final_state_digest`` (``summary.json``)
    fault   ``forward:12:1``, a fault in uncommitted compute: the job fail-stops and restarts (L2) from snapshot 10
    kill    rank 1 SIGKILLed by this process right after rank 0's ``step`` event of update 13 (L2)

Measured (``benchmarks/parts/scale_report.py``), per run: the first snapshot of the job, and of the restart,
against the median of the same run's other snapshots (rank 0's ``snapshot`` events, the blocking less the wait
for a slot the daemon still writes); the job's memory sampled every 0.2 s through the run (each node's ranks'
and daemon's ``RssAnon`` from ``/proc/<pid>/status`` plus its ``/dev/shm`` staging), its peak and its steady level
(the median over the run's second half), per parameter; the reload (``restart_load.load_s``) against a plain
sequential read of the same files right after the job, as a ratio of rates; whether the fault's and the kill's
final digests equal the uninterrupted run's.  Per size: the median (min–max) over the runs.  The goals: a first
snapshot (of a job, of a restart) blocks <= 1.5x a regular one; the peak <= the steady level + 2 B/param in every
run; the reload's rate >= 0.67x the plain read's; every fault and kill run bitwise equal to its reference.

The trials interleave the sizes (trial t of every size, then trial t + 1), so that a deadline cuts the extra trials
first; a trial that would not fit the part's budget (``$ACCELPACT_BENCH_DEADLINE_S``) after the longest trial of
its size so far (scaled by the parameter count for a size not run yet) is not started.  A run that fails (exit
status, no restart, no kill) is recorded with its reason and left out of the figures.

Usage::

    .venv/bin/python -m benchmarks.parts.scale [--sizes 185M,300M] [--trials N] [--json PATH] [--markdown FILE]
    .venv/bin/python -m benchmarks.parts.scale --quick         (a tiny model, one trial: a smoke run)
    .venv/bin/python -m benchmarks.parts.scale --render runs/bench/<date>/scale.json

``--trials`` defaults to 2 for 185M and 1 for 300M (:data:`SIZES`); a size may also be given as
``<layers>x<width>`` (16384 words, heads of 64).  Output: ``--json`` (default ``runs/bench/<date>/scale.json``;
``scale-quick.json`` in the quick mode, which no summary or docs ever read) and the block between
``<!-- scale-bench -->`` markers of ``--markdown`` (default ``''``: none).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as h  # noqa: E402

h.add_paths()

from benchmarks.parts.scale_report import (  # noqa: E402,F401 - the part's report, named here for run.py
    MARK, PART, goal_rows, markdown, readme_bullet, summarize, summary_rows)

__all__ = ["main", "markdown", "summary_rows", "readme_bullet", "goal_rows", "SIZES"]

#: name -> (the decoder's shape beyond the reference job's, trials by default)
SIZES: dict[str, tuple[dict[str, Any], int]] = {
    "185M": ({"layers": 12, "width": 1024, "heads": 16, "vocab": 16384}, 2),
    "300M": ({"layers": 21, "width": 1024, "heads": 16, "vocab": 16384}, 1),
}
QUICK = ("tiny", {"layers": 2, "width": 64, "heads": 4, "vocab": 256})
BUDGET_S = 7200.0  # the part alone; under make bench its deadline less a margin
RANK_DEADLINE_S = 3000.0  # a rank of any job of this part exits by itself after this
RUN_DEADLINE_S = 3300.0  # a job still running after this is stopped (a failed run)


def parse_sizes(text: str) -> dict[str, dict[str, Any]]:
    out = {}
    for name in (s.strip() for s in text.split(",") if s.strip()):
        m = re.fullmatch(r"(\d+)x(\d+)", name)
        if name in SIZES:
            out[name] = dict(SIZES[name][0])
        elif m and int(m.group(2)) % 64 == 0:
            out[name] = {"layers": int(m.group(1)), "width": int(m.group(2)), "heads": int(m.group(2)) // 64,
                         "vocab": 16384}
        else:
            raise SystemExit(f"--sizes: {name!r} is neither one of {', '.join(SIZES)} nor LAYERSxWIDTH (WIDTH a "
                             "multiple of 64)")
    if not out:
        raise SystemExit("--sizes: no size")
    return out


def measure(args: argparse.Namespace, work: Path, log: Any, res: dict[str, Any]) -> None:
    from benchmarks.parts import scale_runs as sr

    budget = h.Budget(h.outer_deadline(BUDGET_S, margin_s=60.0, floor_s=120.0))
    res["sizes"] = {}
    for name, shape in args.sizes.items():
        res["sizes"][name] = {"shape": shape, "params": sr.param_count(shape)}
        log(f"{name}: {res['sizes'][name]['params']:,} parameters ({', '.join(f'{k} {v}' for k, v in shape.items())})")
    runs: list[dict[str, Any]] = []
    res["runs"] = runs
    longest: dict[str, float] = {}  # a trial's wall seconds, per size
    for trial in range(max(args.trials.values())):
        for name, shape in args.sizes.items():
            if trial >= args.trials[name]:
                continue
            params = res["sizes"][name]["params"]
            need = longest.get(name) or max((w * params / res["sizes"][n]["params"] for n, w in longest.items()),
                                            default=0.0)
            if budget.elapsed() + 1.15 * need > budget.budget_s:
                why = (f"{name} trial {trial + 1} would not fit the {budget.budget_s:.0f} s budget (about "
                       f"{need:.0f} s)")
                log(why + ": not started")
                res.setdefault("cut_short", []).append(why)
                continue
            t0 = time.monotonic()
            for kind in sr.KINDS:
                log(f"{name} trial {trial + 1}/{args.trials[name]}: {sr.WHAT[kind]} run")
                left = budget.budget_s - budget.elapsed()
                r = sr.run_one(work, name, shape, kind, trial, max(60.0, min(RUN_DEADLINE_S, left)),
                               RANK_DEADLINE_S, log, keep=args.keep)
                runs.append(r)
                load = r.get("load") or {}
                plain = r.get("plain_read") or {}
                log(f"{name} {kind}: exit {r['exit_code']} in {r['wall_s']:.0f} s, {r['restarts']} restart(s), "
                    f"{len(r['snapshots'])} snapshots, per update {h.fmt(h.med(r['step_s']))} s"
                    + (f", reload {h.fmt(load.get('load_s'))} s, plain read {h.fmt(plain.get('read_s'))} s of "
                       f"{(plain.get('bytes') or 0) / 2**30:.2f} GiB" if load else "")
                    + (f"; FAILED: {r['error'][:300]}" if r.get("error") else ""))
            longest[name] = max(longest.get(name, 0.0), time.monotonic() - t0)
    if not any(not r.get("error") for r in runs):
        raise RuntimeError("no run of the part succeeded: " + "; ".join(str(r.get("error"))[:300] for r in runs[:3]))


def build_parser() -> argparse.ArgumentParser:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="scale.py", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated sizes (default: %(default)s)")
    p.add_argument("--trials", type=int, help="trials of every size (default: 2 for 185M, 1 for 300M and others)")
    p.add_argument("--quick", action="store_true", help="a tiny model (layers 2, width 64), one trial: a smoke run")
    p.add_argument("--keep", action="store_true", help="keep the work directory (every run's run directory)")
    h.output_args(p, None, "result file (default runs/bench/<date>/scale.json; scale-quick.json with --quick)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        res = summarize(h.read_result(args.render))
    else:
        if args.quick:
            args.sizes = {QUICK[0]: dict(QUICK[1])}
            args.trials = {QUICK[0]: 1}
        else:
            args.sizes = parse_sizes(args.sizes)
            if args.trials is not None and args.trials < 1:
                raise SystemExit("--trials must be >= 1")
            args.trials = {n: args.trials or (SIZES[n][1] if n in SIZES else 1) for n in args.sizes}
        h.stop_on_signals("bench")  # unwind, so the launcher stops the ranks and daemons
        log = h.logger(PART, time.monotonic())
        from benchmarks.parts import scale_runs as sr

        res = h.new_result(PART, params={"sizes": list(args.sizes), "trials": args.trials, "quick": args.quick,
                                         "steps": sr.STEPS, "every": sr.EVERY, "fault": sr.FAULT,
                                         "kill_after": sr.KILL_AFTER, "kill_rank": sr.KILL_RANK})
        json_path = args.json or f"runs/bench/{res['date']}/{PART}{'-quick' if args.quick else ''}.json"
        res["json"] = h.json_field(json_path)
        work = Path(tempfile.mkdtemp(prefix="accelpact-bench-scale-")).resolve()
        res["work_fs"] = h.fs_type(str(work))
        if res["work_fs"].startswith("tmpfs"):
            log(f"warning: the run directories are on {res['work_fs']}: the snapshots are held in memory there")
        t0 = time.monotonic()
        try:
            measure(args, work, log, res)
        except BaseException as exc:  # a deadline's SIGTERM too: what was measured is written beside
            res["error"] = f"{type(exc).__name__}: {exc}"
            res["wall_s"] = time.monotonic() - t0
            out = h.write_result(h.finish(res), json_path, failed=True)
            log(f"failed; wrote {out}")
            raise
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            else:
                log(f"work directory kept: {work}")
        res["wall_s"] = time.monotonic() - t0
        h.finish(res)
        summarize(res)
        out = h.write_result(res, json_path)
        log(f"wrote {out} ({res['wall_s']:.0f} s)")
    block = markdown(res)
    print(block)
    if args.markdown:
        print(f"[{PART}] updated {h.write_markdown(args.markdown, MARK, block)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
