"""The torchrun drop-in: what protecting a torchrun script changes in it, and what the launch path costs an update.

(a) For each torchrun example (``examples/torchrun/``: the argparse script and the Hydra one) the number of lines
its protected script changes against its plain original (:func:`changed_lines`): substantive lines only -- blank
lines and comments are ignored, indentation and spacing too (``diff -w``) -- counted on the protected side (a line
added or rewritten; the plain lines it replaces are counted apart, as removed).  ``tests/examples/
test_torchrun_diffs.py`` holds every example to at most :data:`MAX_CHANGED` with this same function.

(b) The per-update time of the protected script under ``accelpact-run --nnodes N --nproc-per-node P`` against its
plain original under plain ``torchrun`` on the same layout (N torchrun agents, ``--nnodes N --nproc-per-node P``,
on this machine: the same ``("replicate", "shard")`` mesh, so the same work per update), in ABBA order,
``--trials`` pairs, for each case of ``--cases`` (``benchmarks/parts/launch_report.py``'s :data:`CASES`, each
with its own pairs, figures and verdict): ``tiny-2x2``, 2 x 2 with the example's defaults (an update of a few
tens of ms, 4 ranks on this machine's 2 cores), and ``wide-2x1``, 2 x 1 (one rank per core) with a larger model
and batch (an update of a few hundred ms; the Hydra example only): the vote's fixed cost seen apart from the wait
for a core.  With ``--with-1x4``, ``torchrun --nproc-per-node 4`` (one agent: a 1 x 4 mesh, no replication group,
so less communication per update) runs beside the tiny-2x2 case as a reference.  Both scripts run under one
timing hook (``benchmarks/parts/launch_timer.py``, each launcher's module form ``-m``): torch's global
optimizer-step hooks, on every rank, at the same places in both runs; the first ``--warmup`` updates are left
out.  An update is the interval from one ``optimizer.step()``'s return to the next one's, and splits into the
optimizer's own pre-hooks (under ``accelpact-run`` the update's vote; nothing under torchrun), the step itself,
and the rest (zero_grad, the update's end, the next batch, forward, backward).  Rank 0's ``step`` events of the
protected run (``step_s``) are compared with the hook's rank 0 as a check of the hook.  Each segment is also
timed in the training thread's CPU time: on this shared 2-core machine the wall-clock ratio moves with the other
work on it from one run to the next, the CPU time much less.  The trials interleave the cases (trial t: each
case's pair in turn), so that a deadline cuts the cases alike (each to within a pair).

Usage::

    .venv/bin/python -m benchmarks.parts.launch [--trials 3] [--steps 40] [--warmup 5] [--cases wide-2x1] \
        --json RAW.json
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
from benchmarks.parts.launch_report import (  # noqa: E402,F401 - the part's report, named here for run.py
    CASES, MARK, MAX_CHANGED, SEGMENTS, Case, case_info, case_names, case_result, figures_of, goal_rows, markdown,
    readme_bullet, summary_rows, verdict)

__all__ = ["main", "markdown", "summary_rows", "readme_bullet", "goal_rows", "changed_lines", "example_diffs"]

EXAMPLES_DIR = REPO / "examples" / "torchrun"
#: Each example: its plain original, its protected script, and how each takes its number of updates.
EXAMPLES: dict[str, tuple[str, str, str]] = {
    "argparse": ("train_plain.py", "train.py", "--steps {steps}"),
    "hydra": ("train_hydra_plain.py", "train_hydra.py", "steps={steps}"),
}
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


def commands(arm: str, example: str, steps: int, run_dir: Path, port: int,
             case: Case = CASES["tiny-2x2"]) -> list[list[str]]:
    """The launcher command(s) of one run of ``arm`` in ``case`` (pure): the timing hook runs the script in each,
    with the case's arguments for the example."""
    script, args = _script(example, arm)
    tail = ["-m", "benchmarks.parts.launch_timer", script, *[a.format(steps=steps) for a in args],
            *case.args[example]]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    nodes, per_node = str(case.nodes), str(case.per_node)
    if arm == "protected":
        return [[sys.executable, "-m", "accelpact_slurm.cli.run", "--nnodes", nodes, "--nproc-per-node", per_node,
                 "--run-dir", str(run_dir), *tail]]
    if arm == "plain":
        return [[*torchrun, "--nnodes", nodes, "--nproc-per-node", per_node, "--node-rank", str(n), "--master-addr",
                 "127.0.0.1", "--master-port", str(port), *tail] for n in range(case.nodes)]
    return [[*torchrun, "--nnodes", "1", "--nproc-per-node", str(case.ranks), "--master-addr", "127.0.0.1",
             "--master-port", str(port), *tail]]


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


def run_once(where: Path, name: str, case: Case, arm: str, example: str, steps: int, warmup: int) -> dict[str, Any]:
    """One job of ``arm`` in ``case``, every rank timed; its per-rank and pooled medians (ms), or its error."""
    times, run_dir = where / f"{name}-times", where / f"{name}-run"
    port = h.free_ports(1)[0]
    env = h.bench_environ({TIMES_VAR: str(times), **case.env}, scrub=("ACCELPACT_TEST_",))
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=where, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
             for cmd in commands(arm, example, steps, run_dir, port, case)]
    outs, rcs = [], []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - t0)))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill(q)
            outs.append(p.communicate()[0])
        rcs.append(p.returncode)
    rec: dict[str, Any] = {"name": name, "case": case.name, "arm": arm, "example": example, "rc": rcs,
                           "wall_s": round(time.monotonic() - t0, 2)}
    ranks = {}
    for f in sorted(times.glob("rank-*.json")):
        data = json.loads(f.read_text())
        ranks[int(data["rank"])] = data
    if any(rcs) or sorted(ranks) != list(range(case.ranks)):
        return {**rec, "error": f"exit {rcs}, {len(ranks)} of {case.ranks} ranks timed: "
                                + "\n".join(outs)[-1500:]}
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


def case_arms(case: Case, with_1x4: bool) -> list[str]:
    """The arms a case runs (pure): plain and protected; the 1 x 4 reference in the tiny-2x2 case only."""
    return ["plain", "protected"] + (["plain1x4"] if with_1x4 and case.name == "tiny-2x2" else [])


def measure(args: argparse.Namespace, where: Path) -> dict[str, Any]:
    """Every trial, each case's ABBA pair in turn (a case whose pair would pass the deadline is left out of the
    trial); the runs and what each case ran."""
    cases = [CASES[c] for c in args.cases]
    arms = {c.name: case_arms(c, args.with_1x4) for c in cases}
    total = h.outer_deadline(1e9, 60)
    budgets = {c.name: st.Budget(total) for c in cases}  # each case's longest run against the one deadline
    runs: list[dict[str, Any]] = []
    for t in range(args.trials):
        for case in cases:
            mine = arms[case.name]
            if t and not budgets[case.name].fits(factor=len(mine) * 1.2):
                print(f"launch: {case.name} trial {t} skipped: the deadline would pass", flush=True)
                continue
            order = list(st.abba(t, "plain", "protected"))  # ABBA; the 1 x 4 reference last, then first
            order = order + mine[2:] if t % 2 == 0 else mine[2:] + order
            for arm in order:
                r = run_once(where, f"{case.name}-t{t}-{arm}", case, arm, args.example, args.steps, args.warmup)
                r.update(trial=t, load=os.getloadavg()[0])
                budgets[case.name].record(r["wall_s"])
                runs.append(r)
                every = ", ".join(st.fmt(v["update"], "{:.1f}") for v in (r.get("per_rank") or {}).values())
                print(f"launch: {case.name} trial {t} {arm}: {st.fmt((r.get('pooled') or {}).get('update'), '{:.1f}')}"
                      f" ms/update (every rank: {every}; {r['wall_s']:.0f} s)"
                      f"{'; ERROR ' + r['error'][-300:] if r.get('error') else ''}", flush=True)
    return {"runs": runs, "cases": {c.name: case_info(c, arms[c.name], args.example) for c in cases}}


def parse_cases(text: str) -> list[str]:
    """``--cases``: a comma list of :data:`CASES`' names, each once, in the order given."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: " + (f"no case named {', '.join(bad)}" if bad else "each case once, at least one")
            + f"; give a comma list of {', '.join(CASES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.output_args(ap, None, "where the result goes (default runs/bench/<date>/launch.json)")
    ap.add_argument("--trials", type=int, default=4,
                    help="ABBA trials, each a plain and a protected run of every case (default 4)")
    ap.add_argument("--steps", type=int, default=40, help="updates per run (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="first updates left out of every run (default 5)")
    ap.add_argument("--example", choices=sorted(EXAMPLES), default="hydra",
                    help="the example whose updates are timed (default hydra)")
    ap.add_argument("--cases", type=parse_cases, default=list(CASES), metavar="CASE[,CASE]",
                    help="the cases measured, each with its own pairs, figures and verdict, a comma list of "
                         f"{', '.join(CASES)} (default both): tiny-2x2, 2 nodes x 2 ranks with the example's "
                         "defaults (an update of a few tens of ms); wide-2x1, 2 nodes x 1 rank (one per core) with "
                         f"{' '.join(CASES['wide-2x1'].args['hydra'])} (a few hundred ms; the hydra example only)")
    ap.add_argument("--with-1x4", action="store_true",
                    help="also torchrun --nproc-per-node 4 (a 1 x 4 mesh) in every trial of the tiny-2x2 case, as a "
                         "reference (that case only: it needs tiny-2x2 among --cases)")
    args = ap.parse_args(argv)
    if args.render:
        print(markdown(h.read_result(args.render)))
        return 0
    if args.trials < 1 or args.steps < args.warmup + 3 or args.warmup < 1:
        ap.error(f"--trials {args.trials}, --steps {args.steps}, --warmup {args.warmup}: at least one trial, a "
                 "warm-up of at least 1 update and 3 timed updates after it")
    for c in args.cases:
        if args.example not in CASES[c].args:
            ap.error(f"--cases {c} with --example {args.example}: the {c} case sets the model's size, which only "
                     f"the {' and '.join(CASES[c].args)} example takes; give --example {next(iter(CASES[c].args))} or "
                     f"leave {c} out of --cases")
    if args.with_1x4 and "tiny-2x2" not in args.cases:
        ap.error(f"--with-1x4 with --cases {','.join(args.cases)}: the 1 x 4 reference is the tiny-2x2 case's (its 4 "
                 "ranks on one torchrun agent); add tiny-2x2 to --cases or leave --with-1x4 out")
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
