"""L1 repair benchmark, the analysis (pure): the ranks' records to paired ratios, fits and overview rows
(``benchmarks/parts/repair.py``).
"""

from __future__ import annotations

import statistics

from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.repair_setup import PHASES

_ratio = h.ratio


#: ``main.method`` of a result whose floor is the slowest member's, over many samples (older results have none:
#: one sample, timed on the lead rank only, after a world barrier).
FLOOR_METHOD = "slowest-member, median over samples"


def _floor_start_skew(ranks: list[dict[str, Any]], pair: dict[str, Any]) -> float | None:
    """Median over a repair's floor samples of how far apart (ms) its members started each (None: not recorded)."""
    k, members = pair["k"], pair["ranks"]
    starts = [ranks[r]["main"][k].get("floor_starts") or [] for r in members]
    n = min((len(x) for x in starts), default=0)
    skews = [(max(x[i] for x in starts) - min(x[i] for x in starts)) * 1e3 for i in range(n)
             if all(x[i] is not None for x in starts)]
    return statistics.median(skews) if skews else None


def from_last_arrival(ranks: list[dict[str, Any]], k: int, members: list[int]) -> dict[str, Any] | None:
    """Repair ``k`` and its floor samples each timed from its round's last arrival to its slowest member's end
    (one clock: CLOCK_MONOTONIC is the machine's): the repair from the last rank's entry into the vote, a floor
    sample from the last rank's entry into its barrier.  Counts every rank's wake-up and any work a rank did
    before its own start (None: not recorded)."""
    recs = [r["main"][k] for r in ranks]
    if not all(x.get("vote_marks", {}).get("vote_enter") for x in recs) or not all(x.get("floor_entries") for x in recs):
        return None
    decided = max(x["vote_marks"]["vote_enter"] for x in recs)
    done = max(recs[r]["repair_rank"]["marks"]["start"] + recs[r]["repair_rank"]["total_s"] for r in members)
    samples = []
    for i in range(min(len(x["floor_entries"]) for x in recs)):
        entered = [x["floor_entries"][i] for x in recs]
        ends = [(recs[r]["floor_starts"] or [None] * (i + 1))[i] for r in members]
        took = [(recs[r]["floor_samples_s"] or [None] * (i + 1))[i] for r in members]
        if None in entered or None in ends or None in took:
            continue
        samples.append(max(e + t for e, t in zip(ends, took)) - max(entered))
    if not samples:
        return None
    return {"repair_s": done - decided, "floor_s": h.med(samples), "floor_samples_s": samples,
            "ratio": _ratio(done - decided, h.med(samples))}


def floor_of(ranks: list[dict[str, Any]], k: int, members: list[int]) -> dict[str, Any]:
    """Repair ``k``'s floor from its members' samples (pure).

    Each sample is timed on every member; a sample is done when its slowest member is, so the sample's figure
    is the max over members, and the floor is the median of those over the samples (one slow sample, a
    scheduler hiccup on the two shared cores, moves it little)."""
    per_rank = {r: [x for x in (ranks[r]["main"][k].get("floor_samples_s") or []) if x is not None]
                for r in members}
    n = min(len(v) for v in per_rank.values()) if per_rank else 0
    if n == 0:
        raise ValueError(f"repair {k}: no floor samples on members {members}")
    samples = [{str(r): per_rank[r][i] for r in members} for i in range(n)]
    sample_max = [max(x.values()) for x in samples]
    return {"samples_s": samples, "sample_max_s": sample_max, "floor_s": h.med(sample_max),
            "floor_per_rank_s": {str(r): h.med(per_rank[r]) for r in members},
            "sample_max_spread_s": h.spread(sample_max)}


def analyse(ranks: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    sp = h.spread
    # 1: repairs vs floor.  A repair is done when its slowest rank is: the figure is the max over the affected
    # ranks of each rank's own total (``repair_rank``); the phases are the lead's (the lowest affected rank
    # emits the engine's ``repair`` event with them).
    pairs = []
    for k in range(len(ranks[0]["main"])):
        members = ranks[0]["main"][k]["ranks"]
        lead = min(members)
        rec = ranks[lead]["main"][k]
        rep = rec["repair"]
        assert rep is not None, f"no repair event on rank {lead} for repair {k}"
        fl = floor_of(ranks, k, members)
        per_rank = {str(r["rank"]): r["main"][k]["repair_rank"]["total_s"] for r in ranks}
        repair_s = max(per_rank[str(r)] for r in members)
        pairs.append({
            "k": k, "step": rec["step"], "fault_rank": rec["fault_rank"], "ranks": members, "lead": lead,
            "position": rec.get("position"), "floor_first": rec["floor_first"],
            "floor_s": fl["floor_s"], "floor": fl,
            "repair_s": repair_s, "repair_per_rank_s": per_rank,
            "repair_all_ranks_max_s": max(per_rank.values()),
            "below_floor": repair_s < fl["floor_s"],
            "total_s": rep["total_s"], "lead_vs_floor": _ratio(rep["total_s"], fl["floor_s"]),
            "phases_s": rep["phases"], "rebound": rep["rebound"], "rebound_by_kind": rep["rebound_by_kind"],
            "fault_to_resume_s": rep["fault_to_resume_s"], "generation": rep["generation"],
            "update_s": rec["update_s"], "probes_s": rec["probes"], "scan_truncated": rec["scan_truncated"],
            "rank_totals_s": [r["main"][k]["repair_rank"]["total_s"] for r in ranks],
            # every rank's phases and their parts (older results: none)
            "rank_phases_s": {str(r["rank"]): r["main"][k]["repair_rank"].get("phases") for r in ranks},
            "rank_parts_s": {str(r["rank"]): r["main"][k]["repair_rank"].get("parts_s") for r in ranks},
            # time.monotonic() (one clock for the machine's processes) of each rank's start, release and exit
            "rank_marks": {str(r["rank"]): r["main"][k]["repair_rank"].get("marks") for r in ranks},
            # each rank's entry and exit of the faulted update's vote, and how late it entered the floor's barrier
            "vote_marks": {str(r["rank"]): r["main"][k].get("vote_marks") for r in ranks},
            "floor_arrival_s": {str(r["rank"]): r["main"][k].get("floor_arrival_s") for r in ranks},
            "from_last_arrival": from_last_arrival(ranks, k, members),
        })
    counted = [p for p in pairs if not p["below_floor"]]  # a repair faster than its floor is flagged, not counted
    phases: dict[str, Any] = {}
    for ph in PHASES:
        vals = [p["phases_s"][ph] for p in pairs]
        phases[ph] = {"ms": sp([v * 1e3 for v in vals]),
                      "share": sp([_ratio(v, p["total_s"]) for v, p in zip(vals, pairs)]),
                      "vs_floor": sp([_ratio(v, p["floor_s"]) for v, p in zip(vals, pairs)])}
    main = {
        "method": FLOOR_METHOD, "floor_samples": plan.get("floor_samples"),
        "pairs": pairs, "phases": phases,
        "repair_ms": sp([p["repair_s"] * 1e3 for p in pairs]),
        "total_ms": sp([p["total_s"] * 1e3 for p in pairs]),
        "floor_ms": sp([p["floor_s"] * 1e3 for p in pairs]),
        "total_vs_floor": sp([_ratio(p["repair_s"], p["floor_s"]) for p in counted]),
        "below_floor": [p["k"] for p in pairs if p["below_floor"]],
        "all_vs_floor": sp([_ratio(p["repair_s"], p["floor_s"]) for p in pairs]),
        "lead_vs_floor": sp([p["lead_vs_floor"] for p in pairs]),
        "by_position": {pos: sp([_ratio(p["repair_s"], p["floor_s"]) for p in counted if p["position"] == pos])
                        for pos in ("before", "after")},
        "rank_skew": sp([_ratio(max(p["repair_per_rank_s"][str(r)] for r in p["ranks"]),
                                min(p["repair_per_rank_s"][str(r)] for r in p["ranks"])) for p in pairs]),
        # The affected ranks' starts after the vote (one clock: CLOCK_MONOTONIC is the machine's): the first to
        # start waits that long in the build for its peer.
        "start_skew_ms": sp([(max(p["rank_marks"][str(r)]["start"] for r in p["ranks"])
                              - min(p["rank_marks"][str(r)]["start"] for r in p["ranks"])) * 1e3
                             for p in pairs if all((p.get("rank_marks") or {}).get(str(r)) for r in p["ranks"])]),
        "floor_start_skew_ms": sp([_floor_start_skew(ranks, p) for p in pairs
                                   if _floor_start_skew(ranks, p) is not None]),
        "floor_rank_skew": sp([_ratio(max(p["floor"]["floor_per_rank_s"].values()),
                                      min(p["floor"]["floor_per_rank_s"].values())) for p in pairs]),
        "data_plane_vs_floor": sp([_ratio(sum(p["phases_s"][x] for x in ("replace", "rebind", "validate")),
                                          p["floor_s"]) for p in pairs]),
        "replace_vs_floor": phases["replace"]["vs_floor"],
        # The invariant's check inside the repair, slowest member (the walk's finds read back, or the walk itself
        # where none was taken while the vote was in flight) and that walk (before the repair's start).
        "scan_ms": sp([max(((p["rank_parts_s"].get(str(r)) or {}).get("rebind.scan") or 0.0) for r in p["ranks"]) * 1e3
                       for p in pairs]),
        "walk_ahead_ms": sp([max(((p["rank_parts_s"].get(str(r)) or {}).get("rebind.walk_ahead") or 0.0)
                                 for r in p["ranks"]) * 1e3 for p in pairs]),
        # The floor in the repair's position: how late (ms) the last rank entered the floor's barrier, as in the vote.
        "floor_arrivals": "the repair's detecting members enter the floor's barrier the last faulted vote's detection "
                          "time after every other rank",
        "floor_late_ms": sp([max(v for v in p["floor_arrival_s"].values() if v is not None) * 1e3 for p in pairs
                             if any(v is not None for v in p["floor_arrival_s"].values())]),
        # Both timed from their round's last arrival to the slowest member's end.
        "from_last_arrival_vs_floor": sp([p["from_last_arrival"]["ratio"] for p in pairs if p["from_last_arrival"]]),
        "from_last_arrival_ms": sp([p["from_last_arrival"]["repair_s"] * 1e3 for p in pairs if p["from_last_arrival"]]),
        "floor_from_last_arrival_ms": sp([p["from_last_arrival"]["floor_s"] * 1e3 for p in pairs
                                          if p["from_last_arrival"]]),
        "scan_gc_ms": sp([((p["probes_s"].get("framework_roots.gc") or 0.0)
                           + (p["probes_s"].get("find_references.gc") or 0.0)) * 1e3 for p in pairs]),
        "rebind_all_ms": sp([None if p["probes_s"].get("rebind_all") is None else p["probes_s"]["rebind_all"] * 1e3
                             for p in pairs]),
        "fault_to_resume_s": sp([p["fault_to_resume_s"] for p in pairs]),
        "update_s": sp([p["update_s"] for p in pairs]),
        "rebound": sorted({p["rebound"] for p in pairs}),
        "rebound_by_kind": pairs[0]["rebound_by_kind"] if pairs else {},
    }

    # 2: guard overhead (block time = slowest rank)
    gpairs = []
    for i in range(len(ranks[0]["guard"])):
        g = max(r["guard"][i]["guarded"] for r in ranks)
        u = max(r["guard"][i]["unguarded"] for r in ranks)
        ex = h.med([r["guard"][i]["boundary_s"] + r["guard"][i]["vote_s"] for r in ranks])
        gpairs.append({"pair": i, "order": ranks[0]["guard"][i]["order"], "guarded_s": g, "unguarded_s": u,
                       "ratio": _ratio(g, u), "extras_s": ex,
                       "boundary_s": [r["guard"][i]["boundary_s"] for r in ranks],
                       "vote_s": [r["guard"][i]["vote_s"] for r in ranks]})
    K = plan["guard_block"]
    guard = {"pairs": gpairs, "ratio": sp([p["ratio"] for p in gpairs]),
             "extras_ms_per_update": sp([p["extras_s"] / K * 1e3 for p in gpairs]),
             "extras_vs_unguarded": sp([_ratio(p["extras_s"], p["unguarded_s"]) for p in gpairs]),
             "boundary_ms_per_update": sp([h.med(p["boundary_s"]) / K * 1e3 for p in gpairs]),
             "vote_ms_per_update": sp([h.med(p["vote_s"]) / K * 1e3 for p in gpairs]),
             "guarded_ms_per_update": sp([p["guarded_s"] / K * 1e3 for p in gpairs]),
             "unguarded_ms_per_update": sp([p["unguarded_s"] / K * 1e3 for p in gpairs]),
             "added_ms_per_update": sp([(p["guarded_s"] - p["unguarded_s"]) / K * 1e3 for p in gpairs])}

    # 3: rebinding vs depth (lead rank's records)
    sweep = []
    for j, entry in enumerate(ranks[0]["sweep"]):
        reps = []
        for i, rec0 in enumerate(entry["repairs"]):
            lead = min(rec0["ranks"])
            rec = ranks[lead]["sweep"][j]["repairs"][i]
            rep = rec["repair"]
            assert rep is not None, f"no repair event on rank {lead} (L={entry['layers']}, repair {i})"
            pr = rec["probes"]
            reps.append({"round": rec0["round"], "lead": lead, "rebound": rep["rebound"], "rebound_by_kind": rep["rebound_by_kind"],
                         "rebind_s": rep["phases"]["rebind"], "total_s": rep["total_s"],
                         "rebind_all_s": pr.get("rebind_all"),
                         # the invariant's walk: taken while the vote was in flight (the engine's part
                         # ``rebind.walk_ahead``), else inside the rebind phase (the probes)
                         "scan_s": ((rep.get("parts_s") or {}).get("rebind.walk_ahead")
                                    or (pr.get("framework_roots") or 0.0) + (pr.get("find_references") or 0.0)),
                         "walk_ahead": "rebind.walk_ahead" in (rep.get("parts_s") or {}),
                         "retire_s": pr.get("retire_group"), "scan_truncated": rec["scan_truncated"],
                         "scan_gc_s": (pr.get("framework_roots.gc") or 0.0) + (pr.get("find_references.gc") or 0.0)})
        refs = sorted({r["rebound"] for r in reps})
        sweep.append({
            "layers": entry["layers"], "width": entry["width"], "fsdp_units": entry["fsdp_units"],
            "build_s": sp(entry["build_s"]), "refs": refs, "reps": reps,
            "scans_truncated": sum(1 for r in reps if r["scan_truncated"]),
            "rebind_ms": sp([r["rebind_s"] * 1e3 for r in reps]),
            # None where nothing was rebound (the group reconfigured in place, torch 2.14.1+)
            "per_ref_us": sp([r["rebind_s"] / r["rebound"] * 1e6 if r["rebound"] else None for r in reps]),
            "rebind_all_per_ref_us": sp([None if r["rebind_all_s"] is None or not r["rebound"]
                                         else r["rebind_all_s"] / r["rebound"] * 1e6 for r in reps]),
            "scan_ms": sp([r["scan_s"] * 1e3 for r in reps]),
            "scan_gc_ms": sp([r["scan_gc_s"] * 1e3 for r in reps]),
            "retire_ms": sp([None if r["retire_s"] is None else r["retire_s"] * 1e3 for r in reps]),
            "total_ms": sp([r["total_s"] * 1e3 for r in reps]),
        })
    if sweep:
        base = {r["round"]: r for r in sweep[0]["reps"]}

        def paired(s: dict[str, Any], key: str, per_ref: bool) -> dict[str, Any]:
            """Ratios to the baseline depth's repair of the same round."""
            out = []
            for r in s["reps"]:
                b = base.get(r["round"])
                if b is None or r.get(key) is None or b.get(key) is None or (per_ref and not (r["rebound"]
                                                                                            and b["rebound"])):
                    continue
                out.append(_ratio(r[key] / (r["rebound"] if per_ref else 1), b[key] / (b["rebound"] if per_ref else 1)))
            return sp(out)

        for s in sweep:
            s["per_ref_vs_base"] = paired(s, "rebind_s", True)
            s["rebind_vs_base"] = paired(s, "rebind_s", False)
            s["rebind_all_per_ref_vs_base"] = paired(s, "rebind_all_s", True)
    fit = _fit([(r["rebound"], r["rebind_s"] * 1e3) for s in sweep for r in s["reps"]])
    fit_all = _fit([(r["rebound"], r["rebind_all_s"] * 1e3) for s in sweep for r in s["reps"]
                    if r["rebind_all_s"] is not None])
    return {"main": main, "guard": guard, "sweep": sweep, "fit_ms_per_ref": fit, "fit_rebind_all_ms_per_ref": fit_all}


def _fit(points: list[tuple[float, float]]) -> dict[str, Any] | None:
    """Least-squares line ``ms = intercept + slope * refs`` and Theil-Sen slope (median of pairwise slopes)."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    pw = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1]
    return {"slope_ms": slope, "intercept_ms": my - slope * mx, "theil_sen": h.spread(pw), "n": n}


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    m, g, sw = res["main"], res["guard"], res["sweep"]
    rows = [repair_row(m)]
    if len(sw) >= 2:
        a, b = sw[0], sw[-1]
        fit, fa = res.get("fit_ms_per_ref") or {}, res.get("fit_rebind_all_ms_per_ref") or {}
        refs = f"L={b['layers']} ({'/'.join(map(str, b['refs']))} refs)"
        base = f"L={a['layers']} ({'/'.join(map(str, a['refs']))} refs), same run, paired by round"
        rows.append(h.row(
            f"rebind phase (rebinding + invariant check + retire) per reference, {refs}", base, b["per_ref_vs_base"],
            note=f"{h.fmt_spread(b['per_ref_us'], '{:.0f}')} vs "
                 f"{h.fmt_spread(a['per_ref_us'], '{:.0f}')} µs/ref; fitted slope "
                 f"{h.fmt((fit.get('slope_ms') or 0) * 1e3, '{:.0f}')} µs/ref"))
        rows.append(h.row(
            f"rebinding alone (the references, no scan) per reference, {refs}", base,
            b["rebind_all_per_ref_vs_base"],
            note=f"{h.fmt_spread(b['rebind_all_per_ref_us'], '{:.1f}')} vs "
                 f"{h.fmt_spread(a['rebind_all_per_ref_us'], '{:.1f}')} µs/ref; fitted slope "
                 f"{h.fmt((fa.get('slope_ms') or 0) * 1e3, '{:.1f}')} µs/ref"))
    rows.append(h.row(
        "guarded update (boundary all-reduce + control-plane vote)",
        "the same update without the guard, ABBA blocks, slowest rank",
        g["ratio"], note=f"{h.fmt_spread(g['guarded_ms_per_update'], '{:.1f}')} vs "
                         f"{h.fmt_spread(g['unguarded_ms_per_update'], '{:.1f}')} ms/update"))
    return rows


#: The repair's goal: at most this many times its floor.
REPAIR_GOAL = 1.5


def repair_row(m: dict[str, Any]) -> dict[str, Any]:
    """The overview row of the repairs against their floor; for a result measured before the floor was the
    slowest member's over many samples, the old figure with what it was and that its successor awaits a run."""
    n = len(m["pairs"])
    if m.get("method") != FLOOR_METHOD:
        return h.row(
            f"L1 repair excluding detection (the engine's six phases, vote's decision to release), 2 x 2 ranks, "
            f"{n} injected boundary faults; measured on the lead rank only against one floor sample after a world "
            "barrier, not a floor: the slowest-rank figure awaits the next `make bench` run",
            "floor: new Gloo group with the same members + one all-reduce, same rank, adjacent in time",
            m["total_vs_floor"], note=f"repair {h.fmt_spread(m['total_ms'], '{:.1f}')} ms, "
                                      f"floor {h.fmt_spread(m['floor_ms'], '{:.1f}')} ms")
    below = m.get("below_floor") or []
    return h.row(
        f"L1 repair excluding detection (the engine's six phases, vote's decision to release), slowest affected "
        f"rank, 2 x 2 ranks, {n} injected boundary faults",
        f"floor: new Gloo group with the same members + one all-reduce, slowest member, median of "
        f"{m.get('floor_samples')} samples beside each repair (ABBA per group)",
        m["total_vs_floor"], note=f"repair {h.fmt_spread(m['repair_ms'], '{:.1f}')} ms, floor "
                                  f"{h.fmt_spread(m['floor_ms'], '{:.1f}')} ms; goal <= {REPAIR_GOAL:g}x; "
                                  + (f"{len(below)} of {n} below their floor, flagged and left out"
                                     if below else "none below its floor"))
