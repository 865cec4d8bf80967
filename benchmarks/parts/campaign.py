"""The fault campaign as a benchmark part: ``scripts/campaign.py`` through its command line, summarized per kind.

``make bench`` runs ``scripts/campaign.py --runs 50 --seed 7`` (the decoder job, one fault per run, every run
checked against the uninterrupted run's digest, for temporary directories left and verified snapshots lost; see
``docs/campaign.md``) as a subprocess, its runs' directories under the raw results' directory, and reads back only
its ``--json`` record of every run: per run ``kind``, ``phase``, ``result`` (``bitwise``, ``stop: NAME`` or
``FAIL: reason``), ``passed`` and ``time_back_s`` (from the fault to the next committed update).  The summary is
one row per fault kind: runs, bitwise, named stops, failed, the median time back to training of the passed runs
with its min–max and sample count.

Usage::

    .venv/bin/python -m benchmarks.parts.campaign [--runs 50] [--seed 7] --json RAW.json
    .venv/bin/python -m benchmarks.parts.campaign --render RAW.json     (the section only)

Exit status: 0 when the campaign wrote its record (failed runs are results: the table names them), 1 when it
did not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import common as h  # noqa: E402

MARK = "<!-- campaign-bench -->"
CAMPAIGN = REPO / "scripts" / "campaign.py"

__all__ = ["main", "markdown", "summary_rows"]


def kinds(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per fault kind, in the order the runs first show it: runs, bitwise, named stops, failed, the
    phases drawn and the passed runs' time back to training (``h.spread``: median, min, max, n)."""
    out: dict[str, dict[str, Any]] = {}
    for r in res.get("runs") or []:
        k = out.setdefault(str(r.get("kind")), {"kind": str(r.get("kind")), "runs": 0, "bitwise": 0, "stops": 0,
                                                 "failed": 0, "phases": set(), "back": []})
        result = str(r.get("result") or "")
        k["runs"] += 1
        k["phases"].add(str(r.get("phase")))
        if result == "bitwise":
            k["bitwise"] += 1
        elif result.startswith("stop"):
            k["stops"] += 1
        if not r.get("passed") or result.startswith("FAIL"):
            k["failed"] += 1
        elif r.get("time_back_s") is not None:
            k["back"].append(float(r["time_back_s"]))
    return [dict(k, phases=sorted(k["phases"]), back=h.spread(k["back"])) for k in out.values()]


def _back(st: dict[str, Any]) -> str:
    return "-" if st.get("median") is None else f"{h.fmt_spread(st, '{:.2f}')} s (n {st['n']})"


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The overview's rows: one per kind; the ratio is the share of runs that passed."""
    return [{"what": f"fault campaign: {k['kind']} ({', '.join(k['phases'])})",
             "baseline": "the uninterrupted run's final_state_digest", "unit": "of runs",
             "ratio": (k["runs"] - k["failed"]) / k["runs"], "spread": None, "n": k["runs"],
             "note": f"{k['bitwise']} bitwise, {k['stops']} named stop(s), {k['failed']} failed; back to training "
                     f"{_back(k['back'])}"} for k in kinds(res)]


def markdown(res: dict[str, Any]) -> str:
    ks = kinds(res)
    runs = res.get("runs") or []
    failed = [r for r in runs if not r.get("passed") or str(r.get("result", "")).startswith("FAIL")]
    lines = [MARK, "## Fault campaign: one fault per run, every run checked", "",
             f"Written by `benchmarks/parts/campaign.py` on {res.get('date')} (`scripts/campaign.py --runs "
             f"{len(runs)} --seed {res.get('seed')}`; raw data: `{res.get('json', 'not kept')}`): the tiny decoder "
             f"job, one fault per run (`docs/campaign.md` names the kinds and how each is made); a run passes with "
             "the uninterrupted run's `final_state_digest` or a stop its kind documents, no temporary directory "
             f"left and no verified snapshot lost. {len(runs) - len(failed)} of {len(runs)} passed.", "",
             "| fault kind | phases | runs | bitwise | named stops | failed | time back to training, median (min–max) |",
             "|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {k['kind']} | {', '.join(k['phases'])} | {k['runs']} | {k['bitwise']} | {k['stops']} | "
              f"{k['failed']} | {_back(k['back'])} |" for k in ks]
    if failed:
        lines += ["", "Failed runs:", ""]
        lines += [f"- run {r.get('run')} {r.get('kind')} ({r.get('phase')}, update {r.get('update')}): "
                  f"{str(r.get('result'))[6:][:300]}" for r in failed]
    return "\n".join([*lines, "", MARK])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.output_args(ap, None, "where the campaign's record of every run goes (default runs/bench/<date>/campaign.json)")
    ap.add_argument("--runs", type=int, default=50, help="faults, one per run (default 50)")
    ap.add_argument("--seed", type=int, default=7, help="the campaign's seed (default 7)")
    args = ap.parse_args(argv)
    if args.render:
        print(markdown(h.read_result(args.render)))
        return 0
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: at least one run")
    raw = h.out_path(args.json or f"runs/bench/{h.today()}/campaign.json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    out = raw.with_name(raw.stem + "-runs")
    cmd = [sys.executable, str(CAMPAIGN), "--runs", str(args.runs), "--seed", str(args.seed), "--out", str(out),
           "--json", str(raw), "--markdown", ""]
    print("campaign: " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=REPO, check=False).returncode
    try:
        rec = json.loads(raw.read_text())
    except (OSError, ValueError) as exc:
        print(f"campaign: exit status {rc} and no readable record at {raw}: {exc}", file=sys.stderr)
        return 1
    res = h.new_result("campaign", seed=args.seed, runs=rec.get("runs") or [], campaign_rc=rc, json=h.json_field(raw))
    res["rows"] = summary_rows(res)
    h.write_result(h.finish(res), raw)
    print(f"campaign: {sum(k['runs'] - k['failed'] for k in kinds(res))} of {len(res['runs'])} runs passed "
          f"(scripts/campaign.py exit status {rc})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
