"""L1 backward benchmark, the command line and the schedule of runs (entry point: ``benchmarks/parts/l1backward.py``).

``l1backward_runs`` runs one of our jobs or one torchft experiment, ``l1backward_analysis`` turns them into
shares and timings, ``l1backward_report`` renders the markdown block.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.l1backward_analysis import detection, measured, outside, score, shares, summary_rows, verdicts
from benchmarks.parts.l1backward_report import MARK, PART, markdown
from benchmarks.parts.l1backward_runs import FAULT_U, FAULTS, STEP_FAULT, STEPS, XNODE_RANK

__all__ = ["build_parser", "main", "markdown"]

DEFAULT_BUDGET_S = 230


def build_parser(doc: str = "") -> argparse.ArgumentParser:
    head, _, rest = (doc or __doc__).partition("\n\n")
    ap = argparse.ArgumentParser(prog="bench_l1backward.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    h.output_args(ap, f"runs/bench/{h.today()}/l1backward.json")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of ours (backward fault) beside torchft, ABBA order (default: %(default)s)")
    ap.add_argument("--collective-timeout", type=float, default=2.0, metavar="S",
                    help="Gloo collective timeout, ours and torchft's process group (default: %(default)s)")
    ap.add_argument("--draws", type=int, default=10_000, help="random fault moments per run (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=20_240_611, help="seed of the random moments (default: %(default)s)")
    ap.add_argument("--no-torchft", action="store_true", help="ours only")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="start no run that would not fit (default: %(default)s s; lowered to "
                         "$ACCELPACT_BENCH_DEADLINE_S - 45 when that is set)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs, events, timings)")
    return ap


def _write_markdown(res: dict[str, Any], target: str) -> None:
    path = h.write_markdown(target, MARK, markdown(res))
    if path:
        print(f"[bench] markdown block written to {path}", flush=True)


#: The class runs besides the rounds, in order, and whether each must run: the boundary and the next update's
#: backward reproduce two of the three detection cases; the capture proof's fault, forward and the step fault
#: run when the budget allows.
EXTRA = (("boundary", True), ("next", True), ("xnode", False), ("forward", False), ("step", False))
REQUIRED = {cls for cls, req in EXTRA if req}


def schedule(repeats: int) -> list[tuple[str, int, bool]]:
    """(what, round, required) in order: each round's backward fault and torchft side by side (ABBA); the
    required class runs after the first round, one more class run after each later round, the rest at the end."""
    out: list[tuple[str, int, bool]] = []
    extra = [cls for cls, _ in EXTRA]
    for i in range(repeats):
        for what in h.abba(i, "backward", "torchft"):
            out.append((what, i, i == 0))
        take = [c for c in extra if c in REQUIRED] if i == 0 else extra[:1]
        for cls in take:
            extra.remove(cls)
            out.append((cls, 0, cls in REQUIRED))
    out += [(cls, 0, cls in REQUIRED) for cls in extra]
    return out


def params_of(args: argparse.Namespace, budget: float) -> dict[str, Any]:
    from accelpact_slurm.core.config import load_config
    from benchmarks.parts.workload import JOB_FILE, param_count

    base = load_config(JOB_FILE)
    m = base.params
    if args.collective_timeout >= base.timeouts.control_s:
        raise SystemExit("--collective-timeout must be shorter than the job file's timeouts.control_s")
    return {"repeats": args.repeats, "steps": STEPS, "fault_u": FAULT_U,
            "faults": {k: v for k, v in FAULTS.items() if v}, "step_fault": list(STEP_FAULT),
            "xnode_fault": [base.checkpoint.every_steps, XNODE_RANK],
            "collective_s": args.collective_timeout, "draws": args.draws, "seed": args.seed,
            "checkpoint_every": base.checkpoint.every_steps, "param_count": param_count(m),
            "model": {k: m[k] for k in ("layers", "width", "heads", "vocab", "seq_len", "batch_per_rank")},
            "budget_s": budget}


def torchft_venv(skip: bool, log: Callable[[str], None]) -> tuple[dict[str, Any], Path | None]:
    from benchmarks.parts.peers_runs import PEERS, VENVS
    from benchmarks.parts.peers_venvs import ensure_venv

    if skip:
        return {"status": "skipped", "reason": "--no-torchft"}, None
    try:
        info = ensure_venv("torchft", log)
    except OSError as exc:
        info = {"status": "skipped", "reason": f"its venv could not be built: {exc}"}
    info["pin"] = PEERS["torchft"]["title"]
    if info.get("status") != "ok":
        log(f"torchft skipped: {info.get('reason')}")
        return info, None
    return info, VENVS / "torchft" / "bin" / "python"


def main(argv: list[str] | None = None, doc: str = "") -> int:
    args = build_parser(doc).parse_args(argv)
    if args.render:
        res = h.read_result(args.render)
        _write_markdown(res, args.markdown)
        if not args.markdown:
            print(markdown(res))
        return 0
    if args.repeats < 1 or args.draws < 1:
        raise SystemExit("--repeats and --draws must be >= 1")
    budget_s = h.outer_deadline(args.budget_s, margin_s=45.0, floor_s=60.0)
    params = params_of(args, budget_s)
    h.stop_on_signals("bench")  # unwind, so the children are killed
    machine = h.machine()
    log = h.logger("bench", time.monotonic())
    budget = h.Budget(budget_s)
    work = Path(tempfile.mkdtemp(prefix="bench-l1backward-"))
    from benchmarks.parts.l1backward_runs import run_ours, run_torchft
    from benchmarks.parts.peers_runs import PROCS

    runs: list[dict[str, Any]] = []
    rounds: dict[int, dict[str, Any]] = {}
    skipped: list[str] = []
    try:
        tft, py = torchft_venv(args.no_torchft, log)
        for what, rnd, required in schedule(args.repeats):
            if what == "torchft" and py is None:
                continue
            if not required and not budget.fits():
                skipped.append(f"{what}{' round ' + str(rnd) if what in ('backward', 'torchft') else ''}")
                continue
            t0 = time.monotonic()
            if what == "torchft":
                r = run_torchft(py, args.collective_timeout, work, f"r{rnd}")
                r["name"] = f"torchft round {rnd}"
            else:
                tag = f"r{rnd}" if what == "backward" else "c"
                r = run_ours(what, args.collective_timeout, work, tag)
                r["name"] = f"{what} round {rnd}" if what == "backward" else what
            budget.record(time.monotonic() - t0)
            if what in ("backward", "torchft"):
                rounds.setdefault(rnd, {"round": rnd})["ours" if what == "backward" else "torchft"] = r
            if what != "torchft":
                runs.append(r)
            if r.get("ok"):
                extra = (f"detection -> commit {r['detect_to_commit_s']:.3f} s" if "detect_to_commit_s" in r
                         else f"outcome {r.get('outcome', '').upper()}")
                log(f"{r['name']}: {extra} ({r.get('wall_s', 0):.0f} s)")
            else:
                log(f"{r['name']}: FAILED: {r.get('error')}")
    finally:
        PROCS.kill_all()
    res: dict[str, Any] = {"part": PART, "date": h.today(), "machine": machine, "json": h.json_field(args.json),
                           "params": params, "torchft": tft, "skipped": skipped}
    res["shares"] = shares(runs, args.draws, args.seed, STEPS, args.collective_timeout)
    res["cases"] = verdicts(runs, res["shares"]["cases"])
    score(res["shares"], res["cases"], args.draws)
    res["measured"] = measured(runs)
    res["outside"] = outside(runs)
    res["detection"] = detection([rounds[k] for k in sorted(rounds)])
    res["rounds"] = [{"round": k, **{side: {key: v for key, v in x.items() if key != "timings"}
                                     for side, x in rounds[k].items() if side != "round"}} for k in sorted(rounds)]
    res["runs"] = [{k: v for k, v in r.items() if k != "timings"} for r in runs]
    res["total_wall_s"] = budget.elapsed()
    h.finish(res)
    missing = [cls for cls in ("backward", *sorted(REQUIRED)) if not any(r.get("class") == cls and r.get("ok")
                                                                         for r in runs)]
    if missing or res["detection"]["ours"]["detect_to_commit_s"]["n"] == 0 or not res["shares"]["per_run"]:
        res["error"] = (f"no run of {', '.join(missing)} ran to an outcome: see runs" if missing else
                        "no backward run measured detection -> commit, or no run's timings could be drawn from")
        out = h.write_result(res, args.json, failed=True)
        print(f"[bench] FAILED: {res['error']}; result in {out}; logs kept in {work}", file=sys.stderr, flush=True)
        return 1
    res["rows"] = summary_rows(res)
    out = h.write_result(res, args.json)
    if args.keep:
        log(f"working directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    log(f"result written to {out} ({res['total_wall_s']:.0f} s)")
    for r in res["rows"]:
        log(f"  {r['what']}: {h.fmt(r['ratio'], '{:.3f}')} ({r['spread']}) vs {r['baseline']}; {r['note']}")
    _write_markdown(res, args.markdown)
    return 0
