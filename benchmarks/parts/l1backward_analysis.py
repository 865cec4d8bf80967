"""L1 backward benchmark, the analysis: where a replication-link fault is first seen, what then happens, detection
to commit (pure functions).

The fault model is the inter-node link (the replication group's) failing at a uniformly random moment.  Nothing
notices it until the next collective that crosses nodes; that collective's timeout is the detection.  The entry
point records, per rank and update attempt, the phases and every cross-node collective (``xnode``: where it was
issued, its start and end), so each drawn moment is mapped to the collective that would see the fault:

``backward``  the moment falls before the end of update U's last backward all-reduce on the replication group
              (the next batch, the forward, the backward): seen in U's backward all-reduces, which is what
              ``backward:U:RANK`` does (the rank withholds every replication all-reduce of U's backward);
``boundary``  after that, until the guard's boundary all-reduce of U's vote ends: seen there, which is what
              ``boundary:U-1:RANK`` does (``boundary:STEP`` fires in the vote of update STEP + 1);
``next``      after the boundary all-reduce (the vote over the control plane, the optimizer step, zero_grad,
              the schedule, the commit, a snapshot without collective), no cross-node collective is left in U:
              seen in update U+1's backward all-reduces, before any optimizer stepped in U+1, which is what
              ``backward:U+1:RANK`` does;
``WHERE:NAME`` any other cross-node collective found before the next one of the above (in this job: the
              capture proof of the first snapshot of a start, ``get_state_dict``'s ``all_gather_object`` on the
              default group, ``after``): seen there; its run class is ``xnode`` (the entry point withholds a
              rank's part of the first cross-node collective after the first snapshot update's step).

Each case's outcome comes from real injected runs of its injection (L1: a ``repair`` event and no ``fail_stop``
or ``restart_load``); a case nothing ran for counts as not recovered.  The detection delay of a moment
(strike -> detection) is estimated as the time until the detecting collective starts (0 inside it) plus the
collective timeout: derived from the measured timings, not measured as such.
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks.harness import common as h

#: The phases of an update as the entry point times them, in order (``gap``: before it, the next batch).
PHASES = ("gap", "forward", "backward", "boundary", "step", "after")
TIMED = PHASES[1:]
PHASE_TITLES = {
    "gap": "before the update (the next batch)",
    "forward": "forward (entering the update, forward, loss)",
    "backward": "backward (FSDP's reduce-scatter in the node, all-reduce across nodes)",
    "boundary": "decision (the guard's boundary all-reduce, the vote over the control plane)",
    "step": "optimizer step",
    "after": "after the step (zero_grad, schedule, commit, snapshot)",
}
#: The cases of a drawn moment that the three injections reproduce, in order, and their run classes.
MAIN_CASES = ("backward", "boundary", "next")
CASE_RUN = {"backward": "backward", "boundary": "boundary", "next": "next"}
CASE_TITLES = {
    "backward": "before U's last backward all-reduce across nodes ends (next batch, forward, backward): "
                "seen in U's backward",
    "boundary": "from there until the guard's boundary all-reduce of U's vote ends: seen at the boundary",
    "next": "after U's boundary all-reduce (vote, optimizer step, commit, a snapshot's copy): seen in U+1's "
            "backward",
}


def case_run(case: str) -> str | None:
    """The run class whose injection reproduces the detection of ``case`` (None: nothing does)."""
    if case in CASE_RUN:
        return CASE_RUN[case]
    return "xnode" if case.split(":")[0] == "after" else None


def case_title(case: str, updates: Sequence[int] = ()) -> str:
    if case in CASE_TITLES:
        return CASE_TITLES[case]
    where, _, name = case.partition(":")
    at = f" of update {', '.join(map(str, updates))}" if updates else ""
    return f"before another cross-node collective ends (`{name}`, issued in the {where} phase{at}): seen there"


def case_label(case: str, updates: Sequence[int] = ()) -> str:
    """A short name of a case (``backward``, ``boundary``, ``next``, or the other collective and its updates)."""
    if case in CASE_TITLES:
        return case
    where, _, name = case.partition(":")
    return f"`{name}` ({where}{' of update ' + ', '.join(map(str, updates)) if updates else ''})"


def clean_records(records: Iterable[dict[str, Any]], fault_u: int, last_u: int) -> list[dict[str, Any]]:
    """The complete update attempts of a run's first start, less update 1 (first use of every group), the faulted
    update and the one after it (the first on replacement groups), and the last update (no next update to see a
    fault in)."""
    return [r for r in records if r.get("restart", 0) == 0 and not r.get("discarded") and "xnode" in r
            and all(r.get(p) is not None for p in TIMED) and 2 <= r["u"] < last_u
            and r["u"] not in (fault_u, fault_u + 1)]


def windows(records: Sequence[dict[str, Any]], fault_u: int, last_u: int) -> list[dict[str, Any]]:
    """Per clean attempt (rank x update): the window ``[-gap, dur)`` seconds from its start, its phase bounds, its
    cross-node collectives and ``lead``: from its end to the next update's first cross-node collective (that
    update's own when it is clean, else the run's median)."""
    clean = clean_records(records, fault_u, last_u)
    ids = {id(r) for r in clean}
    nxt: dict[int, dict[str, Any]] = {}
    last: dict[int, dict[str, Any]] = {}
    for r in records:  # each rank's lines are in its own order
        if r.get("restart", 0) == 0:
            prev = last.get(r["rank"])
            if prev is not None and id(prev) in ids and r["u"] == prev["u"] + 1:
                nxt[id(prev)] = r
            last[r["rank"]] = r

    def lead_of(r: dict[str, Any] | None) -> float | None:
        if r is None or id(r) not in ids or not r["xnode"]:
            return None
        return (r.get("gap") or 0.0) + max(0.0, r["xnode"][0][2])

    leads = [x for x in (lead_of(r) for r in clean) if x is not None]
    fallback = statistics.median(leads) if leads else 0.0
    out = []
    for r in clean:
        bounds, t = [], 0.0
        for p in TIMED:
            t += max(0.0, float(r[p]))
            bounds.append(t)
        lead = lead_of(nxt.get(id(r)))
        out.append({"u": r["u"], "rank": r["rank"], "gap": max(0.0, float(r.get("gap") or 0.0)), "dur": t,
                    "bounds": bounds, "xnode": sorted(r["xnode"], key=lambda x: x[2]),
                    "lead": fallback if lead is None else lead, "lead_measured": lead is not None})
    return out


def classify(w: dict[str, Any], tau: float) -> tuple[str, str, float]:
    """``(case, phase, wait)`` of a moment ``tau`` seconds from the attempt's start (``-gap <= tau < dur``):
    ``wait`` is the time until the detecting collective starts (0 when the moment falls inside it)."""
    phase = "gap" if tau < 0 else TIMED[min(bisect.bisect_right(w["bounds"], tau), len(TIMED) - 1)]
    for where, name, start, end in w["xnode"]:
        if end > tau:
            case = "backward" if where == "backward" else "boundary" if where == "decision" else f"{where}:{name}"
            return case, phase, max(0.0, start - tau)
    return "next", phase, (w["dur"] - tau) + w["lead"]


def draw(ws: Sequence[dict[str, Any]], n: int, rng: random.Random) -> tuple[dict[str, int], dict[str, dict[str, int]],
                                                                              dict[str, list[float]]]:
    """``n`` uniformly random moments over the windows (ranks and updates concatenated: the faulting link's
    moment is as random as the update): counts per case, per case and phase, and the waits per case."""
    counts: dict[str, int] = {}
    by_phase: dict[str, dict[str, int]] = {}
    waits: dict[str, list[float]] = {}
    cum, total = [], 0.0
    for w in ws:
        total += w["gap"] + w["dur"]
        cum.append(total)
    if not ws or total <= 0:
        return counts, by_phase, waits
    for _ in range(n):
        x = rng.random() * total
        i = min(bisect.bisect_right(cum, x), len(ws) - 1)
        w = ws[i]
        tau = x - (cum[i] - w["gap"] - w["dur"]) - w["gap"]
        case, phase, wait = classify(w, tau)
        counts[case] = counts.get(case, 0) + 1
        by_phase.setdefault(case, {}).setdefault(phase, 0)
        by_phase[case][phase] += 1
        waits.setdefault(case, []).append(wait)
    return counts, by_phase, waits


def phase_stats(ws: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per phase: mean and median seconds per attempt, and share of the drawn time."""
    vals = {"gap": [w["gap"] for w in ws], **{p: [max(0.0, float(r[p])) for r in records] for p in TIMED}}
    total = sum(sum(v) for v in vals.values())
    return {p: {"mean_s": h.mean(v), "median_s": h.med(v), "share": sum(v) / total if total else 0.0}
            for p, v in vals.items()}


def verdicts(runs: Sequence[dict[str, Any]], cases: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per case: its run class and injection, ``verdict`` (l1 | l2 | None: nothing ran), the runs' outcomes."""
    out = {}
    for case in cases:
        cls = case_run(case)
        real = [r for r in runs if r.get("ok") and r.get("class") == cls] if cls else []
        outcomes = [r["outcome"] for r in real]
        if not outcomes:
            verdict = None
            why = "no injection reproduces it" if cls is None else f"its run ({cls}) did not run or failed"
            how = f"not run ({why}): counted as not recovered"
        else:
            n1 = outcomes.count("l1")
            verdict = "l1" if n1 == len(outcomes) else "l2"
            how = (f"{n1}/{len(outcomes)} real run(s) recovered in process (`repair`, no `fail_stop` or "
                   "`restart_load`)" if verdict == "l1" else
                   f"{len(outcomes) - n1}/{len(outcomes)} real run(s) went to L2 (exit {real[0].get('stop_exit')})")
        out[case] = {"run_class": cls, "injection": real[0].get("fault") if real else None, "verdict": verdict,
                     "outcomes": outcomes, "evidence": how, "runs": [r["name"] for r in real]}
    return out


def _wait_stats(xs: Sequence[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0, "median_s": None, "mean_s": None, "p90_s": None, "max_s": None}
    s = sorted(xs)
    return {"n": len(s), "median_s": statistics.median(s), "mean_s": sum(s) / len(s),
            "p90_s": s[min(len(s) - 1, int(0.9 * len(s)))], "max_s": s[-1]}


def shares(runs: Sequence[dict[str, Any]], n: int, seed: int, steps: int, collective_s: float) -> dict[str, Any]:
    """Draws over every run that ran all its updates (the L1 runs; an L2 run ends at its fault): per run N random
    moments, each mapped to its case; the share recovered in process now (the L1 cases) and before (the boundary
    case alone), per-case counts, phases and detection-delay estimates, pooled over the runs."""
    rng = random.Random(seed)
    per_run, pooled_recs, pooled_ws = [], [], []
    all_waits: dict[str, list[float]] = {}
    all_phase: dict[str, dict[str, int]] = {}
    for r in runs:
        if not (r.get("ok") and r.get("outcome") == "l1" and r.get("last_step") == steps):
            continue
        recs = r.get("timings") or []
        ws = windows(recs, r["fault_u"], steps)
        if not ws:
            continue
        pooled_ws += ws
        pooled_recs += clean_records(recs, r["fault_u"], steps)
        counts, by_phase, waits = draw(ws, n, rng)
        for c, xs in waits.items():
            all_waits.setdefault(c, []).extend(xs)
        for c, d in by_phase.items():
            for p, k in d.items():
                all_phase.setdefault(c, {}).setdefault(p, 0)
                all_phase[c][p] += k
        others = sorted({f"{x[0]}:{x[1]}@{w['u']}" for w in ws for x in w["xnode"]
                         if x[0] not in ("backward", "decision")})
        per_run.append({"run": r["name"], "attempts": len(ws), "counts": counts, "other_collectives": others,
                        "lead_measured": sum(w["lead_measured"] for w in ws)})
    cases = list(MAIN_CASES) + sorted({c for x in per_run for c in x["counts"]} - set(MAIN_CASES))
    where_seen: dict[str, set[int]] = {}
    for w in pooled_ws:
        for x in w["xnode"]:
            if x[0] not in ("backward", "decision"):
                where_seen.setdefault(f"{x[0]}:{x[1]}", set()).add(w["u"])
    return {"cases": cases, "per_run": per_run, "pooled_attempts": len(pooled_ws),
            "runs_drawn": len(per_run), "ranks": len({w["rank"] for w in pooled_ws}),
            "updates_of": {c: sorted(where_seen.get(c, ())) for c in cases if c not in MAIN_CASES},
            "pooled": phase_stats(pooled_ws, pooled_recs) if pooled_ws else {},
            "by_phase": all_phase, "collective_s": collective_s,
            "waits": {c: _wait_stats(all_waits.get(c, [])) for c in cases},
            "drawn": {c: sum(x["counts"].get(c, 0) for x in per_run) for c in cases}}


def score(s: dict[str, Any], v: dict[str, dict[str, Any]], n: int) -> None:
    """Adds the shares now (L1 cases) and before (the boundary case) to ``s`` and its runs."""
    l1 = [c for c in s["cases"] if v[c]["verdict"] == "l1"]
    for x in s["per_run"]:
        x["now"] = sum(x["counts"].get(c, 0) for c in l1) / n
        x["boundary"] = x["counts"].get("boundary", 0) / n
        x["share"] = {c: x["counts"].get(c, 0) / n for c in s["cases"]}
    total = sum(s["drawn"].values())
    s.update(l1_cases=l1, now=h.spread([x["now"] for x in s["per_run"]]),
             boundary_only=h.spread([x["boundary"] for x in s["per_run"]]),
             gain=h.spread([x["now"] / x["boundary"] for x in s["per_run"] if x["boundary"]]),
             case_share={c: h.spread([x["share"][c] for x in s["per_run"]]) for c in s["cases"]},
             pooled_share={c: (s["drawn"][c] / total if total else None) for c in s["cases"]})


def measured(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run class that recovered in process: the real runs' injection -> last detection and detection ->
    the faulted update committed."""
    out = {}
    for cls in ("backward", "boundary", "next"):
        rs = [r for r in runs if r.get("ok") and r.get("class") == cls and r.get("outcome") == "l1"]
        out[cls] = {"n": len(rs), "detect_spread_s": h.spread(r.get("detect_spread_s") for r in rs),
                    "detect_to_commit_s": h.spread(r.get("detect_to_commit_s") for r in rs),
                    "inject_to_commit_s": h.spread(r.get("inject_to_commit_s") for r in rs),
                    "repair_scope": sorted({(r.get("repairs") or [{}])[0].get("scope") or "?" for r in rs})}
    return out


def outside(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The faults that are not replication-link faults (forward: the shard group; the optimizer step raising):
    their real runs' outcomes."""
    rs = [r for r in runs if r.get("ok") and r.get("class") in ("forward", "step")]
    return {"runs": [{"name": r["name"], "fault": r["fault"], "outcome": r["outcome"], "exit": r.get("stop_exit")}
                     for r in rs],
            "recovered": h.spread([1.0 if r["outcome"] == "l1" else 0.0 for r in rs])}


def detection(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Detection -> update 16 committed, ours and torchft per round, and their paired ratios (torchft / ours)."""
    def col(side: str, key: str) -> list[float]:
        return [x[side][key] for x in rounds if x.get(side, {}).get("ok") and x[side].get(key) is not None]

    pairs = [(x["torchft"]["detect_to_commit_s"], x["ours"]["detect_to_commit_s"]) for x in rounds
             if x.get("ours", {}).get("ok") and x.get("torchft", {}).get("ok")
             and x["ours"].get("detect_to_commit_s") is not None]
    ours_units = [x["ours"]["detect_to_commit_s"] / x["ours"]["update_s"] for x in rounds
                  if x.get("ours", {}).get("ok") and x["ours"].get("detect_to_commit_s") is not None
                  and x["ours"].get("update_s")]
    tft_units = [x["torchft"]["detect_to_commit_s"] / x["torchft"]["update_s"] for x in rounds
                 if x.get("torchft", {}).get("ok") and x["torchft"].get("update_s")]
    return {"ratio": h.ratio_stats(pairs),
            "ours": {k: h.spread(col("ours", k)) for k in ("detect_to_commit_s", "inject_to_commit_s",
                                                             "repair_total_s", "update_s", "redo_update_s")},
            "torchft": {k: h.spread(col("torchft", k)) for k in ("detect_to_commit_s", "inject_to_commit_s",
                                                                 "update_s", "redo_update_s")},
            "ours_in_updates": h.spread(ours_units), "torchft_in_updates": h.spread(tft_units)}


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    s, d, p, v, o = res["shares"], res["detection"], res["params"], res["cases"], res["outside"]
    l1 = " + ".join(s["l1_cases"]) or "none"
    lost = [c for c in s["cases"] if v[c]["verdict"] != "l1" and s["drawn"].get(c)]
    how = (f"{p['draws']} uniformly random moments per run (seed {p['seed']}) over {s['pooled_attempts']} timed "
           f"update attempts x ranks of {len(s['per_run'])} run(s), each mapped to the collective that first sees "
           "the fault and to the real runs of the injection that reproduces it; spread over runs")
    goal, low = s["now"]["median"], s["now"]["min"]
    met = ("n/a" if goal is None else "met in every run" if low >= 0.95 else
           f"met by the median, not by every run (min {low:.3f})" if goal >= 0.95 else "not met")
    not_rec = "; ".join(f"{case_label(c, s['updates_of'].get(c, ()))}: {h.fmt(s['pooled_share'][c], '{:.3f}')} of "
                        f"the moments ({v[c]['evidence']})" for c in lost)
    rows = [
        h.row(f"replication-link fault at a uniformly random moment: share recovered in process now ({l1})",
              "every drawn moment (goal 0.95)", s["now"], unit="of faults",
              note=f"goal {met}; {how}" + (f"; not recovered: {not_rec}" if not_rec else "")),
        h.row("the same moments: share recovered in process before backward faults were repaired (seen at the "
              "boundary all-reduce)", "every drawn moment", s["boundary_only"], unit="of faults", note=how),
        h.row("share recovered in process now / before", "boundary-only share, same moments", s["gain"],
              note=f"pooled: {h.fmt(sum(s['pooled_share'][c] or 0 for c in s['l1_cases']), '{:.3f}')} now, "
                   f"{h.fmt(s['pooled_share'].get('boundary'), '{:.3f}')} before"),
    ]
    if o["runs"]:
        rows.append(h.row(
            "faults that are not replication-link faults (a rank's forward fails: shard group; the optimizer step "
            "raises): share of real runs recovered in process", "real injected runs", o["recovered"],
            unit="of runs", note="; ".join(f"{x['fault']}: {x['outcome'].upper()} (exit {x['exit']})"
                                           for x in o["runs"]) + "; not part of the drawn moments"))
    if res["torchft"].get("status") == "ok" and d["ratio"]["n"]:
        oo, t = d["ours"]["detect_to_commit_s"], d["torchft"]["detect_to_commit_s"]
        rows.append(h.row(
            f"torchft discard-and-heal: detection → update {p['fault_u']} committed (replica group 1 withholds its "
            "part of the update's gradient all-reduce)",
            f"ours L1 backward repair (`{p['faults']['backward']}`), same round", d["ratio"],
            note=f"{h.fmt(t['median'], '{:.3f}')} s vs {h.fmt(oo['median'], '{:.3f}')} s; detection = the last "
                 f"rank's `fault` event (ours), the survivor's failed all-reduce (torchft), both after the "
                 f"{p['collective_s']:g} s collective timeout; torchft: 2 replica groups x 1 process, plain "
                 "all-reduce; ours: 2 x 2 FSDP1 HSDP"))
    else:
        oo = d["ours"]["detect_to_commit_s"]
        failed = [x["torchft"].get("error") for x in res.get("rounds", []) if "torchft" in x]
        why = (f"torchft not run: {res['torchft'].get('reason', 'unavailable')}" if res["torchft"].get("status") != "ok"
               else f"no torchft run completed: {(failed or ['none ran'])[0]}")
        rows.append(h.row(f"ours: detection → update {p['fault_u']} committed (L1 backward repair)",
                          "our median uninterrupted update, same run", d["ours_in_updates"],
                          note=f"{h.fmt(oo['median'], '{:.3f}')} s; {why[:300]}"))
    return rows
