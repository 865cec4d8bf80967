"""Recovery benchmark: orchestration, analysis and the markdown block (``scripts/bench_recovery.py``)."""

from __future__ import annotations

import argparse
import importlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench import harness as h
from bench import recovery_runs as rr

PART = "recovery"
MARK = "<!-- recovery-bench -->"
DEFAULT_BUDGET_S = 600.0
#: The commit before the detector (the code it is compared with for its per-update cost).
BEFORE = "d4de086"
TITLES = {
    "link-boundary": "link fault at the boundary (stalled: every member inside the collective)",
    "link-backward": "link fault in backward (stalled replication all-reduce)",
    "kill": "SIGKILL of a rank",
    "stop": "SIGSTOP of a rank (hung)",
    "bug": "a training-code exception (to the job's exit)",
    "daemon-kill": "SIGKILL of a checkpoint daemon",
}
GOALS = {
    "link-boundary": "≤ 1.0 s plus the redone update, independent of collective_s",
    "link-backward": "≤ 1.0 s plus the redone update, independent of collective_s",
    "kill": "detected ≤ 0.5 s; training again ≤ 5 s (L2)",
    "stop": "≤ heartbeat_s + 1 s to the fail_stop, stacks in the log",
    "bug": "one start, exit ≤ 1 s after the exception",
    "daemon-kill": "training goes on",
}


def _torchft() -> Any:
    """``bench.recovery_torchft`` when it is there (torchft driving the same FSDP HSDP model), else None."""
    try:
        return importlib.import_module("bench.recovery_torchft")
    except ImportError:
        return None


def run(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from accelpact_slurm.core.config import load_config
    from bench.workload import JOB_FILE

    budget = h.Budget(h.outer_deadline(args.budget_s, margin_s=20.0, floor_s=60.0))
    defaults = load_config(JOB_FILE).timeouts
    res = h.new_result(PART, json=h.json_field(args.json), plan={"trials": args.trials, "U": rr.U, "steps": rr.STEPS,
                       "every": rr.EVERY, "classes": list(args.classes)},
                       timeouts={k: getattr(defaults, k) for k in ("collective_s", "control_s", "heartbeat_s",
                                                                    "heartbeat_interval_s", "link_floor_s",
                                                                    "shutdown_s")},
                       trials=[], torchft=[], traffic=None, cost=None)
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    ft = _torchft() if args.torchft else None
    try:
        for i in range(args.trials):
            for cls in h.rotate(args.classes, i):  # every class in every round, the order rotated
                if i and not budget.fits():
                    log(f"round {i + 1}: {cls} would not fit the budget; stopping")
                    break
                t = rr.run_ours(cls, work, f"{i}")
                budget.record(t["wall_s"])
                res["trials"].append(t)
                log(f"round {i + 1} ours {cls}: " + (f"{t['recover_s']:.2f} s (slowest rank)" if t.get("ok")
                                                      else f"FAILED {t.get('error', '')[:300]}"))
                if ft is not None and cls in getattr(ft, "FAULTS", ()) and budget.fits():
                    f = ft.run_trial(ft.FAULTS[cls], step=rr.U, rank=1, workdir=work / f"torchft-{cls}-{i}",
                                     timeout_s=90.0)
                    f["cls"] = cls
                    res["torchft"].append(f)
                    log(f"round {i + 1} torchft {cls}: {f.get('recover_s')} ({f.get('handled')})")
        if args.traffic and budget.fits(0.5):
            from bench.recovery_traffic import scaling

            res["traffic"] = scaling(seconds=args.traffic_s)
            log("traffic: " + ", ".join(f"{t['ranks']} ranks {t['writes_per_s']:.0f} writes/s" for t in res["traffic"]))
    finally:
        if args.keep:
            log(f"working directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    res["summary"] = rr.summary(res["trials"])
    res["total_wall_s"] = budget.elapsed()
    return res


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    s = res["summary"]
    for cls in res["plan"]["classes"]:
        c = s[cls]
        rows.append({"what": f"recovery: {TITLES[cls]}", "baseline": "seconds, slowest rank (absolute)",
                     "ratio": c["recover_s"]["median"], "spread": None if c["recover_s"]["median"] is None else
                     f"{h.fmt(c['recover_s']['min'])}–{h.fmt(c['recover_s']['max'])}", "n": c["recover_s"]["n"],
                     "unit": "s", "note": f"goal {GOALS[cls]}"})
    return rows


def markdown(res: dict[str, Any]) -> str:
    F = h.fmt_spread
    t = res["timeouts"]
    lines = [MARK, "## Recovery: from the fault to training again", "",
             f"Written by `scripts/bench_recovery.py` on {res['date']}"
             + (f" (raw data: `{res['json']}`)" if res.get("json") else "") + ".", "",
             f"**Machine.** {h.machine_line(res['machine'])}. Shared and noisy: absolute seconds, for the goals; "
             "the spread is over trials.", "",
             (f"**What ran.** Per fault class, {res['plan']['trials']} trials of `accelpact-run` on the embedded "
              f"default (2 emulated nodes x 2 ranks, the decoder example, FSDP1 `HYBRID_SHARD`, a snapshot every "
              f"{res['plan']['every']} updates), the fault at update {res['plan']['U']}, the shipped default timeouts "
              f"(collective_s {t['collective_s']:g}, control_s {t['control_s']:g}, heartbeat_s {t['heartbeat_s']:g}, "
              f"heartbeat_interval_s {t['heartbeat_interval_s']:g}, link_floor_s {t['link_floor_s']:g}). Every rank "
              "records its commits (`scripts/bench/recovery_entry.py`); a trial's figure is the slowest rank's time "
              "from the injection (the faulting rank's own record just before it) to its next committed update; "
              "for a bug, to the job's exit."), "",
             "| fault | ours: injection → next commit, slowest rank, median (min–max) | detected (first fail_stop) | "
             "restarts | cause | goal |", "|---|---|---|---|---|---|"]
    for cls in res["plan"]["classes"]:
        c = res["summary"][cls]
        lines.append(f"| {TITLES[cls]} | **{F(c['recover_s'])} s** (n {c['recover_s']['n']}) | "
                     f"{F(c['detected_s'])} s | {c['restarts']} | {', '.join(c['causes']) or '-'} | {GOALS[cls]} |")
    failed = [(cls, e) for cls in res["plan"]["classes"] for e in res["summary"][cls]["failed"]]
    if failed:
        lines += ["", "Trials that failed: " + "; ".join(f"{c}: {e}" for c, e in failed[:6]) + "."]
    if res.get("torchft"):
        lines += ["", "torchft, driving the same FSDP HSDP model on the same four ranks (`scripts/bench/"
                      "recovery_torchft.py`):", "", "| fault | torchft: injection → next commit, slowest rank | "
                      "handled | n |", "|---|---|---|---|"]
        for cls in res["plan"]["classes"]:
            ts = [x for x in res["torchft"] if x.get("cls") == cls]
            if ts:
                lines.append(f"| {TITLES[cls]} | {F(h.spread(x.get('recover_s') for x in ts))} s | "
                             f"{'; '.join(sorted({str(x.get('handled')) for x in ts}))[:200]} | {len(ts)} |")
    if res.get("traffic"):
        lines += ["", "The heartbeat path alone (no training): N publishers against one store host, "
                      f"interval {res['traffic'][0]['interval_s']:g} s (`scripts/bench/recovery_traffic.py`):", "",
                  "| ranks | writes/s | per rank | bytes/s | store host CPU s/s | per rank |", "|---|---|---|---|---|---|"]
        for x in res["traffic"]:
            lines.append(f"| {x['ranks']} | {x['writes_per_s']:.0f} | {x['writes_per_s_per_rank']:.2f} | "
                         f"{x['bytes_per_s']:.0f} | {x['host_cpu_s_per_s']:.4f} | {x['host_cpu_per_rank']:.2e} |")
    lines += ["", MARK]
    return "\n".join(lines)


def build_parser(doc: str) -> argparse.ArgumentParser:
    head, _, rest = doc.partition("\n\n")
    ap = argparse.ArgumentParser(prog="bench_recovery.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    h.output_args(ap, f"benchmarks/results/{h.today()}/{PART}.json")
    ap.add_argument("--trials", type=int, default=5, help="trials per fault class (default: %(default)s)")
    ap.add_argument("--classes", default=",".join(rr.CLASSES), type=lambda s: [c for c in s.split(",") if c],
                    help="fault classes (default: all: %(default)s)")
    ap.add_argument("--no-torchft", dest="torchft", action="store_false", help="leave torchft out")
    ap.add_argument("--no-traffic", dest="traffic", action="store_false", help="leave the heartbeat scaling out")
    ap.add_argument("--traffic-s", type=float, default=6.0, help="seconds per size (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="start no trial that would not fit (default: %(default)s s; lowered to "
                         "$ACCELPACT_BENCH_DEADLINE_S - 20 when that is set)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    return ap


def main(argv: list[str] | None = None, doc: str = "") -> int:
    args = build_parser(doc).parse_args(argv)
    log = h.logger(PART)
    if args.render:
        res = h.read_result(args.render)
        if h.write_markdown(args.markdown, MARK, markdown(res)) is None:
            print(markdown(res))
        return 0
    bad = [c for c in args.classes if c not in rr.CLASSES]
    if bad or args.trials < 1:
        raise SystemExit(f"--classes: unknown {bad} (choose from {', '.join(rr.CLASSES)}); --trials must be >= 1")
    h.stop_on_signals(PART)
    res = run(args, log)
    h.finish(res)
    res["rows"] = summary_rows(res)
    out = h.write_result(res, args.json)
    log(f"written to {out}")
    if h.write_markdown(args.markdown, MARK, markdown(res)) is None and args.markdown != "":
        print(markdown(res))
    return 0
