#!/usr/bin/env python3
"""The guard's per-update cost, the current code against an earlier commit's (default ``fb09a04``).

Between the two, the update's one vote moved: at ``fb09a04`` the guard runs at the end of the update
(boundary all-reduce on the replication group, then the world's vote over the control plane, after
``optimizer.step``); the current code runs the same two round trips in the optimizer's step pre-hook,
before any optimizer steps, and snapshots the RNG states as each update begins (for a redo).

Both versions run the same job: the decoder example's model, AdamW, schedule and data at the sizes of
``examples/decoder/job.yaml`` (2 emulated nodes x 2 ranks, FSDP1 ``HYBRID_SHARD``, Gloo), no snapshots,
the entry point ``benchmarks/parts/guard_entry.py`` (public API only: ``job.protect``, ``run.update``).  The
earlier commit is checked out with ``git worktree add --detach`` into a temporary directory and its job is
started from there (``python -m accelpact_slurm.cli.run`` with the worktree first on ``PYTHONPATH``), so its
launcher, runtime and guard are that commit's; the model, data and entry point are the same files.

Each job runs interleaved segments of plain updates (the update body without the guard) and guarded ones
(``with run.update()``); rank 0 times every update.  A round's ratio is the guarded segment's median update
over the plain segment's (robust to the load spikes of a shared machine); a job's *overhead ratio* is the
median over its rounds.  The same from whole segment times (barrier to barrier, the slowest rank) is
reported beside it.  Jobs alternate current, earlier, current, earlier, ...; pair ``i`` is the ``i``-th
job of each, and the figure is the median over pairs of current overhead ratio / earlier overhead ratio
(1.0: the same cost), with min-max.  The same ratio per
round (round ``r`` of both jobs of a pair) is reported beside it: its spread is the noise.

When the git history (or the commit) is not available the part reports that and measures nothing.

Output: ``--json`` (default ``runs/bench/<date>/guard.json``) and the block between
``<!-- guard-bench -->`` markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts' summaries).

Usage: .venv/bin/python benchmarks/parts/guard.py [--pairs 3] [--rounds 6] [--steps 8] [--commit fb09a04]
       .venv/bin/python benchmarks/parts/guard.py --render runs/bench/<date>/guard.json   (markdown only)

About 2 minutes here with the defaults (six jobs of 15-25 s; fewer pairs when the machine is so loaded
that a third would not fit in the budget).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as h  # noqa: E402

h.add_paths()

PART = "guard"
MARK = "<!-- guard-bench -->"
OLD_COMMIT = "fb09a04"
DEFAULT_BUDGET_S = 140.0
JOB_DEADLINE_S = 60.0
#: What a job must not inherit from the caller: it would think it runs inside Slurm, or take our settings.
SCRUB = ("SLURM_", "ACCELPACT_")

__all__ = ["main", "markdown"]


# ====================================================================== the earlier commit


def git(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(h.REPO), *args], capture_output=True, text=True, timeout=timeout,
                          check=False, stdin=subprocess.DEVNULL)


def checkout(commit: str, into: Path) -> tuple[str | None, str | None]:
    """``(full commit id, None)`` with ``commit`` checked out at ``into`` (a detached worktree), or ``(None, why)``."""
    try:
        rev = git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"git is not available ({exc})"
    if rev.returncode != 0:
        why = (rev.stderr.strip() or "").splitlines()
        return None, (f"commit {commit} is not in this checkout's git history (a copy without history, or a "
                      f"shallow clone){': ' + why[0] if why else ''}")
    full = rev.stdout.strip()
    add = git("worktree", "add", "--detach", str(into), full, timeout=120)
    if add.returncode != 0:
        return None, f"git worktree add failed: {(add.stderr.strip().splitlines() or ['?'])[-1]}"
    return full, None


def remove_worktree(path: Path) -> None:
    try:
        git("worktree", "remove", "--force", str(path))
    except (OSError, subprocess.SubprocessError):
        pass
    shutil.rmtree(path, ignore_errors=True)
    try:
        git("worktree", "prune")
    except (OSError, subprocess.SubprocessError):
        pass


# ====================================================================== one job


def write_job(path: Path, out: Path, plan: dict[str, Any]) -> Path:
    """The reference job's sections both versions know (the rest at their defaults), no snapshots, no faults."""
    import yaml

    from benchmarks.parts.workload import JOB_FILE, entry_of

    ref = yaml.safe_load(JOB_FILE.read_text())
    job = {"name": "guard-bench", "entry": entry_of("guard_entry"), "seed": ref["seed"], "steps": 1000,
           "log_every": 1_000_000, "topology": ref["topology"], "checkpoint": {"every_steps": 0},
           "timeouts": ref["timeouts"], "faults": [],
           "params": {**ref["params"], "bench": {**plan, "out": str(out)}}}
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_job(tree: Path, tag: str, work: Path, plan: dict[str, Any], deadline_s: float,
            extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """One job of the library in ``tree``; its segments and its overhead ratio (or ``error``).  ``extra_env``: set
    for the job after the caller's ``SLURM_*``/``ACCELPACT_*`` variables are scrubbed."""
    recs, res, log = launch(tree, tag, work, plan, deadline_s, extra_env)
    ready = next((r for r in recs if r.get("ev") == "ready"), {})
    segs = {(r["round"], r["mode"]): r for r in recs if r.get("ev") == "segment"}
    rounds = sorted({rd for rd, _ in segs if (rd, "plain") in segs and (rd, "guarded") in segs})
    res["library"] = ready.get("library")
    if not rounds or not any(r.get("ev") == "done" for r in recs):
        why = "its deadline passed" if res["rc"] is None else f"exit code {res['rc']}"
        return {**res, "ok": False, "error": f"{tag}: no complete run ({why}): {h.tail(log, 6, sep=' | ', limit=600)}"}
    g = {rd: segs[(rd, "guarded")] for rd in rounds}
    p = {rd: segs[(rd, "plain")] for rd in rounds}
    gm = {rd: h.med(g[rd]["dts"]) for rd in rounds}  # a segment's median update
    pm = {rd: h.med(p[rd]["dts"]) for rd in rounds}
    ratios = {rd: gm[rd] / pm[rd] for rd in rounds}
    seg_ratios = {rd: g[rd]["seg_s"] / p[rd]["seg_s"] for rd in rounds}
    return {**res, "ok": True, "ratios": [ratios[rd] for rd in rounds], "overhead": h.med(ratios.values()),
            "seg_ratios": [seg_ratios[rd] for rd in rounds], "overhead_seg": h.med(seg_ratios.values()),
            "guarded_ms": h.med(gm.values()) * 1e3, "plain_ms": h.med(pm.values()) * 1e3,
            "added_ms": h.med((gm[rd] - pm[rd]) * 1e3 for rd in rounds)}


def launch(tree: Path, tag: str, work: Path, plan: dict[str, Any], deadline_s: float,
           extra_env: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any], Path]:
    """Run one job of the library in ``tree`` to its end or its deadline: (rank 0's records, ``{"tag", "rc",
    "wall_s"}``, its log)."""
    out = work / f"{tag}.jsonl"
    cfg = write_job(work / f"{tag}.yaml", out, {**plan, "deadline_s": deadline_s})
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(h.REPO)])
    env["PYTHONUNBUFFERED"] = "1"
    log = work / f"{tag}.log"
    t0, rc = time.monotonic(), None
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", str(cfg), "--run-dir",
                                 str(work / f"run-{tag}")], cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        rc = proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if rc is None:  # its deadline passed, or this script was stopped: the job's whole session goes
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=10)
    wall = time.monotonic() - t0
    return h.read_jsonl(out), {"tag": tag, "rc": rc, "wall_s": round(wall, 1)}, log


# ====================================================================== analysis and report


def analyse(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pair ``i``: the ``i``-th complete job of each version."""
    new = [j for j in jobs if j["version"] == "current" and j["ok"]]
    old = [j for j in jobs if j["version"] == "earlier" and j["ok"]]
    pairs = list(zip(new, old))
    per_pair = [a["overhead"] / b["overhead"] for a, b in pairs]
    per_round = [x / y for a, b in pairs for x, y in zip(a["ratios"], b["ratios"])]

    def side(js: list[dict[str, Any]]) -> dict[str, Any]:
        return {k: h.spread(j[k] for j in js) for k in ("overhead", "overhead_seg", "added_ms", "plain_ms")}

    return {"pairs": [{"current": a["tag"], "earlier": b["tag"], "ratio": r} for (a, b), r in zip(pairs, per_pair)],
            "paired": h.spread(per_pair), "per_round": h.spread(per_round),
            "paired_seg": h.spread(a["overhead_seg"] / b["overhead_seg"] for a, b in pairs),
            "current": side(new), "earlier": side(old)}


def _added(side: dict[str, Any]) -> str:
    return f"{h.fmt(side['added_ms']['median'], '{:+.2f}')} ms on {h.fmt(side['plain_ms']['median'], '{:.0f}')} ms/update"


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    if res.get("skipped"):
        return [{"what": "guard's per-update cost, current code / earlier code", "baseline": f"commit {res['commit']}",
                 "ratio": None, "spread": None, "n": 0, "unit": "x", "note": f"not measured: {res['skipped']}"}]
    a = res["analysis"]
    c, e = a["current"], a["earlier"]
    return [
        h.row("guard's per-update cost (guarded / plain update), current code / earlier code",
              f"the same at commit {res['commit']} (vote after optimizer.step), paired jobs", a["paired"],
              note=f"per round {h.fmt_spread(a['per_round'], '{:.3f}')} (n {a['per_round']['n']}); segment times "
                   f"{h.fmt_spread(a['paired_seg'], '{:.3f}')}"),
        h.row("guarded / plain update, current code", "plain update, same ranks, interleaved segments",
              c["overhead"], note=_added(c)),
        h.row(f"guarded / plain update, commit {res['commit']}", "plain update, same ranks, interleaved segments",
              e["overhead"], note=_added(e)),
    ]


def markdown(res: dict[str, Any]) -> str:
    lines = [MARK, "## Guard: per-update cost against the earlier code", ""]
    lines.append(f"Written by `benchmarks/parts/guard.py` on {res['date']}"
                 + (f" (raw data: `{res['json']}`)" if res.get("json") else "") + ".")
    lines += ["", f"**Machine.** {h.machine_line(res['machine'])}. Shared and noisy: only same-run ratios mean "
                  "anything; absolute times are for reference.", ""]
    if res.get("skipped"):
        lines += [f"Not measured: {res['skipped']}.", "", MARK]
        return "\n".join(lines)
    p, a = res["plan"], res["analysis"]
    c, e = a["current"], a["earlier"]
    F = h.fmt_spread
    lines += [
        (f"**What ran.** The current code and the code of commit `{res['commit']}` (the update's vote at its end, "
         "after `optimizer.step`; now in the optimizer's step pre-hook, before any optimizer steps), each in its own "
         "jobs on the embedded default: 2 emulated nodes x 2 ranks, FSDP1 `HYBRID_SHARD`, Gloo, the decoder "
         "example's model, optimizer and data, no snapshots; the earlier commit from a detached `git worktree`, with "
         "its own launcher, runtime and guard. The entry point (`benchmarks/parts/guard_entry.py`) runs, after warm-up, "
         f"{p['rounds']} rounds of one plain and one guarded segment of {p['steps']} updates each (order "
         "alternating). A round's ratio is the guarded segment's median update time over the plain one's (rank 0's "
         "clock); a job's overhead ratio is the median over its rounds. Jobs alternate current, earlier, current, "
         f"earlier; {len(a['pairs'])} pairs, {res['total_wall_s']:.0f} s in all."),
        "",
        "| what | baseline | ratio, median (min–max) | n |",
        "|---|---|---|---|",
        (f"| guard's per-update cost, current / earlier | the same ratio of the earlier code, paired jobs | "
         f"**{F(a['paired'], '{:.3f}')}** | {a['paired']['n']} |"),
        (f"| the same, per round | round r of the earlier job of the pair | {F(a['per_round'], '{:.3f}')} | "
         f"{a['per_round']['n']} |"),
        (f"| the same, from whole segment times (barrier to barrier: the slowest rank) | the earlier code's, paired "
         f"jobs | {F(a['paired_seg'], '{:.3f}')} | {a['paired_seg']['n']} |"),
        f"| guarded / plain, current code | plain update, same job | {F(c['overhead'], '{:.3f}')} | {c['overhead']['n']} |",
        (f"| guarded / plain, commit `{res['commit']}` | plain update, same job | {F(e['overhead'], '{:.3f}')} | "
         f"{e['overhead']['n']} |"),
        "",
        (f"For reference: the guard adds {F(c['added_ms'])} ms per update now and {F(e['added_ms'])} ms at "
         f"`{res['commit']}`, on plain updates of {F(c['plain_ms'], '{:.0f}')} and {F(e['plain_ms'], '{:.0f}')} ms "
         "(medians over jobs, min–max). A ratio of 1 means the same cost; the per-round spread shows the noise."),
    ]
    failed = [j for j in res["jobs"] if not j["ok"]]
    if failed:
        lines += ["", "Jobs that did not complete (left out of the pairs): "
                  + "; ".join(f"{j['tag']}: {j.get('error', '?')[:200]}" for j in failed) + "."]
    lines += ["", MARK]
    return "\n".join(lines)


# ====================================================================== main


def build_parser() -> argparse.ArgumentParser:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="bench_guard.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    h.output_args(ap, f"runs/bench/{h.today()}/{PART}.json")
    ap.add_argument("--commit", default=OLD_COMMIT, help="the earlier code (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=3, help="job pairs, current and earlier (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=6, help="plain/guarded segment pairs per job (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=8, help="updates per segment (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="plain and guarded warm-up updates (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="start no job pair that would not fit (default: %(default)s s; lowered to "
                         "$ACCELPACT_BENCH_DEADLINE_S - 10 when that is set)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (job files, logs, records)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = h.logger("guard")
    if args.render:
        res = h.read_result(args.render)
        if h.write_markdown(args.markdown, MARK, markdown(res)) is None:
            print(markdown(res))
        return 0
    if min(args.pairs, args.rounds, args.steps) < 1 or args.warmup < 0:
        raise SystemExit("--pairs, --rounds and --steps must be >= 1, --warmup >= 0")
    budget = h.Budget(h.outer_deadline(args.budget_s, margin_s=10.0, floor_s=30.0))
    h.stop_on_signals("guard")  # unwind: the running job's process group is killed, the worktree removed
    plan = {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup}
    res = h.new_result(PART, json=h.json_field(args.json), commit=args.commit, plan=plan, jobs=[])
    work = Path(tempfile.mkdtemp(prefix="bench-guard-"))
    old_tree = work / "earlier"
    try:
        full, why = checkout(args.commit, old_tree)
        if full is None:
            log(f"cannot measure against commit {args.commit}: {why}; nothing measured")
            res["skipped"] = why
        else:
            res["commit_id"] = full
            trees = {"current": h.REPO, "earlier": old_tree}
            for i in range(args.pairs):
                if i and not budget.fits(2.1):  # a pair is two jobs; the longest job so far sets the pace
                    log(f"pair {i + 1}: would not fit in the {budget.budget_s:.0f} s budget; stopping at {i} pair(s)")
                    break
                for version in ("current", "earlier"):
                    left = budget.budget_s - budget.elapsed()
                    job = run_job(trees[version], f"{version}-{i}", work, plan, max(20.0, min(JOB_DEADLINE_S, left)))
                    job["version"] = version
                    budget.record(job["wall_s"])
                    res["jobs"].append(job)
                    log(f"pair {i + 1} {version}: " + (
                        f"guarded / plain {job['overhead']:.3f} ({job['added_ms']:+.2f} ms on {job['plain_ms']:.0f} "
                        f"ms/update; segments {job['overhead_seg']:.3f}), {job['wall_s']:.0f} s" if job["ok"]
                        else f"FAILED: {job['error']}"))
            res["analysis"] = analyse(res["jobs"])
            if not res["analysis"]["pairs"]:
                errors = "; ".join(j.get("error", "") for j in res["jobs"] if not j["ok"])[:1500]
                res["error"] = f"no complete pair of jobs: {errors}"
    finally:
        remove_worktree(old_tree)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"working directory kept: {work}")
    res["total_wall_s"] = budget.elapsed()
    h.finish(res)
    if res.get("error"):
        out = h.write_result(res, args.json, failed=True)
        log(f"FAILED: {res['error']} (written to {out})")
        return 1
    res["rows"] = summary_rows(res)
    out = h.write_result(res, args.json)
    log(f"result written to {out} ({res['total_wall_s']:.0f} s)")
    for r in res["rows"]:
        log(f"  {r['what']}: {h.fmt(r['ratio'], '{:.3f}')} ({r['spread']}, n {r['n']}) vs {r['baseline']}; "
            f"{r['note']}")
    h.write_markdown(args.markdown, MARK, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
