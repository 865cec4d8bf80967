#!/usr/bin/env python3
"""Run every benchmark on this machine and regenerate ``docs/benchmarks.md`` (``make bench``).

Each part is ``scripts/bench_<part>.py`` (the paper's experiment is ``scripts/paper_experiment.py``), run in
turn as a subprocess of the project's Python with ``--json benchmarks/results/<date>/<part>.json
--markdown ''`` under a wall-clock deadline (never two at once: the machine has 2 cores).  A part that fails,
passes its deadline or has no script is recorded with the tail of its output; the others still run.  The
results are merged into ``benchmarks/results/<date>.json``::

    {"date", "started", "machine", "total_wall_s", "parts": {part: result | {"error", "tail", ...}},
     "runs": {part: {"status", "wall_s", "rc", "json"}}, "warnings"}

and ``docs/benchmarks.md`` is written from the stored results alone (``bench.figures.stored_results``: each
part's newest result under ``benchmarks/results/``, its own ``<date>/<part>.json`` before the merged copy): a
header with the machine, an overview table of every part's summary ``rows`` (what / baseline / ratio / spread / n /
note; ``summary_rows(res)`` of the part's script when it exports one, so rows are computed again from the stored
measurements), a table of every goal met or not (``bench.figures.goal_lines``), then each part's own block
(``markdown(res)`` of its script) in a fixed order: repair, guard, l1backward, peers, ckpt, paper, status, shared,
restore, recovery, store, control, and the GPU check when ``benchmarks/results/gpu-check.json`` exists.  A part
with no stored result keeps the block it has in the current ``docs/benchmarks.md``.  The README's benchmark
figures, between two ``<!-- bench-figures -->`` lines, are written from the same results
(``bench.figures.readme_lines``); ``tests/test_bench_figures.py`` checks both files against the committed results.

Parts that are not selected with ``--parts`` are carried over from an earlier merged file of the same date
when there is one.  The part contract is stated in ``scripts/bench/harness.py`` (the harness every part
shares); each part receives its deadline in ``ACCELPACT_BENCH_DEADLINE_S`` and gets SIGTERM when it passes
it (SIGKILL 45 s later).

Usage::

    make bench                                            # every part, about 26 minutes here
    make bench BENCH_ARGS="--parts paper,status"          # some parts only
    .venv/bin/python scripts/bench_all.py --render benchmarks/results/<date>.json   # only rewrite the docs + README

Exit status: 0 when every part that ran succeeded, 1 otherwise (the docs are regenerated in both cases).
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from bench import figures  # noqa: E402  (which result is each part's; the README's figures; the goals)
from bench.docs_tables import blocks_in, generic_block, gpu_block, machine_desc, rows_table  # noqa: E402
from bench.docs_tables import cell as _cell  # noqa: E402
from bench import harness as bl  # noqa: E402  (the benchmarks' shared harness)

RESULTS = bl.RESULTS
DOCS = bl.DOCS
README = REPO / "README.md"


class Part:
    def __init__(self, name: str, script: str, mark: str, deadline_s: float, title: str) -> None:
        self.name, self.script, self.mark, self.deadline_s, self.title = name, script, mark, deadline_s, title


# In the order of docs/benchmarks.md. Deadlines are hard limits; the parts' own budgets are smaller (several parts
# size their budget from the deadline: keep each at least ~1.4x the part's time on a slow day, see PART_ARGS).
PARTS = {p.name: p for p in (
    Part("repair", "bench_repair.py", "<!-- repair-bench -->", 240, "L1 repair"),
    Part("guard", "bench_guard.py", "<!-- guard-bench -->", 150, "Guard: per-update cost against the earlier code"),
    Part("l1backward", "bench_l1backward.py", "<!-- l1backward-bench -->", 240,
         "L1 backward: faults at random moments of the update"),
    Part("peers", "bench_peers.py", "<!-- peers-bench -->", 400, "Against other recovery systems"),
    Part("ckpt", "bench_ckpt.py", "<!-- ckpt-bench -->", 720, "Checkpoint service"),
    Part("paper", "paper_experiment.py", "<!-- paper-experiment -->", 300,
         "L1 against L2: the paper's whole-run experiment"),
    Part("status", "bench_status.py", "<!-- status-bench -->", 120, "accelpact-status"),
    Part("shared", "bench_shared.py", "<!-- shared-bench -->", 240, "Shared tier: what the uploads cost"),
    Part("restore", "bench_restore.py", "<!-- restore-bench -->", 300,
         "Node-loss restore: from a peer's copy or the shared tier"),
    Part("recovery", "bench_recovery.py", "<!-- recovery-bench -->", 900,
         "Recovery: from the fault to training again"),
    Part("store", "bench_store.py", "<!-- store-bench -->", 300,
         "The job's authenticated store: per-update cost against TCPStore"),
    Part("control", "bench_control.py", "<!-- control-bench -->", 360,
         "The control plane at scale: one decision with 4 to 1,024 members"),
)}
# Cheap and certain first; the checkpoint benchmark (the longest, and the one that may run out of memory) after
# them; the shared tier's cost last, with what is left of the budget (or alone: --parts shared).
RUN_ORDER = ["status", "repair", "guard", "store", "control", "paper", "peers", "l1backward", "ckpt", "shared", "restore",
             "recovery"]
GPU_MARK = "<!-- gpu-check -->"
GPU_JSON = RESULTS / "gpu-check.json"
# What ``make bench`` passes each part beyond ``--json``/``--markdown``: the parts' own defaults, trimmed so that the
# sum fits the budget (a part run alone keeps its defaults).  Estimated seconds per part, from the stored results'
# segment times at the rates of 2026-11-30..12-02 / at 2026-12-03's (a day on which the same code, the earlier
# commits' own jobs included, ran every update about 2x slower):
#   status 7/17, repair 95/95, guard 52/85, store 150/250, control 70/198, paper 110/150, peers 161/235,
#   l1backward 90/94, ckpt 315/590, recovery 387/618, shared 53/116, restore 63/153: about 1,450 s in all
#   (2,450 s on a day like 2026-12-03, past TOTAL_BUDGET_S: the last parts would then be cut).
# Every goal stays decidable (the ckpt part keeps none, ours and DCP's best asynchronous mode, dcp_stager in every
# stored run; recovery's first-snapshot goal needs a run alone: --first-snapshot 1 is a 110M job of ~170 s);
# every median keeps >= 2 samples.
PART_ARGS: dict[str, list[str]] = {
    # 24 repairs for its goal (three balanced cycles of 8: every group and faulting rank with its floor before and
    # after equally often; with 16 the median read 1.47 and 1.52 in two runs of the same engine; 45 s with 16 on
    # 2026-12-05); the rebinding sweep 4 -> 2 rounds, guard 16 -> 8 pairs
    "repair": ["--repairs", "24", "--rebind-reps", "2", "--guard-pairs", "8"],
    # 2 pairs (the budget stopped at 2 on 2026-12-03 anyway), 4 rounds of 6 updates per segment
    "guard": ["--pairs", "2", "--rounds", "4", "--steps", "6"],
    # 8 ABBA pairs against the earlier code, 2 of the store's server in a thread vs its own process; jobs of 5 rounds
    # of 8 updates per mode (6 x 8: 151 s for 5 pairs on 2026-12-04, 3 x 6 read 0.91-1.22 over three runs; with 4
    # pairs the same store code read 0.915, 1.079 and 1.044 in three runs: more pairs, ~90 s more)
    # 2026-12-05: the goal decided in one job instead (the control plane on our store and on a TCPStore in turn,
    # 100 alternations, ~45 s; the 8 job pairs read 0.997 (0.87-1.11), 1.016 the run before); 2 pairs against the
    # earlier code kept as context
    "store": ["--toggle-alternations", "100", "--pairs", "2", "--rounds", "5", "--steps", "8", "--where-pairs", "2"],
    # 3 samples at 4-256 members; 1,024 members always takes a warm-up + 3 samples (4 x 13-43 s of the old code)
    "control": ["--samples", "3"],
    "paper": ["--repeats", "2"],
    "peers": ["--repeats", "2", "--overhead-rounds", "2", "--overhead-steps", "8"],
    "l1backward": ["--repeats", "2"],
    # dcp_sync (no goal) and dcp_process (never the best asynchronous mode; the one that ran out of memory) left
    # out; 2 rounds; 4 bandwidth pairs (2 with the ceiling first, 2 second); the memory soak's goal is stated over
    # 200 snapshots (~100 s; a 50-snapshot soak, 31 s on 2026-12-04, read the warm-up as growth: 1.045)
    # 2026-12-05: 3 rounds (one timed snapshot per mode and round: with 2 one slow copy, 1.52 s against a 0.2 s
    # floor, decided the blocking goal; ~100 s per round), paid for by the store part's job pairs
    "ckpt": ["--modes", "none,ours,dcp_stager", "--rounds", "3", "--bw-pairs", "4", "--soak", "200"],
    # alone (its defaults: 5 trials, 3 per peer, the 110M job, 3 cost pairs) it takes 18 minutes; about 69 s of
    # it are fixed (the peers' venv checks and set-up) whatever the trials
    # the detector's own cost (its goal): on and off in turn in one job, 120 alternations of 2 + 2 updates (~55 s;
    # 100 read 1.008 (0.989-1.035) on 2026-12-05); the comparison with the code before the detector left out (job-to-
    # job noise: 2 pairs read 1.05 (0.91-1.19); with 2 pairs and 100 alternations the part took 485 s, too near the
    # ~500 s the budget leaves it as the last part)
    # 2026-12-05 (later): 3 extra pairs of ours and torchft on the stalled link in backward (~60 s), for the goal
    # detection -> next commit like for like (the rounds give it one pair)
    "recovery": ["--trials", "2", "--peer-trials", "1", "--cost-pairs", "0", "--toggle-alternations", "120",
                 "--first-snapshot", "0", "--traffic-s", "3", "--detect-pairs", "3"],
    "shared": ["--pairs", "2", "--steps", "24", "--warmup", "4"],
    # the mixed variant (no goal, not in the README) left out
    "restore": ["--rounds", "2", "--variants", "own,peer,shared"],
}
TOTAL_BUDGET_S = 1710  # 28.5 min: with one kill grace period still under 30 min
KILL_GRACE_S = 45
MIN_START_S = 60  # a part is skipped when less time than this is left
BIG_JSON = 1 << 20


def log(msg: str, t0: float | None = None) -> None:
    stamp = "" if t0 is None else f" {_mmss(time.monotonic() - t0)}"
    print(f"[bench{stamp}] {msg}", flush=True)


def _mmss(s: float) -> str:
    return f"{int(s // 60):02d}:{int(s % 60):02d}"


def measured_commit() -> str:
    """The commit the parts measure: ``git rev-parse --short HEAD``, with ``+changes`` when tracked files other
    than the benchmark's own outputs differ from it; ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = [ln[3:] for ln in status.splitlines()
               if not ln[3:].startswith("benchmarks/results/") and ln[3:] != "docs/benchmarks.md"]
    return head + ("+changes" if changed else "")


def part_of(name: str) -> Part:
    return PARTS.get(name) or Part(name, f"bench_{name}.py", f"<!-- {name}-bench -->", 300, name)


# ====================================================================== running


def run_part(part: Part, json_rel: str, deadline_s: float, t0: float) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Run one part; returns (its result or None, the run record: status, wall_s, rc, error, tail)."""
    script = REPO / "scripts" / part.script
    run: dict[str, Any] = {"json": json_rel, "deadline_s": round(deadline_s), "commit": measured_commit(),
                           "args": list(PART_ARGS.get(part.name, []))}
    if not script.exists():
        run.update(status="skipped", error=f"no script scripts/{part.script}", wall_s=0.0, rc=None, tail="")
        return None, run
    json_path = REPO / json_rel
    json_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", ACCELPACT_BENCH_DEADLINE_S=str(int(deadline_s)))
    argv = [sys.executable, str(script), "--json", json_rel, "--markdown", "", *run["args"]]
    start_wall, start = time.time(), time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                            start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            print(f"  {part.name}| {line}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out, next_beat = False, start + 60
    while True:
        try:
            proc.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - start > deadline_s and not timed_out:
            timed_out = True
            log(f"{part.name}: deadline {deadline_s:.0f} s passed: SIGTERM (SIGKILL in {KILL_GRACE_S} s)", t0)
            _signal(proc, signal.SIGTERM, group=False)
        elif timed_out and now - start > deadline_s + KILL_GRACE_S:
            _signal(proc, signal.SIGKILL, group=True)
        elif now >= next_beat:
            log(f"{part.name}: running, {_mmss(now - start)} elapsed (deadline {_mmss(deadline_s)})", t0)
            next_beat = now + 60
    _signal(proc, signal.SIGKILL, group=True)  # whatever the part left behind in its process group
    reader.join(timeout=10)
    run.update(wall_s=round(time.monotonic() - start, 1), rc=proc.returncode, tail="\n".join(tail))

    res, problem = None, None
    fresh = json_path.exists() and json_path.stat().st_mtime >= start_wall - 1
    failed_file = json_path.with_name(json_path.stem + "-failed.json")
    if timed_out:
        problem = f"deadline {deadline_s:.0f} s passed"
    elif proc.returncode != 0:
        problem = f"exit status {proc.returncode}"
    elif not fresh:
        problem = (f"its run failed (it wrote {failed_file.relative_to(REPO)})" if failed_file.exists()
                   and failed_file.stat().st_mtime >= start_wall - 1 else f"exit status 0 but no {json_rel}")
    else:
        try:
            res = json.loads(json_path.read_text())
        except (OSError, ValueError) as exc:
            res, problem = None, f"unreadable {json_rel}: {exc}"
        if res is not None and not isinstance(res, dict):
            res, problem = None, f"{json_rel} is not a JSON object"
    if res is not None and (res.get("error") or res.get("exit_code") not in (None, 0)):
        problem = f"the part reports a failure: {res.get('error') or 'exit_code ' + str(res.get('exit_code'))}"
        res = None
    if problem:
        run.update(status="failed", error=problem)
        return None, run
    size = json_path.stat().st_size
    run["json_bytes"] = size
    if size > BIG_JSON:
        run["warning"] = f"{json_rel} is {size / 2**20:.1f} MiB (over 1 MiB): keep raw data out of the result"
    res.setdefault("part", part.name)
    if not isinstance(res.get("rows"), list):
        run["warning"] = (run.get("warning", "") + "; " if run.get("warning") else "") + "no summary rows"
    run["status"] = "ok"
    return res, run


def _signal(proc: subprocess.Popen[str], sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)  # the part's own session: start_new_session=True
        elif proc.poll() is None:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_all(names: list[str], budget_s: float, deadlines: dict[str, float], results: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    date = time.strftime("%Y-%m-%d")
    merged: dict[str, Any] = {"date": date, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "machine": bl.machine(), "parts": {}, "runs": {}, "warnings": []}
    log(f"{len(names)} part(s): {', '.join(names)}; budget {_mmss(budget_s)}; machine: "
        f"{bl.machine_line(merged['machine'])}")
    for i, name in enumerate(names, 1):
        part = part_of(name)
        left = budget_s - (time.monotonic() - t0)
        json_rel = str((results / date / f"{name}.json").relative_to(REPO)) if results.is_relative_to(REPO) \
            else str(results / date / f"{name}.json")
        if left < MIN_START_S:
            run = {"status": "skipped", "error": f"only {left:.0f} s of the {budget_s:.0f} s budget left",
                   "wall_s": 0.0, "rc": None, "tail": "", "json": json_rel}
            res = None
        else:
            deadline = min(deadlines.get(name, part.deadline_s), left)
            log(f"part {i}/{len(names)} {name}: start (deadline {_mmss(deadline)})", t0)
            res, run = run_part(part, json_rel, deadline, t0)
        tail = run.pop("tail", "")
        merged["runs"][name] = run
        if res is not None:
            merged["parts"][name] = res
        else:
            merged["parts"][name] = {"part": name, "error": run["error"], "tail": tail[-4000:]}
        if run.get("warning"):
            merged["warnings"].append(f"{name}: {run['warning']}")
            log(f"{name}: warning: {run['warning']}", t0)
        log(f"{name}: {run['status']} in {run['wall_s']:.0f} s" + (f" ({run['error']})" if run.get("error") else ""), t0)
        if run["status"] != "ok" and tail:
            print("\n".join(f"  {name}! {ln}" for ln in tail.splitlines()[-15:]), flush=True)
    merged["total_wall_s"] = round(time.monotonic() - t0, 1)
    merged["machine"]["loadavg_end"] = list(os.getloadavg())
    return merged


def carry_over(merged: dict[str, Any], path: Path) -> None:
    """Parts not run now but in an earlier merged file of the same date are kept (marked carried)."""
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for name, res in (old.get("parts") or {}).items():
        if name in merged["parts"] or not isinstance(res, dict) or "error" in res:
            continue
        merged["parts"][name] = res
        run = dict((old.get("runs") or {}).get(name) or {})
        run.update(status="carried", carried_from=old.get("started") or old.get("date"))
        merged["runs"][name] = run


# ====================================================================== rendering


def _load_module(name: str, script: str) -> Any:
    path = REPO / "scripts" / script
    spec = importlib.util.spec_from_file_location(f"_bench_part_{name.replace('-', '_')}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_modules: dict[str, Any] = {}


#: Parts whose block also shows another part's result (``markdown(res, related={name: result})``): the peers'
#: table of every system on every fault class takes the recovery part's trials too.
RELATED = {"peers": ("recovery",)}


def _module(part: Part) -> Any:
    if part.name not in _modules:
        _modules[part.name] = _load_module(part.name, part.script)
    return _modules[part.name]


def related(name: str, stored: dict[str, tuple[dict[str, Any], str]]) -> dict[str, Any] | None:
    """The results ``RELATED`` names for part ``name`` (None when it names none)."""
    names = RELATED.get(name)
    return None if not names else {n: stored[n][0] for n in names if n in stored}


def part_rows(part: Part, res: dict[str, Any]) -> list[dict[str, Any]]:
    """The part's overview rows: its script's ``summary_rows(res)`` when it exports one (computed again from
    the stored measurements, so a result stored before a row changed shows it as the script reads it now),
    else the rows stored in the result."""
    try:
        fn = getattr(_module(part), "summary_rows", None)
        if callable(fn) and "summary_rows" in getattr(_module(part), "__all__", ()):
            return fn(res)
    except Exception:  # noqa: BLE001 - a part that cannot recompute its rows keeps the stored ones
        pass
    return res.get("rows") if isinstance(res.get("rows"), list) else []


def companion_blocks(res: dict[str, Any], results: Path) -> list[str]:
    """The control part's per-update result at 4 ranks (``<date>/control-update.json``), when stored."""
    upd = figures.companion(results, res, "control-update")
    path = results / str(res.get("date")) / "control-update.json"
    try:
        return [] if upd is None else [figures.control_update_block(
            upd, str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path))]
    except KeyError:
        return []


def part_markdown(part: Part, res: dict[str, Any], rel: dict[str, Any] | None = None) -> str:
    """The part's own block (``markdown(res)`` of its script, with ``related=`` the results ``RELATED`` names);
    a generic one when that is missing or fails."""
    try:
        mod = _module(part)
        block = (mod.markdown(res) if rel is None else mod.markdown(res, related=rel)).strip()
        if block.count(part.mark) < 2:
            block = f"{part.mark}\n{block}\n{part.mark}"
        if not re.search(r"^## ", block, re.MULTILINE):  # a part whose block leaves its heading to the docs
            block = block.replace(part.mark, f"{part.mark}\n## {part.title}", 1)
        return block
    except Exception as exc:  # noqa: BLE001 - any renderer failure falls back to the rows
        why = f"`scripts/{part.script}` could not render its block ({type(exc).__name__}: {exc})"
        return generic_block(part.mark, f"{part.title} ({part.name})", res, why)


def earlier_result(part: Part, block: str, results: Path) -> tuple[str | None, list[dict[str, Any]] | None]:
    """Date and rows of the stored result whose rendering is ``block``; else the block's first date, no rows."""
    cands: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(glob.glob(str(results / "*.json")), reverse=True):
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        res = (doc.get("parts") or {}).get(part.name) if "parts" in doc else None
        if res is None and Path(path).name.endswith(f"-{part.name}.json"):
            res = doc
        if isinstance(res, dict) and "error" not in res:
            cands.append((path, res))
    for path in sorted(glob.glob(str(results / "*" / f"{part.name}.json")), reverse=True):
        try:
            cands.append((path, json.loads(Path(path).read_text())))
        except (OSError, ValueError):
            continue
    for _path, res in cands:
        try:
            if part_markdown(part, res).strip() == block.strip():
                return res.get("date"), res.get("rows") if isinstance(res.get("rows"), list) else None
        except Exception:  # noqa: BLE001, S112 - a candidate that does not render is no match
            continue
    m = re.search(r"\b(20\d\d-\d\d-\d\d)\b", block)
    return (m.group(1) if m else None), None


def render(merged: dict[str, Any], current: str, results: Path) -> str:
    parts = merged.get("parts") or {}
    runs = merged.get("runs") or {}
    names = list(PARTS) + [n for n in parts if n not in PARTS]
    known = [part_of(n) for n in names]
    earlier = blocks_in(current, [p.mark for p in known] + [GPU_MARK])
    overview: list[str] = []
    sections: list[str] = []
    stored = figures.stored_results(results)
    for part in known:
        res = parts.get(part.name)
        run = runs.get(part.name) or {}
        when = ""
        if part.name in stored:  # the part's newest stored result: its own file wins over the merged copy
            res, rel = stored[part.name]
            if res.get("date") != merged.get("date") or run.get("status") not in ("ok", "carried"):
                when = f"from an earlier run ({res.get('date', 'date unknown')}, `{rel}`)"
        ok = isinstance(res, dict) and "error" not in res
        if ok:
            if not when and run.get("status") == "carried":
                when = f"earlier run the same day ({run.get('carried_from')})"
            sections.append(part_markdown(part, res, related(part.name, stored)))
            if part.name == "control":
                sections += companion_blocks(res, results)
            rows = part_rows(part, res)
            if rows:
                for r in rows:
                    r = dict(r)
                    if when:
                        r["note"] = f"{when}; {r.get('note') or ''}".rstrip("; ")
                    overview.append(rows_table([r], part_col=f"`{part.name}`")[-1])
            else:
                overview.append(f"| `{part.name}` | (no summary rows in the result; see its section) | | | | | "
                                f"{_cell(when)} |")
            continue
        why = (res or {}).get("error") if isinstance(res, dict) else None
        this_run = f"not measured in this run ({why})" if why else "not run this time"
        if part.mark in earlier:
            block = earlier[part.mark]
            date, rows = earlier_result(part, block, results)
            tag = f"from an earlier run ({date or 'date unknown'}); {this_run}"
            if not re.search(r"^## ", block, re.MULTILINE):  # an older block that had its heading outside
                block = block.replace(part.mark, f"{part.mark}\n## {part.title}", 1)
            sections.append(block)
            if rows:
                for r in rows:
                    r = dict(r, note=f"{tag}; {r.get('note') or ''}".rstrip("; "))
                    overview.append(rows_table([r], part_col=f"`{part.name}`")[-1])
            else:
                overview.append(f"| `{part.name}` | section kept {_cell(tag)} | | | | | |")
        elif why:
            title = part.title if part.title == part.name else f"{part.title} ({part.name})"
            sections.append(f"## {title}\n\nNot measured: {_cell(why)}. No earlier result.")
            overview.append(f"| `{part.name}` | not measured: {_cell(why)}; no earlier result | | | | | |")
        else:
            overview.append(f"| `{part.name}` | not run yet: no result | | | | | |")
    gpu = gpu_result()
    if gpu is not None:
        sections.append(gpu_block(gpu, GPU_MARK, str(GPU_JSON.relative_to(REPO))))
        for r in gpu.get("rows") or []:
            r = dict(r, note=f"GPU machine, {gpu.get('date', '?')}; {r.get('note') or ''}".rstrip("; "))
            overview.append(rows_table([r], part_col="`gpu-check`")[-1])
    elif GPU_MARK in earlier:
        sections.append(earlier[GPU_MARK])
        overview.append("| `gpu-check` | section kept from an earlier GPU run | | | | | |")

    m = merged.get("machine") or {}
    end = m.get("loadavg_end")
    total = merged.get("total_wall_s")
    ran = [n for n, r in runs.items() if r.get("status") not in ("carried",)]
    status_line = ", ".join(
        f"{n} {r.get('status')} ({r.get('wall_s', 0):.0f} s"
        + (f", commit `{r['commit']}`" if r.get("commit") else "")
        + (f", `{' '.join(r['args'])}`" if r.get("args") else "") + ")"
        for n, r in runs.items())
    how = ("`make bench` runs every benchmark below on this machine, one part after the other (under 30 minutes), "
           "writes `benchmarks/results/<date>.json` (each part's own result under `benchmarks/results/<date>/`) and "
           "regenerates this file from it. `make bench BENCH_ARGS=\"--parts paper,status\"` runs some parts only; "
           "`.venv/bin/python scripts/bench_all.py --render benchmarks/results/<date>.json` only rewrites this file. "
           "The run line names, for each part, the commit it measured (`+changes` when tracked files differed from "
           "it) and the arguments `make bench` gave it beyond its defaults (`PART_ARGS` in the script: trimmed so "
           "that the parts fit the budget).")
    noise = ("The machine is shared and noisy. Every figure is therefore a ratio against a baseline measured in the "
             "same run, side by side (or the median of paired ratios, with min–max as the spread); absolute seconds "
             "are printed beside them for reference only and are never compared across runs.")
    last = (f"**Last run.** {merged.get('date')} (`benchmarks/results/{merged.get('date')}.json`), "
            f"{'n/a' if total is None else f'{total / 60:.1f} min'} for {len(ran)} part(s): {status_line or 'none'}.")
    load_end = f"; load average at the end {', '.join(f'{x:.1f}' for x in end)}" if end else ""
    legend = ("Each part's summary rows: what ran, the baseline it is divided by, the ratio (median) and its spread "
              "(min–max over n pairs or repeats). Details, absolute times and raw data in each part's section.")
    head = [
        "# Benchmarks",
        "",
        "<!-- Generated by scripts/bench_all.py from benchmarks/results/<date>.json: edit the scripts, not this file. -->",
        "",
        how,
        "",
        noise,
        "",
        last,
        "",
        f"**Machine.** {machine_desc(m)}{load_end}.",
        "",
        "## Overview",
        "",
        legend,
        "",
        *rows_table([], part_col="")[:2],
        *overview,
        "",
        figures.goals_block(stored, results),
    ]
    return "\n".join(head) + "\n\n" + "\n\n".join(sections) + "\n"


def gpu_result() -> dict[str, Any] | None:
    """The committed GPU check's result (``benchmarks/results/gpu-check.json``), None when absent or unreadable."""
    try:
        gpu = json.loads(GPU_JSON.read_text()) if GPU_JSON.exists() else None
    except (OSError, ValueError):
        return None
    return gpu if isinstance(gpu, dict) else None


def readme_block(results: Path) -> str:
    """The README's benchmark figures, between ``figures.README_MARK`` lines, from the stored results alone."""
    stored = figures.stored_results(results)
    peer_rows = part_rows(part_of("peers"), stored["peers"][0]) if "peers" in stored else None
    lines = figures.readme_lines(stored, gpu_result(), peer_rows)
    return "\n".join([figures.README_MARK,
                      "<!-- Generated by scripts/bench_all.py from benchmarks/results/: edit the scripts, not "
                      "this block. -->", "", *lines, "", figures.README_MARK])


def _replace_file(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.new")
    tmp.write_text(text)
    tmp.replace(path)


def write_docs(merged: dict[str, Any], docs: Path, results: Path, readme: Path | None = README) -> None:
    """Regenerate ``docs`` and, when it has the marked block, ``readme``'s benchmark figures."""
    current = docs.read_text() if docs.exists() else ""
    _replace_file(docs, render(merged, current, results))
    if readme is not None and readme.exists() and readme.read_text().count(figures.README_MARK) >= 2:
        _replace_file(readme, figures.replace_block(readme.read_text(), figures.README_MARK, readme_block(results)))


# ====================================================================== main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", help=f"comma-separated parts to run, in this order (default: {','.join(RUN_ORDER)})")
    ap.add_argument("--render", metavar="JSON", help="only regenerate the docs from a merged result file")
    ap.add_argument("--docs", default=str(DOCS), help="the markdown file to regenerate (default docs/benchmarks.md)")
    ap.add_argument("--readme", default=str(README),
                    help="the README whose marked benchmark figures to regenerate (default README.md; '' = none)")
    ap.add_argument("--results", default=str(RESULTS), help="results directory (default benchmarks/results)")
    ap.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S,
                    help=f"no part starts or runs past this many seconds from the start (default {TOTAL_BUDGET_S})")
    ap.add_argument("--deadline", action="append", default=[], metavar="PART=S",
                    help="override one part's deadline in seconds (repeatable)")
    args = ap.parse_args(argv)
    results, docs = Path(args.results).resolve(), Path(args.docs)
    readme = Path(args.readme) if args.readme else None
    if args.render:
        merged = json.loads(Path(args.render).read_text())
        write_docs(merged, docs, results, readme)
        log(f"regenerated {docs}" + (f" and {readme}'s figures" if readme else "") + f" from {args.render}")
        return 0
    names = [n.strip() for n in (args.parts or ",".join(RUN_ORDER)).split(",") if n.strip()]
    deadlines = {}
    for spec in args.deadline:
        name, _, secs = spec.partition("=")
        deadlines[name.strip()] = float(secs)
    merged = run_all(names, args.budget_s, deadlines, results)
    out = results / f"{merged['date']}.json"
    carry_over(merged, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    size = out.stat().st_size
    if size > BIG_JSON:
        log(f"warning: {out} is {size / 2**20:.1f} MiB (over 1 MiB)")
    write_docs(merged, docs, results, readme)
    log(f"wrote {out} and regenerated {docs} in {_mmss(merged['total_wall_s'])}")
    bad = {n: r for n, r in merged["runs"].items() if r.get("status") not in ("ok", "carried")}
    for name, run in merged["runs"].items():
        log(f"  {name:8s} {run.get('status'):8s} {run.get('wall_s', 0):6.0f} s  {run.get('error', '')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
