"""The torchrun drop-in: what protecting a torchrun script changes in it, and what the launch path costs an update.

(a) For each torchrun example (``examples/torchrun/``: the argparse script and the Hydra one) the number of lines
its protected script changes against its plain original (:func:`changed_lines`): substantive lines only -- blank
lines and comments are ignored, indentation and spacing too (``diff -w``) -- counted on the protected side (a line
added or rewritten; the plain lines it replaces are counted apart, as removed).  ``tests/examples/
test_torchrun_diffs.py`` holds every example to at most :data:`MAX_CHANGED` with this same function.

(b) The per-update time of the protected script under ``accelpact-run --nnodes 2 --nproc-per-node 2`` against its
plain original under plain ``torchrun`` on the same 2 x 2 layout (two torchrun agents, ``--nnodes 2
--nproc-per-node 2``, on this machine: the same ``("replicate", "shard")`` mesh, so the same work per update),
in ABBA order, ``--trials`` pairs.  With ``--with-1x4``, ``torchrun --nproc-per-node 4`` (one agent: a 1 x 4 mesh,
no replication group, so less communication per update) runs beside them as a reference.  Both scripts run
under one timing hook (``benchmarks/parts/launch_timer.py``, each launcher's module form ``-m``): torch's global
optimizer-step hooks, on every rank, at the same places in both runs; the first ``--warmup`` updates are left
out.  An update is the interval from one ``optimizer.step()``'s return to the next one's, and splits into the
optimizer's own pre-hooks (under ``accelpact-run`` the update's vote; nothing under torchrun), the step itself,
and the rest (zero_grad, the update's end, the next batch, forward, backward).  Rank 0's ``step`` events of the
protected run (``step_s``) are compared with the hook's rank 0 as a check of the hook.  Each segment is also
timed in the training thread's CPU time: on this shared 2-core machine the wall-clock ratio moves with the other
work on it from one run to the next, the CPU time much less.

Usage::

    .venv/bin/python -m benchmarks.parts.launch [--trials 3] [--steps 40] [--warmup 5] --json RAW.json
    .venv/bin/python -m benchmarks.parts.launch --render RAW.json     (the section only)
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.harness import common as h  # noqa: E402
from benchmarks.harness import stats as st  # noqa: E402
from benchmarks.parts.launch_timer import TIMES_VAR  # noqa: E402

__all__ = ["main", "markdown", "summary_rows", "readme_bullet", "goal_rows", "changed_lines", "example_diffs"]

MARK = "<!-- launch-bench -->"
#: The most lines a protected example may change against its plain original.
MAX_CHANGED = 6
#: The per-update goal: the protected update at most this many times the plain torchrun one.
GOAL = 1.01
EXAMPLES_DIR = REPO / "examples" / "torchrun"
#: Each example: its plain original, its protected script, and how each takes its number of updates.
EXAMPLES: dict[str, tuple[str, str, str]] = {
    "argparse": ("train_plain.py", "train.py", "--steps {steps}"),
    "hydra": ("train_hydra_plain.py", "train_hydra.py", "steps={steps}"),
}
ARMS = {"plain": "torchrun --nnodes 2 --nproc-per-node 2 (two agents), the plain script",
        "protected": "accelpact-run --nnodes 2 --nproc-per-node 2, the protected script",
        "plain1x4": "torchrun --nproc-per-node 4 (a 1 x 4 mesh), the plain script"}
RUN_TIMEOUT_S = 420


# ====================================================================== (a) changed lines


def substantive_lines(source: str) -> list[str]:
    """The lines of a Python source that carry code or a string (pure): comments removed (by the tokenizer, so a
    ``#`` inside a string stays), each line stripped, internal runs of spaces made one, blank lines dropped."""
    lines = source.splitlines()
    cuts: dict[int, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            cuts[tok.start[0] - 1] = tok.start[1]
    out = []
    for i, line in enumerate(lines):
        text = " ".join(line[:cuts.get(i, len(line))].split())
        if text:
            out.append(text)
    return out


def changed_lines(plain: str, protected: str) -> dict[str, int]:
    """How many substantive lines (:func:`substantive_lines`) the protected script changes against the plain one
    (pure): ``changed``, its lines that are new or rewritten (the ``+`` lines of ``diff -w``); ``removed``, the
    plain lines that are gone or rewritten; and each side's substantive line count."""
    a, b = substantive_lines(plain), substantive_lines(protected)
    changed = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag != "equal":
            removed += i2 - i1
            changed += j2 - j1
    return {"changed": changed, "removed": removed, "plain_lines": len(a), "protected_lines": len(b)}


def example_diffs(where: Path = EXAMPLES_DIR) -> dict[str, dict[str, Any]]:
    """:func:`changed_lines` of every example of :data:`EXAMPLES`, with both files' paths."""
    out: dict[str, dict[str, Any]] = {}
    for name, (plain, protected, _steps) in EXAMPLES.items():
        counts = changed_lines((where / plain).read_text(), (where / protected).read_text())
        out[name] = {"plain": h.json_field(where / plain), "protected": h.json_field(where / protected), **counts}
    return out


# ====================================================================== (b) per-update cost


def _script(example: str, arm: str) -> tuple[str, list[str]]:
    plain, protected, steps_arg = EXAMPLES[example]
    return str(EXAMPLES_DIR / (protected if arm == "protected" else plain)), steps_arg.split()


def commands(arm: str, example: str, steps: int, run_dir: Path, port: int) -> list[list[str]]:
    """The launcher command(s) of one run of ``arm`` (pure): the timing hook runs the script in each."""
    script, args = _script(example, arm)
    tail = ["-m", "benchmarks.parts.launch_timer", script, *[a.format(steps=steps) for a in args]]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if arm == "protected":
        return [[sys.executable, "-m", "accelpact_slurm.cli.run", "--nnodes", "2", "--nproc-per-node", "2",
                 "--run-dir", str(run_dir), *tail]]
    if arm == "plain":
        return [[*torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(n), "--master-addr",
                 "127.0.0.1", "--master-port", str(port), *tail] for n in (0, 1)]
    return [[*torchrun, "--nnodes", "1", "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port",
             str(port), *tail]]


def segments(rec: dict[str, Any], warmup: int) -> dict[str, list[float]] | None:
    """One rank's updates after the warm-up, in seconds (pure).  Wall time: ``update`` (one step's return to the
    next one's), ``hooks`` (the optimizer's own pre-hooks: the vote), ``step`` (the step and its post-hooks),
    ``outside`` (the rest); the training thread's CPU time in each (``*_cpu``); ``others_cpu``, the CPU time of the
    rank's other threads during the update.  None when the hook's records do not pair up (an update discarded and
    run again)."""
    pre, mid, post = rec.get("pre") or [], rec.get("mid") or [], rec.get("post") or []
    if not post or not len(pre) == len(mid) == len(post):
        return None
    ks = range(max(warmup, 1), len(post))
    out: dict[str, list[float]] = {}
    for i, suffix in ((0, ""), (1, "_cpu")):
        out["update" + suffix] = [post[k][i] - post[k - 1][i] for k in ks]
        out["hooks" + suffix] = [mid[k][i] - pre[k][i] for k in ks]
        out["step" + suffix] = [post[k][i] - mid[k][i] for k in ks]
        out["outside" + suffix] = [pre[k][i] - post[k - 1][i] for k in ks]
    out["others_cpu"] = [(post[k][2] - post[k - 1][2]) - (post[k][1] - post[k - 1][1]) for k in ks]
    return out


#: What :func:`segments` measures, in the order the report shows it.
SEGMENTS = ("update", "hooks", "step", "outside", "update_cpu", "hooks_cpu", "step_cpu", "outside_cpu",
            "others_cpu")


def apart(ranks: dict[int, dict[str, Any]], warmup: int) -> dict[str, float | None]:
    """How far apart the ranks are at each update, in ms (pure; median over the updates after the warm-up): as
    they reach ``optimizer.step()`` (``pre``) and as they begin the step itself, the optimizer's pre-hooks done
    (``mid``: under ``accelpact-run`` as they leave the vote).  ``perf_counter`` is the machine's monotonic clock,
    the same in every process of this machine."""
    n = min(len(d.get("post") or []) for d in ranks.values())
    out: dict[str, float | None] = {}
    for where in ("pre", "mid"):
        spans = [max(d[where][k][0] for d in ranks.values()) - min(d[where][k][0] for d in ranks.values())
                 for k in range(warmup, n)]
        out[where] = st.med([x * 1000 for x in spans])
    return out


def run_once(where: Path, name: str, arm: str, example: str, steps: int, warmup: int) -> dict[str, Any]:
    """One job of ``arm``, every rank timed; its per-rank and pooled medians (ms), or its error."""
    times, run_dir = where / f"{name}-times", where / f"{name}-run"
    port = h.free_ports(1)[0]
    env = h.bench_environ({TIMES_VAR: str(times)}, scrub=("ACCELPACT_TEST_",))
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=where, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
             for cmd in commands(arm, example, steps, run_dir, port)]
    outs, rcs = [], []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - t0)))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill(q)
            outs.append(p.communicate()[0])
        rcs.append(p.returncode)
    rec: dict[str, Any] = {"name": name, "arm": arm, "example": example, "rc": rcs,
                           "wall_s": round(time.monotonic() - t0, 2)}
    ranks = {}
    for f in sorted(times.glob("rank-*.json")):
        data = json.loads(f.read_text())
        ranks[int(data["rank"])] = data
    if any(rcs) or len(ranks) != 4:
        return {**rec, "error": f"exit {rcs}, {len(ranks)} rank(s) timed: " + "\n".join(outs)[-1500:]}
    segs = {r: segments(d, warmup) for r, d in sorted(ranks.items())}
    if any(s is None for s in segs.values()):
        return {**rec, "error": "a rank's optimizer-step records do not pair up (an update ran twice?)"}
    ms = {r: {k: [x * 1000 for x in v] for k, v in s.items()} for r, s in segs.items() if s is not None}
    rec.update(per_rank={str(r): {k: st.med(v) for k, v in m.items()} for r, m in ms.items()},
               pooled={k: st.med([x for m in ms.values() for x in m[k]]) for k in SEGMENTS},
               updates=len(ms[0]["update"]), threads=sorted({d.get("threads") for d in ranks.values()}, key=str),
               deterministic=sorted({d.get("deterministic") for d in ranks.values()}, key=str),
               raw_update_ms={str(r): [round(x, 3) for x in m["update"]] for r, m in ms.items()},
               apart_ms=apart(ranks, warmup))
    if arm == "protected":
        events = h.read_jsonl(run_dir / "events.jsonl")
        step_s = [e["step_s"] for e in events if e.get("event") == "step" and e.get("rank") == 0
                  and (e.get("step") or 0) > warmup and e.get("step_s") is not None]
        rec["events_rank0_ms"] = st.med([s * 1000 for s in step_s])
        summary = run_dir / "summary.json"
        rec["final_step"] = json.loads(summary.read_text()).get("final_step") if summary.exists() else None
    return rec


def _kill(p: subprocess.Popen[str]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the run's own session: start_new_session=True
    except (ProcessLookupError, PermissionError):
        pass


def measure(args: argparse.Namespace, where: Path) -> dict[str, Any]:
    arms = ["plain", "protected"] + (["plain1x4"] if args.with_1x4 else [])
    budget = st.Budget(h.outer_deadline(1e9, 60))
    runs: list[dict[str, Any]] = []
    for t in range(args.trials):
        if t and not budget.fits(factor=len(arms) * 1.2):
            print(f"launch: trial {t} skipped: the deadline would pass", flush=True)
            break
        order = list(st.abba(t, "plain", "protected"))  # ABBA; the 1 x 4 reference last, then first
        order = order + arms[2:] if t % 2 == 0 else arms[2:] + order
        for arm in order:
            r = run_once(where, f"t{t}-{arm}", arm, args.example, args.steps, args.warmup)
            r.update(trial=t, load=os.getloadavg()[0])
            budget.record(r["wall_s"])
            runs.append(r)
            every = ", ".join(st.fmt(v["update"], "{:.1f}") for v in (r.get("per_rank") or {}).values())
            print(f"launch: trial {t} {arm}: {st.fmt((r.get('pooled') or {}).get('update'), '{:.1f}')} ms/update"
                  f" (every rank: {every}){'; ERROR ' + r['error'][-300:] if r.get('error') else ''}", flush=True)
    return {"runs": runs, "arms": arms}


# ====================================================================== reduction and report


def _arm_runs(res: dict[str, Any], arm: str) -> list[dict[str, Any]]:
    return [r for r in res.get("runs") or [] if r.get("arm") == arm and not r.get("error")]


def pairs(res: dict[str, Any], arm: str = "protected", base: str = "plain",
          key: str = "update") -> list[tuple[float, float]]:
    """``(arm's, base's)`` pooled median of ``key`` per trial both measured."""
    a = {r["trial"]: r["pooled"][key] for r in _arm_runs(res, arm)}
    b = {r["trial"]: r["pooled"][key] for r in _arm_runs(res, base)}
    return [(a[t], b[t]) for t in sorted(a) if t in b and a[t] is not None and b[t]]


def figures_of(res: dict[str, Any]) -> dict[str, Any]:
    """The part's figures: the ratio protected / plain with its spread, the added milliseconds per update and in
    each segment, the 1 x 4 reference, and the hook against rank 0's events."""
    ps = pairs(res)
    out: dict[str, Any] = {"ratio": st.ratio_stats(ps), "added_ms": st.spread([a - b for a, b in ps])}
    out["added_update_ms"] = out["added_ms"]
    for seg in SEGMENTS[1:]:
        out[f"added_{seg}_ms"] = st.spread([a - b for a, b in pairs(res, key=seg)])
        out[f"{seg}_ms"] = {arm: st.spread([r["pooled"][seg] for r in _arm_runs(res, arm)]) for arm in ARMS}
    out["ref_1x4"] = st.ratio_stats(pairs(res, "plain1x4", "plain"))
    out["cpu_ratio"] = st.ratio_stats(pairs(res, key="update_cpu"))
    out["apart_ms"] = {arm: {w: st.spread([(r.get("apart_ms") or {}).get(w) for r in _arm_runs(res, arm)])
                             for w in ("pre", "mid")} for arm in ARMS}
    prot = _arm_runs(res, "protected")
    out["events_vs_hook"] = st.spread([r["events_rank0_ms"] / r["per_rank"]["0"]["update"] for r in prot
                                       if r.get("events_rank0_ms") and r["per_rank"]["0"]["update"]])
    out["failed"] = [f"{r['name']}: {r['error'][-200:]}" for r in res.get("runs") or [] if r.get("error")]
    return out


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    f = figures_of(res)
    rows = [st.row(f"{name} example: lines changed to protect it ({d['plain'].split('/')[-1]} → "
                   f"{d['protected'].split('/')[-1]})", "its plain torchrun original (substantive lines: blank lines "
                   "and comments ignored, diff -w)", {"median": d["changed"], "min": d["changed"],
                                                      "max": d["changed"], "n": 1}, unit="lines",
                   note=f"{d['removed']} plain line(s) replaced or gone; goal ≤ {MAX_CHANGED}")
            for name, d in (res.get("diffs") or {}).items()]
    r = f["ratio"]
    rows.append(st.row(f"per-update time, the {res.get('example')} example protected under accelpact-run (2 x 2) / "
                       "plain under torchrun", "torchrun --nnodes 2 --nproc-per-node 2 on the same mesh, ABBA, every "
                       "rank timed at optimizer.step", r,
                       note=f"{st.fmt(r.get('abs_test'), '{:.1f}')} ms against {st.fmt(r.get('abs_base'), '{:.1f}')}"
                            f" ms; added {st.fmt_spread(f['added_ms'], '{:+.1f}')} ms, of it in the vote "
                            f"{st.fmt_spread(f['added_hooks_ms'], '{:+.1f}')} ms; goal ≤ {GOAL}x"))
    c = f["cpu_ratio"]
    rows.append(st.row("the training thread's CPU time per update, protected / plain", "the same pairs", c,
                       note=f"{st.fmt(c.get('abs_test'), '{:.1f}')} ms against {st.fmt(c.get('abs_base'), '{:.1f}')} "
                            f"ms; the rank's other threads {st.fmt_spread(f['added_others_cpu_ms'], '{:+.1f}')} ms"))
    if f["ref_1x4"].get("n"):
        rows.append(st.row("per-update time, plain torchrun --nproc-per-node 4 (a 1 x 4 mesh) / 2 x 2 (reference)",
                           "torchrun --nnodes 2 --nproc-per-node 2", f["ref_1x4"]))
    return rows


def together(f: dict[str, Any]) -> str:
    """What the result says of the step's wait: how far apart the ranks begin it, and its wall time over its CPU
    time, under each launcher."""
    def begin(arm: str) -> str:
        return st.fmt(f["apart_ms"][arm]["mid"].get("median"), "{:.1f}")

    def stretch(arm: str) -> str:
        return st.fmt(st.ratio(f["step_ms"][arm].get("median"), f["step_cpu_ms"][arm].get("median")))
    return (f"the step's wall time is {stretch('protected')}x its CPU time against {stretch('plain')}x under "
            f"torchrun (the same work, more waiting for a core: the ranks begin it {begin('protected')} ms apart as "
            f"they leave the vote, {begin('plain')} ms apart under torchrun)")


def verdict(res: dict[str, Any]) -> tuple[str, str]:
    """The per-update goal's verdict and what the result says of its cause.  Met only where every pair agrees (each
    ratio at most the goal): on this shared machine the load moves one run's wall time by more than the goal's 1%,
    so a median at most the goal with pairs above it decides nothing; a median above the goal is not met, with the
    number of pairs above it."""
    f = figures_of(res)
    r = f["ratio"]
    if r.get("median") is None:
        return "not decided", "no pair of runs completed"

    def added(seg: str) -> str:
        return (f"{st.fmt(f[f'added_{seg}_ms'].get('median'), '{:+.1f}')} ms (the training thread's CPU "
                f"{st.fmt(f[f'added_{seg}_cpu_ms'].get('median'), '{:+.1f}')} ms)")

    cause = (f"added per update {added('update')}: the vote (the optimizer's pre-hooks) {added('hooks')}, the step "
             f"{added('step')}, the rest (forward, backward, the update's end, the next batch) {added('outside')}; "
             f"the rank's other threads {st.fmt(f['added_others_cpu_ms'].get('median'), '{:+.1f}')} ms CPU per update "
             f"(wall time beyond CPU time is waiting: for peers, or for a core of this 2-core machine); {together(f)}")
    above = sum(1 for a, b in pairs(res) if a / b > GOAL)
    if r["max"] <= GOAL:
        return "met", cause
    if r["median"] > GOAL:
        return "not met", f"{above} of {r['n']} pairs above {GOAL}x; {cause}"
    return "not decided", (f"the {r['n']} pairs range {r['min']:.2f}–{r['max']:.2f}x, {above} of them above the "
                           f"goal: this shared machine's load moves the wall time by more than 1%; {cause}")


def readme_bullet(res: dict[str, Any]) -> str:
    """The README's bullet of this part (``benchmarks/harness/figures.py`` places it)."""
    f, diffs = figures_of(res), res.get("diffs") or {}
    r, c, (v, _cause) = f["ratio"], f["cpu_ratio"], verdict(res)
    lines = " and ".join(f"{d['changed']} lines of the {name} example" for name, d in diffs.items())

    def ms(key: str) -> str:
        return st.fmt(f[key].get("median"), "{:+.1f}")
    return (f"- **The torchrun drop-in's cost** (`launch`, the {res.get('example')} example, {r.get('n', 0)} ABBA "
            f"pair(s), every rank timed at `optimizer.step`): protecting a torchrun script changes {lines} "
            f"(substantive lines, against the plain original). A protected update under `accelpact-run`, against "
            f"the plain script's under torchrun on the same 2 x 2 mesh: {st.fmt_spread(r)}x in wall time "
            f"({st.fmt(r.get('abs_test'), '{:.1f}')} ms against {st.fmt(r.get('abs_base'), '{:.1f}')} ms; goal ≤ "
            f"{GOAL}x {v}), {st.fmt_spread(c)}x in the training thread's CPU time ({ms('added_update_cpu_ms')} ms "
            f"per update; the rank's other threads {ms('added_others_cpu_ms')} ms). The vote adds "
            f"{ms('added_hooks_ms')} ms of wall time, {ms('added_hooks_cpu_ms')} ms of it CPU (the rest waiting for "
            f"peers), the step after it {ms('added_step_ms')} ms for {ms('added_step_cpu_ms')} ms of CPU: "
            f"{together(f)}.")


def goal_rows(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The goals table's lines of this part: (goal, verdict, measured)."""
    diffs = res.get("diffs") or {}
    r, (v, cause) = figures_of(res)["ratio"], verdict(res)
    return [(f"a protected torchrun example changes ≤ {MAX_CHANGED} lines of its plain original",
             "met" if diffs and all(d["changed"] <= MAX_CHANGED for d in diffs.values()) else "not met",
             ", ".join(f"{name} {d['changed']}" for name, d in diffs.items())),
            (f"a protected update under accelpact-run ≤ {GOAL}x plain torchrun's (same script, same mesh)", v,
             f"{st.fmt_spread(r)}x; {cause}")]


def markdown(res: dict[str, Any]) -> str:
    f = figures_of(res)
    diffs = res.get("diffs") or {}
    lines = [MARK, "## The torchrun drop-in: changed lines and per-update cost", "",
             f"Written by `benchmarks/parts/launch.py` on {res.get('date')} (raw data: `{res.get('json')}`). Changed "
             "lines: the protected script against its plain torchrun original, substantive lines only (blank lines "
             "and comments ignored, indentation and spacing too, as `diff -w`), counted on the protected side; the "
             "plain lines it replaces are counted apart.", "",
             "| example | plain original | protected | changed lines | plain lines replaced or gone | substantive "
             "lines (plain / protected) |", "|---|---|---|---:|---:|---|"]
    for name, d in diffs.items():
        lines.append(f"| {name} | `{d['plain']}` | `{d['protected']}` | {d['changed']} | {d['removed']} | "
                     f"{d['plain_lines']} / {d['protected_lines']} |")
    arms = res.get("arms") or []
    lines += ["", f"Per-update cost: the {res.get('example')} example, {res.get('steps')} updates per run, the first "
              f"{res.get('warmup')} left out, {res.get('trials')} trials, each the plain script under torchrun and the "
              "protected one under accelpact-run in ABBA order"
              + (", with `torchrun --nproc-per-node 4` beside them" if "plain1x4" in arms else "")
              + ". Every rank is timed by one hook in both (torch's global optimizer-step hooks, "
              "`benchmarks/parts/launch_timer.py`); an update runs from one `optimizer.step()`'s return to the "
              "next one's. The baseline is torchrun on the same 2 x 2 mesh (two agents): `torchrun "
              "--nproc-per-node 4` builds a 1 x 4 mesh, without the replication group, so its update does less work "
              "(`--with-1x4` runs it beside them as a reference).", "",
              "| run | per-update ms, median (min–max over runs) | every rank's median ms (median over runs) | the "
              "optimizer's pre-hooks (the vote) ms | the step ms | the rest ms | the training thread's CPU ms per "
              "update | the other threads' CPU ms per update | the ranks reach the step / begin it, ms apart | runs |",
              "|---|---|---|---|---|---|---|---|---|---:|"]
    for arm in arms:
        rs = _arm_runs(res, arm)
        per_rank = ", ".join(f"{st.fmt(st.med([r['per_rank'][k]['update'] for r in rs]), '{:.1f}')}"
                             for k in ("0", "1", "2", "3")) if rs else "n/a"
        cells = [st.fmt_spread(f[f"{seg}_ms"][arm], "{:.1f}")
                 for seg in ("hooks", "step", "outside", "update_cpu", "others_cpu")]
        cells.append(" / ".join(st.fmt(f["apart_ms"][arm][w].get("median"), "{:.1f}") for w in ("pre", "mid")))
        lines.append(f"| {ARMS[arm]} | {st.fmt_spread(st.spread([r['pooled']['update'] for r in rs]), '{:.1f}')} | "
                     f"{per_rank} | {' | '.join(cells)} | {len(rs)} |")
    v, cause = verdict(res)
    r = f["ratio"]
    lines += ["", f"**Protected / plain, per update: {st.fmt_spread(r)}x** over {r.get('n', 0)} pairs (goal ≤ "
              f"{GOAL}x: {v}); {cause}. The training thread's CPU time per update, protected / plain: "
              f"{st.fmt_spread(f['cpu_ratio'])}x."
              + (f" Plain torchrun 1 x 4 / 2 x 2: {st.fmt_spread(f['ref_1x4'])}x." if f["ref_1x4"].get("n") else "")
              + (f" Rank 0's `step` events of the protected runs give {st.fmt_spread(f['events_vs_hook'], '{:.3f}')}"
                 "x the hook's rank 0 median (the events time the update from one commit to the next)."
                 if f["events_vs_hook"].get("n") else "")
              + (" Failed runs: " + "; ".join(f["failed"]) if f["failed"] else "")]
    return "\n".join([*lines, "", MARK])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.output_args(ap, None, "where the result goes (default runs/bench/<date>/launch.json)")
    ap.add_argument("--trials", type=int, default=4, help="ABBA trials, each a plain and a protected run (default 4)")
    ap.add_argument("--steps", type=int, default=40, help="updates per run (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="first updates left out of every run (default 5)")
    ap.add_argument("--example", choices=sorted(EXAMPLES), default="hydra",
                    help="the example whose updates are timed (default hydra)")
    ap.add_argument("--with-1x4", action="store_true",
                    help="also torchrun --nproc-per-node 4 (a 1 x 4 mesh) in every trial, as a reference")
    args = ap.parse_args(argv)
    if args.render:
        print(markdown(h.read_result(args.render)))
        return 0
    if args.trials < 1 or args.steps < args.warmup + 3 or args.warmup < 1:
        ap.error(f"--trials {args.trials}, --steps {args.steps}, --warmup {args.warmup}: at least one trial, a "
                 "warm-up of at least 1 update and 3 timed updates after it")
    h.stop_on_signals("launch")
    raw = h.out_path(args.json or f"runs/bench/{h.today()}/launch.json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        got = measure(args, Path(tmp))
    res = h.new_result("launch", trials=args.trials, steps=args.steps, warmup=args.warmup, example=args.example,
                       json=h.json_field(raw), diffs=example_diffs(), **got)
    res["rows"] = summary_rows(res)
    h.write_result(h.finish(res), raw)
    if args.markdown:
        h.write_markdown(args.markdown, MARK, markdown(res))
    print(markdown(res), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
