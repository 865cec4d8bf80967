"""Checkpoint benchmark, the analysis (pure): paired step-time ratios, daemon latencies, goals, overview rows.

Every figure is paired by round with the round's two ``none`` segments (``benchmarks/parts/ckpt.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.ckpt_setup import ASYNC_DCP, MODES, is_snapshot

SPREAD_KEYS = ("ratio", "others_ratio", "drain_s", "added_per_snapshot_s", "blocking_s", "snapshot_step_s",
               "baseline_step_s", "baseline_at_snapshot_places_s", "mean_step_s", "memcpy_floor_s",
               "memcpy_floor_before_s", "memcpy_floor_after_s", "blocking_over_floor")


def summarize_steps(records: list[dict[str, Any]], segments: list[dict[str, Any]],
                    plan: dict[str, Any]) -> dict[str, Any]:
    """Per mode: paired (by round) step-time ratios vs none and added time per snapshot (pure)."""
    mean = h.mean
    drains = {(s["round"], s["mode"]): s["drain_s"] for s in segments}
    timed = [r for r in records if r.get("mode") not in (None, "warmup")]
    by: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in timed:
        by.setdefault((r["round"], r["mode"]), []).append(r)
    rounds = sorted({k[0] for k in by})
    modes = [m for m in MODES if any(k[1] == m for k in by)]
    out: dict[str, Any] = {}
    for m in modes:
        per_round = []
        for rnd in rounds:
            seg, base = by.get((rnd, m)), by.get((rnd, "none"))
            if not seg or not base:
                continue
            base_all = mean([r["step_s"] for r in base])  # both none segments of the round
            snaps = [r for r in seg if r["snap"]]
            # the baseline of a snapshot's update: the no-snapshot updates at the same places in their segments
            # (a segment's first update is slower anyway: it follows the drain and the barriers)
            base_at = mean([r["step_s"] for r in base if r["pos"] in {s["pos"] for s in snaps}]) if snaps else None
            # a DefaultStager snapshot also costs the wait it causes before the next optimizer step
            nxt = {r["step"]: r for r in seg}
            waits = [nxt[r["step"] + 1]["staging_wait_s"] if r["step"] + 1 in nxt else 0.0 for r in snaps]
            per_round.append({
                "round": rnd,
                "baseline_step_s": base_all,
                "mean_step_s": mean([r["step_s"] for r in seg]),
                "ratio": mean([r["step_s"] for r in seg]) / base_all,
                "others_ratio": (mean([r["step_s"] for r in seg if not r["snap"]])
                                 / mean([r["step_s"] for r in base if not is_snapshot(plan, m, r["pos"])])
                                 if m != "none" else 1.0),
                "drain_s": drains.get((rnd, m)),
                "snapshot_step_s": mean([r["step_s"] for r in snaps]),
                "baseline_at_snapshot_places_s": base_at,
                "snapshot_places": sorted({r["pos"] for r in snaps}),
                "added_per_snapshot_s": (mean([r["step_s"] + w for r, w in zip(snaps, waits)]) - base_at)
                if snaps else None,
                "blocking_s": mean([r["block_s"] + w for r, w in zip(snaps, waits)]) if snaps else None,
                "parts": mean_parts([r["parts"] for r in snaps]),
            })
            # the updates without a snapshot by their place in the window (the first after a snapshot also
            # fingerprints the state for the replay check; the daemons' work spreads over all of them)
            row_pos = {}
            for pos in sorted({r["pos"] for r in seg if not r["snap"]}):
                mine = [r["step_s"] for r in seg if r["pos"] == pos]
                theirs = [r["step_s"] for r in base if r["pos"] == pos]
                if mine and theirs and m != "none":
                    row_pos[str(pos)] = mean(mine) / mean(theirs)
            per_round[-1]["others_by_pos"] = row_pos
            row = per_round[-1]
            row.update(floor_figures(snaps))
        out[m] = {"rounds": per_round, **{k: h.spread([p.get(k) for p in per_round]) for k in SPREAD_KEYS}}
        positions = sorted({k for p in per_round for k in (p.get("others_by_pos") or {})}, key=int)
        out[m]["others_by_pos"] = {k: h.spread([(p.get("others_by_pos") or {}).get(k) for p in per_round])
                                   for k in positions}
    return out


def floor_figures(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """The memcpy floor of one round's snapshots: copied right before and right after each snapshot (both
    orders apart), the floor of a snapshot the mean of its two; blocking over floor per snapshot, a snapshot
    that blocked less than its floor flagged (and counted), not averaged away (pure)."""
    mean = h.mean
    out: dict[str, Any] = {}
    for when in ("before", "after"):
        vals = [r[f"memcpy_floor_{when}_s"] for r in snaps if r.get(f"memcpy_floor_{when}_s")]
        out[f"memcpy_floor_{when}_s"] = mean(vals) if vals else None
    per = []
    for r in snaps:
        pair = [r.get(f"memcpy_floor_{w}_s") for w in ("before", "after")]
        pair = [v for v in pair if v] or ([r["memcpy_floor_s"]] if r.get("memcpy_floor_s") else [])
        if pair:
            per.append((r["step"], r["block_s"], mean(pair)))
    out["memcpy_floor_s"] = mean([f for _s, _b, f in per]) if per else None
    out["blocking_over_floor"] = mean([b / f for _s, b, f in per]) if per else None
    out["below_floor"] = [{"step": s, "blocking_s": b, "floor_s": f} for s, b, f in per if b < f]
    probes = [r["page_probe"] for r in snaps if r.get("page_probe")]
    if probes:  # the page probe (ckpt_entry.PageProbe): each buffer's first write over its second, this round
        out["page_probe"] = {f"{name}_first_over_second{cpu}": mean([p[f"{name}_first{cpu}_s"]
                                                                     / p[f"{name}_second{cpu}_s"] for p in probes])
                             for name in ("dup", "uniq") for cpu in ("", "_cpu")}
        out["page_probe"]["minflt"] = sum(p["minflt"] for p in probes)
    cpu = [(r["parts"].get("copy_cpu"), r.get("floor_before_cpu_s")) for r in snaps]
    cpu = [(a, b) for a, b in cpu if a and b]
    if cpu:  # the slot copy's CPU time (this thread's) over the floor's, the same bytes; each one's CPU / wall
        out["copy_cpu_over_floor_cpu"] = mean([a / b for a, b in cpu])
        out["copy_cpu_s"] = mean([a for a, _ in cpu])
        share = [(r["parts"]["copy_cpu"] / r["parts"]["copy"], r["floor_before_cpu_s"] / r["memcpy_floor_before_s"])
                 for r in snaps if r["parts"].get("copy_cpu") and r["parts"].get("copy")
                 and r.get("floor_before_cpu_s") and r.get("memcpy_floor_before_s")]
        if share:
            out["copy_cpu_share"] = mean([a for a, _ in share])
            out["floor_cpu_share"] = mean([b for _, b in share])
    return out


def page_cause(steps: dict[str, Any]) -> str | None:
    """The blocking goal's cause as the rounds measured it: the slot copy's CPU time against the floor's, and the
    page probe's first and second writes (None without them)."""
    rounds = [r for r in (steps.get("ours") or {}).get("rounds", [])
              if r.get("page_probe") and r.get("copy_cpu_over_floor_cpu") and r.get("blocking_over_floor")]
    if not rounds:
        return None
    def one(r: dict[str, Any]) -> str:
        pp = r["page_probe"]
        why = ("its CPU time exceeds the floor's: first writes into idle pages, paid on the host of this virtual "
               "machine (no page fault in the guest)" if r["copy_cpu_over_floor_cpu"] >= 1.25 else
               "its CPU time is the floor's: it waited for a core" if r.get("copy_cpu_share", 1) < 0.8 *
               r.get("floor_cpu_share", 1) else "neither its CPU time nor its share of a core explains it")
        return (f"round {r['round']}: blocked {r['blocking_over_floor']:.2f}x the floor's wall time, the copy's CPU "
                f"time {r['copy_cpu_over_floor_cpu']:.2f}x the floor's, on a core "
                f"{r.get('copy_cpu_share', float('nan')):.2f} of its wall time against the floor's "
                f"{r.get('floor_cpu_share', float('nan')):.2f} ({why}); idle shared-memory pages' first write "
                f"{pp['dup_first_over_second_cpu']:.2f}x (duplicated bytes) and {pp['uniq_first_over_second_cpu']:.2f}x "
                f"(unique bytes) the CPU time of their second")

    faults = sum(r["page_probe"]["minflt"] for r in rounds)
    rounds = [r for r in rounds if r["blocking_over_floor"] > 1.5] or rounds  # the rounds over the goal
    return (f"per round over the goal, the copy into the slot (left idle through the other modes' segments) against the floor "
            f"(a buffer touched just before), and the page probe (ckpt_entry.PageProbe: two shared-memory buffers "
            f"left idle like the slot, written twice each before the floor; {faults} page faults in all): "
            + "; ".join(one(r) for r in rounds))


def mean_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for p in parts for k in p})
    return {k: sum(p.get(k, 0.0) for p in parts) / len(parts) for k in keys} if parts else {}


def daemon_latencies(events_path: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds from rank 0's snapshot call to each node daemon's committed / verified event."""
    calls = {r["step"]: r["wall"] for r in records if r.get("mode") == "ours" and r.get("snap")}
    out: dict[str, list[float]] = {"committed": [], "verified": []}
    sizes = []
    parts: dict[str, list[float]] = {}
    if not events_path.exists():
        return {}
    for line in events_path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") != "checkpoint" or ev.get("step") not in calls:
            continue
        st = ev.get("state")
        if st in out:
            out[st].append(ev["ts"] - calls[ev["step"]])
        if st == "committed" and ev.get("size_bytes"):
            sizes.append(ev["size_bytes"])
        if st == "committed":
            for k in ("dcp_save_s", "fsync_hash_s"):
                if ev.get(k) is not None:
                    parts.setdefault(k, []).append(ev[k])
    res: dict[str, Any] = {k: h.spread(v) for k, v in out.items()}
    res["node_snapshot_bytes"] = h.med(sizes)
    res["writer_parts_s"] = {k: h.med(v) for k, v in parts.items()}
    return res


def _best(steps: dict[str, Any], key: str) -> tuple[str | None, float | None]:
    """DCP's best async mode by the median of ``key`` (lowest)."""
    best_mode, best = None, None
    for m in ASYNC_DCP:
        v = steps.get(m, {}).get(key, {}).get("median")
        if v is not None and (best is None or v < best):
            best_mode, best = m, v
    return best_mode, best


def goals(steps: dict[str, Any], bw: dict[str, Any]) -> dict[str, Any]:
    ours = steps.get("ours", {})
    best_mode, best = _best(steps, "added_per_snapshot_s")
    ours_added = ours.get("added_per_snapshot_s", {}).get("median")
    g1 = None
    if ours_added is not None and best is not None:
        g1 = ours_added <= 0.5 * best
    best_blk_mode, best_blk = _best(steps, "blocking_s")
    ours_blk = ours.get("blocking_s", {}).get("median")
    ratio = bw.get("ratio_ceiling", {}).get("median")
    by_order = order_ratios(bw)
    over_floor = ours.get("blocking_over_floor", {}).get("median")
    others = ours.get("others_ratio", {}).get("median")
    cpu = bw.get("cpu_s_per_gib") or {}
    daemon_cpu = (cpu["write"] + cpu["verify"]) if cpu.get("write") is not None and cpu.get("verify") is not None \
        else None
    return {
        "daemon_cpu": {"goal": "daemon CPU <= 0.7 s per GiB written and verified", "cpu_s_per_gib": daemon_cpu,
                       "write": cpu.get("write"), "verify": cpu.get("verify"),
                       "ceiling_write": cpu.get("ceiling_write"),
                       "digest_alone": cpu.get(f"{bw.get('digest', 'sha256')}_alone"),
                       "pass": None if daemon_cpu is None else daemon_cpu <= 0.7},
        "blocking_vs_floor": {"goal": "training blocked per snapshot <= 1.5 x the memcpy floor of the rank's bytes",
                              "median_ratio": over_floor, "pass": None if over_floor is None else over_floor <= 1.5,
                              **({"cause": page_cause(steps)} if over_floor is not None and over_floor > 1.5
                                 and page_cause(steps) else {})},
        "background": {"goal": "updates between snapshots <= 1.1 x the no-snapshot update", "median_ratio": others,
                       "pass": None if others is None else others <= 1.1},
        "write_bandwidth_both_orders": {
            "goal": "daemon write bandwidth >= 0.9 x the ceiling of its shape, with the ceiling run first and second",
            **by_order, "pass": None if None in by_order.values() else min(by_order.values()) >= 0.9},
        "snapshot_cost": {
            "goal": "added time per snapshot <= 0.5 x DCP's best async mode",
            "ours_added_s": ours_added, "best_async_mode": best_mode, "best_async_added_s": best,
            "limit_s": None if best is None else 0.5 * best, "pass": g1,
            "blocking_check": {"ours_blocking_s": ours_blk, "best_async_mode": best_blk_mode,
                               "best_async_blocking_s": best_blk,
                               "pass": None if ours_blk is None or best_blk is None else ours_blk <= 0.5 * best_blk},
        },
        "write_bandwidth": {"goal": "daemon write bandwidth >= 0.9 x the ceiling of its shape (as many files and "
                                    "threads, the same sink and fsync pattern, no serialisation or digest)",
                            "median_ratio": ratio, "dd_median_ratio": bw.get("ratio_full", {}).get("median"),
                            "pass": None if ratio is None else ratio >= 0.9},
    }


def order_ratios(bw: dict[str, Any]) -> dict[str, float | None]:
    """Median ours/ceiling ratio by which of the two wrote first in its round."""
    pairs = [p for p in bw.get("pairs", []) if p.get("ratio_ceiling") is not None]
    return {"ceiling_second": h.med([p["ratio_ceiling"] for p in pairs if p["ours_before_ceiling"]]),
            "ceiling_first": h.med([p["ratio_ceiling"] for p in pairs if not p["ours_before_ceiling"]])}


def rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The overview rows (``harness.row``)."""
    st, bw, g = res.get("steps", {}), res.get("bandwidth", {}), res.get("goals", {})
    out = []
    best = (g.get("snapshot_cost") or {}).get("best_async_mode")
    ours = st.get("ours", {}).get("rounds", [])
    if best and ours:
        by_round = {r["round"]: r for r in ours}
        base = {r["round"]: r for r in st.get(best, {}).get("rounds", [])}

        def paired(key: str) -> dict[str, Any]:
            return h.spread(h.paired_ratios({k: r.get(key) for k, r in by_round.items()},
                                            {k: r.get(key) for k, r in base.items()}))

        out.append(h.row(f"checkpoint: added time per snapshot, ours (110M params, 2x2 ranks, K={res['plan']['every']})",
                         f"DCP's best async mode in the same round (`{best}`)", paired("added_per_snapshot_s"),
                         note="goal <= 0.5: " + ("PASS" if g["snapshot_cost"]["pass"] else "FAIL")))
        out.append(h.row("checkpoint: training blocked per snapshot, ours", f"`{best}` in the same round",
                         paired("blocking_s")))
    if "none" in st and ours:
        out.append(h.row("checkpoint: mean update time with a snapshot every K updates, ours",
                         "no snapshots, same round", st["ours"]["ratio"]))
        between = [r["others_ratio"] for r in ours if r.get("others_ratio") is not None]
        if between:
            gb = g.get("background") or {}
            out.append(h.row("checkpoint: updates between snapshots (the daemons writing and verifying beside them), "
                             "ours", "no-snapshot update at the same place in the window, same round", h.spread(between),
                             note="goal <= 1.1: " + ("PASS" if gb.get("pass") else "FAIL")))
    over = [r["blocking_over_floor"] for r in ours if r.get("blocking_over_floor") is not None]
    if over:
        gf = g.get("blocking_vs_floor") or {}
        out.append(h.row("checkpoint: training blocked per snapshot against the memcpy floor, ours",
                         "memcpy floor: a plain copy of the rank's same bytes into a touched buffer of their size, "
                         "same ranks, right before and right after each snapshot (their mean)", h.spread(over),
                         note="goal <= 1.5: " + ("PASS" if gf.get("pass") else "FAIL")))
    if bw.get("ratio_ceiling"):
        out.append(h.row("checkpoint: daemon write bandwidth (whole write path)",
                         "the ceiling of its shape: as many files written in parallel, the same sink (direct I/O "
                         "where the file system allows it) and fsync pattern, the same bytes, no serialisation or "
                         "digest; same round, order rotated",
                         bw["ratio_ceiling"], note="goal >= 0.9: " + ("PASS" if g["write_bandwidth"]["pass"] else "FAIL")))
    if bw.get("ratio_full"):
        out.append(h.row("checkpoint: daemon write bandwidth (whole write path), for reference",
                         "`dd conv=fsync` of the same size (one stream, one fsync), same filesystem, same round",
                         bw["ratio_full"]))
    return out
