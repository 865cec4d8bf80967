"""Run the benchmarks on this machine and regenerate ``docs/benchmarks.md`` from their summaries (``make bench``).

Each part is a module of ``benchmarks.parts`` (:data:`PARTS`), run in turn as ``python -m benchmarks.parts.<part>
--json RAW --markdown ''`` under a wall-clock deadline (never two at once: the machine has 2 cores; SIGTERM at the
deadline, SIGKILL ``KILL_GRACE_S`` later).  Its raw result goes outside git, ``runs/bench/<date>/<part>.json``
(``$ACCELPACT_BENCH_RAW`` instead of ``runs/bench``); what the docs cite of it, its summary
(``benchmarks/harness/summary.py``), is written to ``benchmarks/summaries/<date>/<part>.json`` and the run's
record (machine, wall time, each part's status, commit and arguments) to ``benchmarks/summaries/<date>/run.json``.
A part that fails or passes its deadline is recorded with the tail of its output; the others still run.

``docs/benchmarks.md`` and the README's figures (between two ``<!-- bench-figures -->`` lines) are then written
from the committed summaries alone: each part's newest one.  ``tests/test_bench_figures.py`` checks both files
against them.

Usage::

    make bench                                            # every part, the fault campaign last
    make bench BENCH_ARGS="--parts store,control"         # some parts only (--parts campaign: the campaign only)
    .venv/bin/python -m benchmarks.harness.run --render   # only rewrite the docs and the README's figures
    .venv/bin/python -m benchmarks.harness.run --gpu-check RESULT.json   # summarize scripts/gpu_check.py's result

Exit status: 0 when every part that ran succeeded, 1 otherwise (the docs are regenerated in both cases).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import common as h  # noqa: E402
from benchmarks.harness import env, figures  # noqa: E402
from benchmarks.harness import summary as S  # noqa: E402
from benchmarks.harness.docs_tables import cell, generic_block, machine_desc, rows_table  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
GPU_SUMMARY = S.SUMMARIES / "gpu-check.json"
GPU_MARK = "<!-- gpu-check -->"


class Part(NamedTuple):
    name: str
    mark: str
    deadline_s: float
    title: str
    args: tuple[str, ...] = ()


# In the order of docs/benchmarks.md.  ``args``: what ``make bench`` gives the part beyond its defaults, trimmed
# so that the parts fit the budget (a part run alone with ``python -m benchmarks.parts.<part>`` keeps its
# defaults).  Seconds per part on this machine, from the committed runs (2026-11-30..12-05; a loaded day about
# 2x): status 8, repair 50-95, guard 41-85, store 133-250, control 70-198, paper 93-150, peers 151-235,
# l1backward 62-94, ckpt 315-590, shared 53-116, restore 63-153, recovery 387-618, nodeloss 261, launch 300-390:
# about 35 minutes; the fault campaign's 50 runs about 20 more.  Every goal stays decidable and every median keeps
# >= 2 samples (the reasons for each trim are in the git history of these lines).
PARTS = {p.name: p for p in (
    Part("repair", "<!-- repair-bench -->", 240, "L1 repair",
         ("--repairs", "24", "--rebind-reps", "2", "--guard-pairs", "8")),
    Part("guard", "<!-- guard-bench -->", 150, "Guard: per-update cost against the earlier code",
         ("--pairs", "2", "--rounds", "4", "--steps", "6")),
    Part("l1backward", "<!-- l1backward-bench -->", 240, "L1 backward: faults at random moments of the update",
         ("--repeats", "2")),
    Part("peers", "<!-- peers-bench -->", 400, "Against other recovery systems",
         ("--repeats", "2", "--overhead-rounds", "2", "--overhead-steps", "8")),
    Part("ckpt", "<!-- ckpt-bench -->", 720, "Checkpoint service",
         ("--modes", "none,ours,dcp_stager", "--rounds", "3", "--bw-pairs", "4", "--soak", "200")),
    Part("paper", "<!-- paper-experiment -->", 300, "L1 against L2: the paper's whole-run experiment",
         ("--repeats", "2")),
    Part("status", "<!-- status-bench -->", 120, "accelpact-status"),
    Part("shared", "<!-- shared-bench -->", 240, "Shared tier: what the uploads cost",
         ("--pairs", "2", "--steps", "24", "--warmup", "4")),
    Part("restore", "<!-- restore-bench -->", 300, "Node-loss restore: from a peer's copy or the shared tier",
         ("--rounds", "2", "--variants", "own,peer,shared")),
    Part("recovery", "<!-- recovery-bench -->", 900, "Recovery: from the fault to training again",
         ("--trials", "2", "--peer-trials", "1", "--cost-pairs", "0", "--toggle-alternations", "120",
          "--first-snapshot", "0", "--traffic-s", "3", "--detect-pairs", "3")),
    Part("store", "<!-- store-bench -->", 300, "The job's authenticated store: per-update cost against TCPStore",
         ("--toggle-alternations", "100", "--pairs", "2", "--rounds", "5", "--steps", "8", "--where-pairs", "2")),
    Part("control", "<!-- control-bench -->", 360,
         "The control plane at scale: one decision with 4 to 1,024 members", ("--samples", "3")),
    Part("nodeloss", "<!-- nodeloss-bench -->", 600, "Node loss: a spare's heal against L2",
         ("--trials", "3")),
    Part("launch", "<!-- launch-bench -->", 720, "The torchrun drop-in: changed lines and per-update cost",
         ("--trials", "5")),
    # The decoder at 185M (2 trials) and 298M parameters (1 trial), three jobs of 20 updates per trial; the one part
    # whose jobs fill most of the machine's memory (the 298M job's state, its staging in /dev/shm and its copies).
    Part("scale", "<!-- scale-bench -->", 3600, "Snapshots at the size people train: first snapshots, memory, reload"),
    # 50 runs of 14-27 s each here (tests/test_campaign.py's sample: 143-266 s for ten), one per kind in turn
    Part("campaign", "<!-- campaign-bench -->", 2100, "Fault campaign: one fault per run, every run checked",
         ("--runs", "50", "--seed", "7")),
)}
# Cheap and certain first; the checkpoint benchmark (the longest, the one that may run out of memory) after them;
# the jobs at the size people train after every other part's; the fault campaign last.
RUN_ORDER = ["status", "repair", "guard", "store", "control", "launch", "paper", "peers", "l1backward", "ckpt",
             "shared", "restore", "recovery", "nodeloss", "scale", "campaign"]
#: The README's bullets, in this order.
README_ORDER = ["store", "recovery", "nodeloss", "l1backward", "repair", "paper", "guard", "launch", "peers", "ckpt",
                "scale", "shared", "restore", "status", "control", "campaign"]
#: The goals table, in this order.
GOALS_ORDER = ["repair", "store", "launch", "l1backward", "ckpt", "scale", "recovery", "control", "status",
               "campaign"]
#: Parts whose block also shows another part's result: the peers' table of every system on every fault class
#: takes the recovery part's trials too (its newest raw result on this machine, when there is one).
RELATED = {"peers": ("recovery",)}
# a cap, not the usual time: the parts' 47.5 min budget, the scale part's 60 and the campaign's 35
TOTAL_BUDGET_S = 8550
KILL_GRACE_S = 45
MIN_START_S = 60  # a part is skipped when less time than this is left


def log(msg: str, t0: float | None = None) -> None:
    stamp = "" if t0 is None else f" {int((time.monotonic() - t0) // 60):02d}:{int((time.monotonic() - t0) % 60):02d}"
    print(f"[bench{stamp}] {msg}", flush=True)


def measured_commit() -> str:
    """``git rev-parse --short HEAD``, with ``+changes`` when tracked files other than the benchmark's own outputs
    differ from it; ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = [ln[3:] for ln in status.splitlines()
               if not ln[3:].startswith("benchmarks/summaries/") and ln[3:] not in ("docs/benchmarks.md", "README.md")]
    return head + ("+changes" if changed else "")


# ====================================================================== running a part


def run_part(part: Part, raw: Path, deadline_s: float, t0: float) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Run one part; returns (its raw result or None, the run record: status, wall_s, rc, error, tail)."""
    run: dict[str, Any] = {"deadline_s": round(deadline_s), "commit": measured_commit(), "args": list(part.args)}
    raw.parent.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(REPO), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    envv = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path, **{h.DEADLINE_VAR: str(int(deadline_s))})
    argv = [sys.executable, "-m", f"benchmarks.parts.{part.name}", "--json", str(raw), "--markdown", "", *part.args]
    start_wall, start = time.time(), time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=envv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            print(f"  {part.name}| {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    while True:
        try:
            proc.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:
            pass
        elapsed = time.monotonic() - start
        if elapsed > deadline_s and not timed_out:
            timed_out = True
            log(f"{part.name}: deadline {deadline_s:.0f} s passed: SIGTERM (SIGKILL in {KILL_GRACE_S} s)", t0)
            _signal(proc, signal.SIGTERM, group=False)
        elif timed_out and elapsed > deadline_s + KILL_GRACE_S:
            _signal(proc, signal.SIGKILL, group=True)
    _signal(proc, signal.SIGKILL, group=True)  # whatever the part left behind in its process group
    reader.join(timeout=10)
    run.update(wall_s=round(time.monotonic() - start, 1), rc=proc.returncode, tail="\n".join(tail))
    res, problem = None, None
    if timed_out:
        problem = f"deadline {deadline_s:.0f} s passed"
    elif proc.returncode != 0:
        problem = f"exit status {proc.returncode}"
    elif not raw.exists() or raw.stat().st_mtime < start_wall - 1:
        problem = f"exit status 0 but no {raw}"
    else:
        try:
            res = json.loads(raw.read_text())
        except (OSError, ValueError) as exc:
            problem = f"unreadable {raw}: {exc}"
        if res is not None and (not isinstance(res, dict) or res.get("error")
                                or res.get("exit_code") not in (None, 0)):
            problem, res = f"the part reports a failure: {(res or {}).get('error') or res}"[:300], None
    run.update(status="failed" if problem else "ok", **({"error": problem} if problem else {}))
    return res, run


def _signal(proc: subprocess.Popen[str], sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)  # the part's own session: start_new_session=True
        elif proc.poll() is None:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


# ====================================================================== from a raw result to its summary


def _module(name: str) -> Any:
    return importlib.import_module(f"benchmarks.parts.{name}")


def part_rows(name: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    """The part's overview rows: its ``summary_rows(res)`` when it exports one, else the rows in the result."""
    try:
        mod = _module(name)
        if "summary_rows" in getattr(mod, "__all__", ()):
            return mod.summary_rows(res)
    except Exception:  # noqa: BLE001 - a part that cannot compute its rows keeps the stored ones
        pass
    return res.get("rows") if isinstance(res.get("rows"), list) else []


def part_block(part: Part, res: dict[str, Any], related: dict[str, Any] | None) -> str:
    """The part's own block (its ``markdown(res)``, with ``related=`` for :data:`RELATED`); a generic one when
    that fails."""
    try:
        mod = _module(part.name)
        block = (mod.markdown(res) if related is None else mod.markdown(res, related=related)).strip()
        if block.count(part.mark) < 2:
            block = f"{part.mark}\n{block}\n{part.mark}"
        if not re.search(r"^## ", block, re.MULTILINE):
            block = block.replace(part.mark, f"{part.mark}\n## {part.title}", 1)
        return block
    except Exception as exc:  # noqa: BLE001 - any renderer failure falls back to the rows
        why = f"`benchmarks/parts/{part.name}.py` could not render its block ({type(exc).__name__}: {exc})"
        return generic_block(part.mark, f"{part.title} ({part.name})", res, why)


def for_related(res: dict[str, Any]) -> dict[str, Any]:
    """What another part's block reads of the recovery part's result (:data:`RELATED`), kept in its summary so
    that a part run alone finds it without the raw result: its date and file, the per-class summary, and the
    peers' trials (class, handled, seconds, why not)."""
    keep = ("cls", "handled", "recover_s", "not_handled_because")
    return {"date": res.get("date"), "json": res.get("json"), "summary": res.get("summary"),
            "peers": {name: [{k: t.get(k) for k in keep} for t in trials]
                      for name, trials in (res.get("peers") or {}).items() if isinstance(trials, list)}}


def summarize_part(part: Part, res: dict[str, Any], raw_root: Path) -> dict[str, Any]:
    names = RELATED.get(part.name)
    related = None
    if names:  # the newest raw result on this machine, else the committed summary's extract
        stored, committed = figures.stored_results(raw_root), S.newest()
        related = {n: stored[n][0] if n in stored else committed[n][0]["related"]
                   for n in names if n in stored or "related" in committed.get(n, ({}, ""))[0]}
    rows = part_rows(part.name, res)
    summ = S.summarize(part.name, res, rows, part_block(part, res, related), part.mark, raw_root,
                       rows if part.name == "peers" else None)
    if any(part.name in ns for ns in RELATED.values()):
        summ["related"] = for_related(res)
    return summ


def run_all(names: list[str], budget_s: float) -> dict[str, Any]:
    t0 = time.monotonic()
    date = time.strftime("%Y-%m-%d")
    record: dict[str, Any] = {"date": date, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "machine": env.machine(), "runs": {}, "warnings": []}
    log(f"{len(names)} part(s): {', '.join(names)}; budget {budget_s:.0f} s; raw results under {S.RAW / date}; "
        f"machine: {env.machine_line(record['machine'])}")
    for i, name in enumerate(names, 1):
        part = PARTS[name]
        left = budget_s - (time.monotonic() - t0)
        if left < MIN_START_S:
            record["runs"][name] = {"status": "skipped", "error": f"only {left:.0f} s of the budget left",
                                    "wall_s": 0.0, "rc": None}
            continue
        deadline = min(part.deadline_s, left)
        log(f"part {i}/{len(names)} {name}: start (deadline {deadline:.0f} s)", t0)
        res, run = run_part(part, S.RAW / date / f"{name}.json", deadline, t0)
        tail = run.pop("tail", "")
        if res is not None:
            try:
                S.write(S.SUMMARIES / date / f"{name}.json", summarize_part(part, res, S.RAW))
            except Exception as exc:  # noqa: BLE001 - a summary that cannot be made is a failed part
                run.update(status="failed", error=f"no summary: {type(exc).__name__}: {exc}")
        record["runs"][name] = run
        log(f"{name}: {run['status']} in {run['wall_s']:.0f} s" + (f" ({run['error']})" if run.get("error") else ""),
            t0)
        if run["status"] != "ok" and tail:
            print("\n".join(f"  {name}! {ln}" for ln in tail.splitlines()[-15:]), flush=True)
    record["total_wall_s"] = round(time.monotonic() - t0, 1)
    record["machine"]["loadavg_end"] = list(os.getloadavg())
    return record


def carry_over(record: dict[str, Any], path: Path) -> None:
    """Parts run earlier the same day and not now keep their run records (marked carried, with the start of the
    run that measured them: a record carried twice keeps the first one's)."""
    try:
        old = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return
    for name, run in (old.get("runs") or {}).items():
        if name not in record["runs"] and run.get("status") in ("ok", "carried"):
            first = run.get("carried_from") or old.get("started")
            record["runs"][name] = dict(run, status="carried", carried_from=first)


# ====================================================================== rendering from the summaries


def render(summaries: Path = S.SUMMARIES) -> str:
    """``docs/benchmarks.md`` from the committed summaries alone."""
    newest = S.newest(summaries)
    record, record_rel = S.last_run(summaries)
    runs = record.get("runs") or {}
    gpu = json.loads(GPU_SUMMARY.read_text()) if summaries == S.SUMMARIES and GPU_SUMMARY.exists() else None
    overview: list[str] = []
    sections: list[str] = []
    for part in PARTS.values():
        if part.name not in newest:
            overview.append(f"| `{part.name}` | not run yet: no summary | | | | | |")
            sections.append(f"{part.mark}\n## {part.title}\n\nNo summary committed yet: `make bench "
                            f"BENCH_ARGS=\"--parts {part.name}\"` writes it.\n{part.mark}")
            continue
        summ, rel = newest[part.name]
        run = runs.get(part.name) or {}
        when = ""
        if summ.get("date") != record.get("date") or run.get("status") not in ("ok", "carried"):
            when = f"from an earlier run ({summ.get('date', 'date unknown')}, `{rel}`)"
        elif run.get("status") == "carried":
            when = f"earlier run the same day ({run.get('carried_from')})"
        sections.append(S.section_text(summ["section"], part.mark))
        if summ.get("companion"):
            sections.append(summ["companion"])
        overview += S.overview_lines(part.name, summ, when) or [
            f"| `{part.name}` | (no summary rows; see its section) | | | | | {cell(when)} |"]
    if gpu is not None:
        sections.append(S.section_text(gpu["section"], GPU_MARK))
        overview += S.overview_lines("gpu-check", gpu, f"GPU machine, {gpu.get('date', '?')}")
    goals = [f"| `{p}` | {g} | {v} | {m} |" for p in GOALS_ORDER if p in newest for g, v, m in newest[p][0]["goals"]]
    m = record.get("machine") or {}
    end = m.get("loadavg_end")
    total = record.get("total_wall_s")
    ran = [n for n, r in runs.items() if r.get("status") != "carried"]
    status_line = ", ".join(
        f"{n} {r.get('status')} ({r.get('wall_s', 0):.0f} s"
        + (f", commit `{r['commit']}`" if r.get("commit") else "")
        + (f", `{' '.join(r['args'])}`" if r.get("args") else "") + ")" for n, r in runs.items())
    how = ("`make bench` runs every benchmark below on this machine, one part after the other (about 100 minutes: the "
           "parts about 35, the scale part's jobs at 185M and 298M parameters about 45, the fault campaign's 50 runs "
           "about 20), writes each part's raw result outside git "
           "(`runs/bench/<date>/<part>.json`, or under `$ACCELPACT_BENCH_RAW`) and its summary (the figures below, "
           "each with its spread and sample count) to `benchmarks/summaries/<date>/<part>.json`, and regenerates "
           "this file from the committed summaries alone. `make bench BENCH_ARGS=\"--parts store,control\"` runs "
           "some parts only; `.venv/bin/python -m benchmarks.harness.run --render` only rewrites this file. The run "
           "line names, for each part, the commit it measured (`+changes` when tracked files differed from it) and "
           "the arguments `make bench` gave it beyond its defaults (`PARTS` in `benchmarks/harness/run.py`: "
           "trimmed so that the parts fit the budget).")
    noise = ("The machine is shared and noisy. Every figure is therefore a ratio against a baseline measured in the "
             "same run, side by side (or the median of paired ratios, with min–max as the spread); absolute seconds "
             "are printed beside them for reference only and are never compared across runs.")
    last = (f"**Last run.** {record.get('date')} (`{record_rel}`), "
            f"{'n/a' if total is None else f'{total / 60:.1f} min'} for {len(ran)} part(s): {status_line or 'none'}.")
    load_end = f"; load average at the end {', '.join(f'{x:.1f}' for x in end)}" if end else ""
    legend = ("Each part's summary rows: what ran, the baseline it is divided by, the ratio (median) and its spread "
              "(min–max over n pairs or repeats). Details, absolute times and raw data in each part's section.")
    goals_block = [figures.GOALS_MARK, "## Goals", "",
                   "Every goal a stored result states, met or not, decided from the result, with the measured figure "
                   "and its cause where the result names one; a goal its result cannot decide says what it awaits.",
                   "", "| part | goal | verdict | measured |", "|---|---|---|---|", *goals, "", figures.GOALS_MARK]
    head = ["# Benchmarks", "",
            "<!-- Generated by benchmarks/harness/run.py from benchmarks/summaries/: edit the parts, not this file. -->",
            "", how, "", noise, "", last, "", f"**Machine.** {machine_desc(m)}{load_end}.", "", "## Overview", "",
            legend, "", *rows_table([], part_col="")[:2], *overview, "", "\n".join(goals_block)]
    return "\n".join(head) + "\n\n" + "\n\n".join(sections) + "\n"


def readme_block(summaries: Path = S.SUMMARIES) -> str:
    """The README's benchmark figures, between ``figures.README_MARK`` lines, from the summaries alone."""
    newest = S.newest(summaries)
    dates = sorted({str(s.get("date") or "?") for s, _rel in newest.values()})
    lines = ["Each bullet names its part; the run each comes from is in its section of "
             "[docs/benchmarks.md](docs/benchmarks.md) (stored results of " + ", ".join(dates) + "):", ""]
    lines += [newest[p][0]["readme"] for p in README_ORDER if p in newest and newest[p][0].get("readme")]
    gpu = json.loads(GPU_SUMMARY.read_text()) if GPU_SUMMARY.exists() else None
    if gpu and gpu.get("readme"):
        lines.append(gpu["readme"])
    return "\n".join([figures.README_MARK, "<!-- Generated by benchmarks/harness/run.py from benchmarks/summaries/: "
                      "edit the parts, not this block. -->", "", *[figures.wrap(x) for x in lines], "",
                      figures.README_MARK])


def _replace_file(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp.new")
    tmp.write_text(text)
    tmp.replace(path)


def write_docs(docs: Path = DOCS, readme: Path | None = README) -> None:
    _replace_file(docs, render())
    if readme is not None and readme.exists() and readme.read_text().count(figures.README_MARK) >= 2:
        _replace_file(readme, figures.replace_block(readme.read_text(), figures.README_MARK, readme_block()))


def summarize_gpu(path: Path) -> Path:
    """``scripts/gpu_check.py``'s result (written on a GPU machine) to its committed summary."""
    res = json.loads(path.read_text())
    from benchmarks.harness.docs_tables import gpu_block

    block = gpu_block(res, GPU_MARK, h.json_field(path))
    return S.write(GPU_SUMMARY, S.summarize("gpu-check", res, res.get("rows") or [], block, GPU_MARK))


def selected(parts: str | None) -> list[str]:
    """The parts ``--parts`` names, in its order (every part in :data:`RUN_ORDER` without it)."""
    names = [n.strip() for n in (parts or ",".join(RUN_ORDER)).split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise ValueError(f"--parts {parts!r}: unknown part(s) {', '.join(unknown) or '(none named)'}; the parts "
                         f"are {', '.join(RUN_ORDER)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", help=f"comma-separated parts to run, in this order (default: {','.join(RUN_ORDER)})")
    ap.add_argument("--render", action="store_true", help="run nothing: regenerate the docs from the summaries")
    ap.add_argument("--gpu-check", metavar="JSON", help="run nothing: summarize scripts/gpu_check.py's result")
    ap.add_argument("--docs", default=str(DOCS), help="the markdown file to regenerate (default docs/benchmarks.md)")
    ap.add_argument("--readme", default=str(README),
                    help="the README whose marked benchmark figures to regenerate (default README.md; '' = none)")
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S,
                    help=f"no part starts or runs past this many seconds from the start (default {TOTAL_BUDGET_S})")
    args = ap.parse_args(argv)
    docs, readme = Path(args.docs), (Path(args.readme) if args.readme else None)
    if args.gpu_check:
        log(f"wrote {summarize_gpu(Path(args.gpu_check))}")
    if args.render or args.gpu_check:
        write_docs(docs, readme)
        log(f"regenerated {docs}" + (f" and {readme}'s figures" if readme else "") + " from benchmarks/summaries/")
        return 0
    try:
        names = selected(args.parts)
    except ValueError as exc:
        ap.error(str(exc))
    record = run_all(names, args.budget_s)
    out = S.SUMMARIES / record["date"] / "run.json"
    carry_over(record, out)
    S.write(out, record)
    write_docs(docs, readme)
    for name, run in record["runs"].items():
        log(f"  {name:10s} {run.get('status'):8s} {run.get('wall_s', 0):6.0f} s  {run.get('error', '')}")
    return 1 if any(r.get("status") not in ("ok", "carried") for r in record["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
