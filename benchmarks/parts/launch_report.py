"""The launch part's cases and its report (pure: nothing runs): for each case, its ABBA pairs, figures, verdict,
overview rows, goal line and its place in the README bullet and in the docs section, from the raw result
``benchmarks/parts/launch.py`` writes.

A case is a layout and a size of update, measured with its own pairs (:data:`CASES`): ``tiny-2x2``, the example's
defaults on 2 nodes x 2 ranks (an update of a few tens of ms, 4 ranks and their helper threads sharing this
machine's 2 cores), and ``wide-2x1``, 2 nodes x 1 rank (one rank per core) with a model and batch that give an
update of a few hundred ms.  Side by side they tell the vote's fixed cost apart from the ranks' wait for a core.
A raw result written before there were cases (no ``cases`` field, 2026-12-07) reads as the ``tiny-2x2`` case
alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from benchmarks.harness import stats as st

__all__ = ["CASES", "case_names", "case_result", "figures_of", "verdict", "summary_rows", "readme_bullet",
           "goal_rows", "markdown"]

MARK = "<!-- launch-bench -->"
#: The most lines a protected example may change against its plain original.
MAX_CHANGED = 6
#: The per-update goal: the protected update at most this many times the plain torchrun one.
GOAL = 1.01
#: What the timing hook's records give per update (``launch.segments``), in the order the report shows it.
SEGMENTS = ("update", "hooks", "step", "outside", "update_cpu", "hooks_cpu", "step_cpu", "outside_cpu",
            "others_cpu")
#: Every arm a case may run: the plain script under torchrun (one agent per node), the protected one under
#: accelpact-run, and (``--with-1x4``, the tiny-2x2 case only) torchrun with every rank on one agent.
ARM_NAMES = ("plain", "protected", "plain1x4")


class Case(NamedTuple):
    name: str
    nodes: int
    per_node: int
    #: The script's arguments beyond its number of updates, per example; an example not named cannot run the case.
    args: dict[str, tuple[str, ...]]
    #: Set for every run of the case, whichever launcher starts it.
    env: dict[str, str]
    what: str

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


#: The wide case's update: a wider and deeper model (about 5.4 M parameters, not the example's 40 k) on longer,
#: larger batches; about 250 ms of the training thread's CPU per update here (plain torchrun, 2026-12-07).
WIDE_ARGS = ("model.width=384", "model.layers=4", "batch=12", "data.length=32")
CASES: dict[str, Case] = {c.name: c for c in (
    Case("tiny-2x2", 2, 2, {"argparse": (), "hydra": ()}, {},
         "an update of a few tens of ms, 4 ranks and their helper threads on this machine's 2 cores"),
    # torchrun gives each rank one thread only when it starts more than one per node (OMP_NUM_THREADS=1);
    # accelpact-run's ranks run topology.threads_per_rank (1): both the same here.
    Case("wide-2x1", 2, 1, {"hydra": WIDE_ARGS}, {"OMP_NUM_THREADS": "1"},
         "one rank per core of this 2-core machine, a larger model and batch for an update of a few hundred ms"),
)}
#: The case of a result written before there were cases.
OLD_CASE = "tiny-2x2"


def case_names(res: dict[str, Any]) -> list[str]:
    """The cases a result measured, in its order (a result without cases: :data:`OLD_CASE`)."""
    return list(res.get("cases") or [OLD_CASE])


def case_info(case: Case, arms: list[str], example: str) -> dict[str, Any]:
    """What a raw result records of a case it ran (its report reads this, not :data:`CASES`)."""
    return {"nodes": case.nodes, "per_node": case.per_node, "args": list(case.args.get(example, ())),
            "env": dict(case.env), "what": case.what, "arms": arms}


def case_result(res: dict[str, Any], case: str) -> dict[str, Any]:
    """One case's view of a raw result: the result with only that case's runs, its arms, layout and arguments."""
    info = (res.get("cases") or {}).get(case)
    if info is None:  # a result from before the cases: all of it is the tiny case
        tiny = CASES[OLD_CASE]
        info = {"nodes": tiny.nodes, "per_node": tiny.per_node, "args": [], "env": {}, "what": tiny.what,
                "arms": list(res.get("arms") or [])}
    runs = [r for r in res.get("runs") or [] if r.get("case", OLD_CASE) == case]
    return {**res, **info, "case": case, "runs": runs}


def mesh(cv: dict[str, Any]) -> str:
    return f"{cv['nodes']} x {cv['per_node']}"


def arm_text(cv: dict[str, Any], arm: str) -> str:
    n, p = cv["nodes"], cv["per_node"]
    return {"plain": f"torchrun --nnodes {n} --nproc-per-node {p} ({n} agents), the plain script",
            "protected": f"accelpact-run --nnodes {n} --nproc-per-node {p}, the protected script",
            "plain1x4": f"torchrun --nproc-per-node {n * p} (a 1 x {n * p} mesh), the plain script"}[arm]


def _args(cv: dict[str, Any]) -> str:
    return f"`{' '.join(cv['args'])}`" if cv.get("args") else "the example's defaults"


# ====================================================================== one case's figures


def _arm_runs(cv: dict[str, Any], arm: str) -> list[dict[str, Any]]:
    return [r for r in cv.get("runs") or [] if r.get("arm") == arm and not r.get("error")]


def pairs(cv: dict[str, Any], arm: str = "protected", base: str = "plain",
          key: str = "update") -> list[tuple[float, float]]:
    """``(arm's, base's)`` pooled median of ``key`` per trial both measured, in one case's view."""
    a = {r["trial"]: r["pooled"][key] for r in _arm_runs(cv, arm)}
    b = {r["trial"]: r["pooled"][key] for r in _arm_runs(cv, base)}
    return [(a[t], b[t]) for t in sorted(a) if t in b and a[t] is not None and b[t]]


def figures_of(cv: dict[str, Any]) -> dict[str, Any]:
    """One case's figures: the ratio protected / plain with its spread, the added milliseconds per update and in
    each segment, the 1 x 4 reference, and the hook against rank 0's events."""
    ps = pairs(cv)
    out: dict[str, Any] = {"ratio": st.ratio_stats(ps), "added_ms": st.spread([a - b for a, b in ps])}
    out["added_update_ms"] = out["added_ms"]
    for seg in SEGMENTS[1:]:
        out[f"added_{seg}_ms"] = st.spread([a - b for a, b in pairs(cv, key=seg)])
        out[f"{seg}_ms"] = {arm: st.spread([r["pooled"][seg] for r in _arm_runs(cv, arm)]) for arm in ARM_NAMES}
    out["ref_1x4"] = st.ratio_stats(pairs(cv, "plain1x4", "plain"))
    out["cpu_ratio"] = st.ratio_stats(pairs(cv, key="update_cpu"))
    out["apart_ms"] = {arm: {w: st.spread([(r.get("apart_ms") or {}).get(w) for r in _arm_runs(cv, arm)])
                             for w in ("pre", "mid")} for arm in ARM_NAMES}
    prot = _arm_runs(cv, "protected")
    out["events_vs_hook"] = st.spread([r["events_rank0_ms"] / r["per_rank"]["0"]["update"] for r in prot
                                       if r.get("events_rank0_ms") and r["per_rank"]["0"]["update"]])
    out["failed"] = [f"{r['name']}: {r['error'][-200:]}" for r in cv.get("runs") or [] if r.get("error")]
    return out


def together(f: dict[str, Any]) -> str:
    """What the result says of the step's wait: how far apart the ranks begin it, and its wall time over its CPU
    time, under each launcher."""
    def begin(arm: str) -> str:
        return st.fmt(f["apart_ms"][arm]["mid"].get("median"), "{:.1f}")

    def stretch(arm: str) -> str:
        return st.fmt(st.ratio(f["step_ms"][arm].get("median"), f["step_cpu_ms"][arm].get("median")))
    return (f"the step's wall time is {stretch('protected')}x its CPU time against {stretch('plain')}x under "
            f"torchrun (the ranks begin it {begin('protected')} ms apart as they leave the vote, {begin('plain')} ms "
            f"apart under torchrun)")


def verdict(cv: dict[str, Any]) -> tuple[str, str]:
    """One case's per-update verdict and what the result says of its cause.  Met only where every pair agrees
    (each ratio at most the goal): on this shared machine the load moves one run's wall time by more than the
    goal's 1%, so a median at most the goal with pairs above it decides nothing; a median above the goal is not
    met, with the number of pairs above it."""
    f = figures_of(cv)
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
    above = sum(1 for a, b in pairs(cv) if a / b > GOAL)
    if r["max"] <= GOAL:
        return "met", cause
    if r["median"] > GOAL:
        return "not met", f"{above} of {r['n']} pairs above {GOAL}x; {cause}"
    return "not decided", (f"the {r['n']} pairs range {r['min']:.2f}–{r['max']:.2f}x, {above} of them above the "
                           f"goal: this shared machine's load moves the wall time by more than 1%; {cause}")


# ====================================================================== the summary, README and goals


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [st.row(f"{name} example: lines changed to protect it ({d['plain'].split('/')[-1]} → "
                   f"{d['protected'].split('/')[-1]})", "its plain torchrun original (substantive lines: blank lines "
                   "and comments ignored, diff -w)", {"median": d["changed"], "min": d["changed"],
                                                      "max": d["changed"], "n": 1}, unit="lines",
                   note=f"{d['removed']} plain line(s) replaced or gone; goal ≤ {MAX_CHANGED}")
            for name, d in (res.get("diffs") or {}).items()]
    for case in case_names(res):
        cv = case_result(res, case)
        f = figures_of(cv)
        r, c = f["ratio"], f["cpu_ratio"]
        rows.append(st.row(
            f"{case}: per-update time, the {res.get('example')} example protected under accelpact-run "
            f"({mesh(cv)}) / plain under torchrun",
            f"torchrun --nnodes {cv['nodes']} --nproc-per-node {cv['per_node']} on the same mesh, ABBA, every rank "
            "timed at optimizer.step", r,
            note=f"{st.fmt(r.get('abs_test'), '{:.1f}')} ms against {st.fmt(r.get('abs_base'), '{:.1f}')} ms; added "
                 f"{st.fmt_spread(f['added_ms'], '{:+.1f}')} ms, of it in the vote "
                 f"{st.fmt_spread(f['added_hooks_ms'], '{:+.1f}')} ms; the script's arguments: {_args(cv)}; goal ≤ "
                 f"{GOAL}x"))
        rows.append(st.row(
            f"{case}: the training thread's CPU time per update, protected / plain", "the same pairs", c,
            note=f"{st.fmt(c.get('abs_test'), '{:.1f}')} ms against {st.fmt(c.get('abs_base'), '{:.1f}')} ms; the "
                 f"rank's other threads {st.fmt_spread(f['added_others_cpu_ms'], '{:+.1f}')} ms"))
        if f["ref_1x4"].get("n"):
            n_all = cv["nodes"] * cv["per_node"]
            rows.append(st.row(f"{case}: per-update time, plain torchrun --nproc-per-node {n_all} (a 1 x {n_all} "
                               f"mesh) / {mesh(cv)} (reference)",
                               f"torchrun --nnodes {cv['nodes']} --nproc-per-node {cv['per_node']}", f["ref_1x4"]))
    return rows


def _case_clause(res: dict[str, Any], case: str) -> str:
    cv = case_result(res, case)
    f = figures_of(cv)
    r, c, (v, _cause) = f["ratio"], f["cpu_ratio"], verdict(cv)

    def ms(key: str) -> str:
        return st.fmt(f[key].get("median"), "{:+.1f}")
    return (f"`{case}` ({mesh(cv)}, {_args(cv)}, {r.get('n', 0)} ABBA pair(s)): {st.fmt_spread(r)}x in wall time "
            f"({st.fmt(r.get('abs_test'), '{:.1f}')} ms against {st.fmt(r.get('abs_base'), '{:.1f}')} ms; goal ≤ "
            f"{GOAL}x {v}), {st.fmt_spread(c)}x in the training thread's CPU time ({ms('added_update_cpu_ms')} ms "
            f"per update; the rank's other threads {ms('added_others_cpu_ms')} ms). The vote adds "
            f"{ms('added_hooks_ms')} ms of wall time, {ms('added_hooks_cpu_ms')} ms of it CPU (the rest waiting for "
            f"peers), the step after it {ms('added_step_ms')} ms for {ms('added_step_cpu_ms')} ms of CPU: "
            f"{together(f)}.")


def readme_bullet(res: dict[str, Any]) -> str:
    """The README's bullet of this part (``benchmarks/harness/figures.py`` places it): every case in one."""
    diffs = res.get("diffs") or {}
    lines = " and ".join(f"{d['changed']} lines of the {name} example" for name, d in diffs.items())
    cases = case_names(res)
    return (f"- **The torchrun drop-in's cost** (`launch`, the {res.get('example')} example, every rank timed at "
            f"`optimizer.step`): protecting a torchrun script changes {lines} (substantive lines, against the plain "
            f"original). A protected update under `accelpact-run`, against the plain script's under torchrun on the "
            f"same mesh{', per case' if len(cases) > 1 else ''}: "
            + " ".join(_case_clause(res, case) for case in cases))


def goal_rows(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The goals table's lines of this part: (goal, verdict, measured); one per-update goal per case."""
    diffs = res.get("diffs") or {}
    out = [(f"a protected torchrun example changes ≤ {MAX_CHANGED} lines of its plain original",
            "met" if diffs and all(d["changed"] <= MAX_CHANGED for d in diffs.values()) else "not met",
            ", ".join(f"{name} {d['changed']}" for name, d in diffs.items()))]
    for case in case_names(res):
        cv = case_result(res, case)
        v, cause = verdict(cv)
        out.append((f"{case}: a protected update under accelpact-run ≤ {GOAL}x plain torchrun's (same script, same "
                    f"{mesh(cv)} mesh)", v, f"{st.fmt_spread(figures_of(cv)['ratio'])}x; {cause}"))
    return out


# ====================================================================== the docs section


def _case_block(res: dict[str, Any], case: str) -> list[str]:
    cv = case_result(res, case)
    f = figures_of(cv)
    arms = cv.get("arms") or []
    threads = {arm: sorted({str(x) for r in _arm_runs(cv, arm) for x in r.get("threads") or []}) for arm in arms}
    env = ", ".join(f"`{k}={v}`" for k, v in (cv.get("env") or {}).items())
    per_node = f"{cv['per_node']} rank{'' if cv['per_node'] == 1 else 's'}"
    lines = [f"**Case `{case}`**: {cv['nodes']} nodes x {per_node} per node, {cv.get('what')}; the "
             f"script's arguments: {_args(cv)}" + (f"; {env} for every run" if env else "") + ". Torch threads per "
             "rank (as the hook read them): " + ", ".join(f"{arm} {'/'.join(t) or 'n/a'}" for arm, t in threads.items())
             + ".", "",
             "| run | per-update ms, median (min–max over runs) | every rank's median ms (median over runs) | the "
             "optimizer's pre-hooks (the vote) ms | the step ms | the rest ms | the training thread's CPU ms per "
             "update | the other threads' CPU ms per update | the ranks reach the step / begin it, ms apart | runs |",
             "|---|---|---|---|---|---|---|---|---|---:|"]
    for arm in arms:
        rs = _arm_runs(cv, arm)
        ranks = sorted({k for r in rs for k in r["per_rank"]}, key=int)
        per_rank = ", ".join(st.fmt(st.med([r["per_rank"][k]["update"] for r in rs if k in r["per_rank"]]), "{:.1f}")
                             for k in ranks) if rs else "n/a"
        cells = [st.fmt_spread(f[f"{seg}_ms"][arm], "{:.1f}")
                 for seg in ("hooks", "step", "outside", "update_cpu", "others_cpu")]
        cells.append(" / ".join(st.fmt(f["apart_ms"][arm][w].get("median"), "{:.1f}") for w in ("pre", "mid")))
        update = st.fmt_spread(st.spread([r["pooled"]["update"] for r in rs]), "{:.1f}")
        lines.append(f"| {arm_text(cv, arm)} | {update} | {per_rank} | {' | '.join(cells)} | {len(rs)} |")
    v, cause = verdict(cv)
    r = f["ratio"]
    n_all = cv["nodes"] * cv["per_node"]
    lines += ["", f"**`{case}`, protected / plain, per update: {st.fmt_spread(r)}x** over {r.get('n', 0)} pairs "
              f"(goal ≤ {GOAL}x: {v}); {cause}. The training thread's CPU time per update, protected / plain: "
              f"{st.fmt_spread(f['cpu_ratio'])}x."
              + (f" Plain torchrun 1 x {n_all} / {mesh(cv)}: {st.fmt_spread(f['ref_1x4'])}x."
                 if f["ref_1x4"].get("n") else "")
              + (f" Rank 0's `step` events of the protected runs give {st.fmt_spread(f['events_vs_hook'], '{:.3f}')}"
                 "x the hook's rank 0 median (the events time the update from one commit to the next)."
                 if f["events_vs_hook"].get("n") else "")
              + (" Failed runs: " + "; ".join(f["failed"]) if f["failed"] else "")]
    return lines


def markdown(res: dict[str, Any]) -> str:
    diffs = res.get("diffs") or {}
    cases = case_names(res)
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
    with_1x4 = any("plain1x4" in (case_result(res, c).get("arms") or []) for c in cases)
    which = (f"each case ({', '.join(f'`{c}`' for c in cases)}), each case with its own pairs" if len(cases) > 1
             else f"the `{cases[0]}` case")
    lines += ["", f"Per-update cost: the {res.get('example')} example, {res.get('steps')} updates per run, the first "
              f"{res.get('warmup')} left out, {res.get('trials')} trials of {which}"
              + ": the plain script under torchrun (one agent per node) and the protected one under accelpact-run "
              "with the same nodes and ranks per node, in ABBA order"
              + (", with every rank on one torchrun agent beside them (`--with-1x4`)" if with_1x4 else "")
              + ". Every rank is timed by one hook in both (torch's global optimizer-step hooks, "
              "`benchmarks/parts/launch_timer.py`); an update runs from one `optimizer.step()`'s return to the "
              "next one's. The baseline is torchrun on the same mesh (one agent per node): `torchrun "
              "--nproc-per-node 4` builds a 1 x 4 mesh, without the replication group, so its update does less work "
              "(`--with-1x4` runs it beside the tiny-2x2 case as a reference)."
              + (" The cases tell the vote's fixed cost apart from the wait for a core: `tiny-2x2` shares 2 cores "
                 "among 4 ranks and their helper threads with updates of a few tens of ms, `wide-2x1` gives each "
                 "rank a core and an update of a few hundred ms." if {"tiny-2x2", "wide-2x1"} <= set(cases) else "")]
    for case in cases:
        lines += ["", *_case_block(res, case)]
    return "\n".join([*lines, "", MARK])
