"""Peers benchmark, the analysis and the report: paired ratios, overview rows, the markdown block and its
reading, from the result JSON alone (``scripts/bench_peers.py``).
"""

from __future__ import annotations

from typing import Any

from bench import harness as h
from bench.peers_runs import FAULT, FAULT_STEP, PEERS, STEPS

PART = "peers"
MARK = "<!-- peers-bench -->"

# ====================================================================== analysis


def _pairs(runs: list[dict[str, Any]], a: str, b: str, key_a: str, key_b: str | None = None) -> list[tuple]:
    """(a value, b value) from every repeat where both runs are ok."""
    out = []
    for rep in runs:
        x, y = rep.get(a), rep.get(b)
        if x and y and x.get("ok") and y.get("ok") and x.get(key_a) is not None and y.get(key_b or key_a) is not None:
            out.append((x[key_a], y[key_b or key_a]))
    return out


def _vals(runs: list[dict[str, Any]], run: str, key: str) -> list[float]:
    return [rep[run][key] for rep in runs if rep.get(run, {}).get("ok") and rep[run].get(key) is not None]


def analyse(res: dict[str, Any]) -> None:
    runs, p = res["runs"], res["params"]
    T, S = p["main_timeout_s"], p["short_timeout_s"]
    sm: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    F = h.fmt

    def add(key: str, what: str, baseline: str, st: dict[str, Any], abs_text: str, note: str = "") -> None:
        sm[key] = st
        row = h.row(what, baseline, st, note=note)
        row["abs"] = abs_text
        row["key"] = key
        rows.append(row)

    for sys_, run in (("ours", "ours_T"), ("ours", "ours_S"), ("torchft", "torchft_T"), ("torchft", "torchft_S"),
                      ("nvrx", "nvrx")):
        for k in ("fault_to_resume_s", "step_s", "goodput", "beyond_timeout_s", "recovery_work_s", "after_detect_s",
                  "repair_total_s", "window_step_s",
                  "detect_s", "restart_entered_s", "pg_ready_s", "rejoin_s", "initial_start_s", "rejoin_import_s",
                  "rejoin_heal_step_s", "resume_step_s", "survivor_updates_before_rejoin"):
            v = _vals(runs, run, k)
            if v:
                sm.setdefault("abs", {}).setdefault(run, {})[k] = h.spread(v)

    ft_ok = res["peers"].get("torchft", {}).get("status") == "ok"
    nv_ok = res["peers"].get("nvrx", {}).get("status") == "ok"
    for run, t in (("T", T), ("S", S)):
        if not ft_ok:
            break
        st = h.ratio_stats(_pairs(runs, f"torchft_{run}", f"ours_{run}", "fault_to_resume_s"))
        dflt = " (torchft's default)" if t == 5 else ""
        add(f"f2r_torchft_{run}", f"torchft survivor: fault → update 16 committed; heartbeat timeout {t:g} s{dflt}",
            f"ours L1 (`accelpact-run`, {FAULT}), collective_s {t:g} s, same repeat", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s",
            "torchft: peer process killed; ours: peer withholds its part of the boundary all-reduce")
    if ft_ok:
        st = h.ratio_stats(_pairs(runs, "torchft_T", "ours_T", "beyond_timeout_s"))
        add("work_torchft_T", f"torchft: fault → update 16 minus the heartbeat timeout ({T:g} s)",
            f"ours: fault → update 16 minus collective_s ({T:g} s), same repeat", st,
            f"{F(st['abs_test'], '{:.3f}')} s vs {F(st['abs_base'], '{:.3f}')} s",
            "what follows detection: quorum + PG reconfigure + update 16 (2 processes) vs vote + six-phase repair "
            "+ update 16 (4 processes on 2 cores)")
    if nv_ok:
        st = h.ratio_stats(_pairs(runs, "nvrx", "ours_T", "fault_to_resume_s"))
        add("f2r_nvrx", "nvidia-resiliency-ext Wrapper: injected exception → update 16 committed (default intervals)",
            f"ours L1: fault → update 16, collective_s {T:g} s, same repeat", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s",
            "nvidia-resiliency-ext's fault raises on the faulting rank (no timeout to wait); ours must detect a "
            "silent one")
        st = h.ratio_stats(_pairs(runs, "nvrx", "ours_T", "fault_to_resume_s", "after_detect_s"))
        add("f2r_nvrx_after_detect", "nvidia-resiliency-ext Wrapper: injected exception → update 16 committed",
            "ours L1: detection (last rank's fault event) → update 16, same repeat", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'], '{:.3f}')} s",
            "both from the moment the fault is known to the recovery machinery")

    # Per-update overhead: each system against itself without its fault-tolerance layer.
    ov = [r for rep in runs for r in [rep.get("ours_overhead")] if r and r.get("ok")]
    st = h.spread([x for r in ov for x in r["ratios"]])
    st["abs_test"] = h.med([x for r in ov for x in r["test_step_s"]])
    st["abs_base"] = h.med([x for r in ov for x in r["base_step_s"]])
    add("ovh_ours", f"ours: guarded update (boundary all-reduce + vote), 4 ranks HSDP, collective_s {T:g} s",
        "the same update without the guard, interleaved segments, same processes", st,
        f"{F(st['abs_test'], '{:.4f}')} s vs {F(st['abs_base'], '{:.4f}')} s")
    if ft_ok:
        ov = [rep["torchft_T"]["overhead"] for rep in runs
              if rep.get("torchft_T", {}).get("ok") and rep["torchft_T"].get("overhead", {}).get("ok")]
        st = h.spread([x for r in ov for x in r["ratios"]])
        st["abs_test"] = h.med([x for r in ov for x in r["test_step_s"]])
        st["abs_base"] = h.med([x for r in ov for x in r["base_step_s"]])
        add("ovh_torchft", "torchft: managed update (quorum + allreduce + should_commit), 2 replica groups, "
            f"heartbeat timeout {T:g} s",
            "plain Gloo all-reduce update, interleaved segments, same processes", st,
            f"{F(st['abs_test'], '{:.4f}')} s vs {F(st['abs_base'], '{:.4f}')} s")
    if nv_ok:
        st = h.ratio_stats(_pairs(runs, "nvrx", "nvrx_plain", "window_step_s"))
        add("ovh_nvrx", "nvidia-resiliency-ext: update inside the Wrapper, 2 ranks",
            f"the same loop without the Wrapper (separate launch, same repeat); {p.get('window_steps')} updates "
            "between two barriers each", st,
            f"{F(st['abs_test'], '{:.4f}')} s vs {F(st['abs_base'], '{:.4f}')} s")
    if ft_ok:
        pairs = _pairs(runs, "torchft_T", "torchft_T", "rejoin_s", "initial_start_s")
        st = h.ratio_stats(pairs)
        add("rejoin_torchft", f"torchft: restarted group, start → first commit (quorum join + live heal), "
            f"heartbeat timeout {T:g} s", "the same group's first start (both groups starting) → first commit, "
            "same run", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s",
            "no equivalent in our L1: the faulting rank keeps its process and state")
    for key, run, label in (("goodput_ours", "ours_T", "ours"), ("goodput_torchft", "torchft_T", "torchft survivor"),
                            ("goodput_nvrx", "nvrx", "nvidia-resiliency-ext")):
        if (run.startswith("torchft") and not ft_ok) or (run == "nvrx" and not nv_ok):
            continue
        v = _vals(runs, run, "goodput")
        st = h.spread(v)
        st["abs_test"] = h.med(_vals(runs, run, "run_25_s"))
        st["abs_base"] = h.med([STEPS * x for x in _vals(runs, run, "step_s")])
        add(key, f"goodput, {label}: 25 updates with the fault after 15 (timeout {T:g} s)",
            "25 x the run's own median uninterrupted update", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s")
    res["summary"], res["rows"] = sm, rows


# ====================================================================== markdown


def _abs(sm: dict[str, Any], run: str, key: str, f: str = "{:.2f}") -> str:
    return h.fmt_spread(sm.get("abs", {}).get(run, {}).get(key), f)


def markdown(res: dict[str, Any]) -> str:
    p, sm = res["params"], res.get("summary", {})
    T, S = p["main_timeout_s"], p["short_timeout_s"]
    peers = res["peers"]
    n_ok = res.get("repeats_done", 0)
    off = {k: "" if v.get("status") == "ok" else " (skipped, see below)" for k, v in peers.items()}
    lines = [
        MARK,
        "## Against other recovery systems: torchft 0.2.0 and nvidia-resiliency-ext 0.4.1",
        "",
        f"Written by `scripts/bench_peers.py` on {res['date']} (raw data: `{res.get('json')}`).",
        "",
        (f"**Machine.** {h.machine_line(res['machine'])}"
         + (f"; load average at the end {', '.join(f'{x:.1f}' for x in res['machine']['loadavg_end'])}"
            if res["machine"].get("loadavg_end") else "")
         + ". Shared and noisy: only ratios within one repeat mean anything; absolute times are for reference."),
        "",
        (f"**What ran.** {n_ok} repeat(s) (run order rotated between repeats; whole benchmark "
         f"{res.get('total_wall_s', 0) / 60:.1f} min). Every system trains the same model — the decoder "
         f"example's `CausalDecoder` at the sizes of `examples/decoder/job.yaml`'s `params` ({p['layers']} layers, width {p['width']}, vocab "
         f"{p['vocab']}, seq_len {p['seq_len']}: {p['param_count'] / 1e3:.0f}k parameters), AdamW, the same LR "
         f"schedule and token stream, {p['batch_per_rank']} sequences per process, 1 thread per process — for "
         f"{STEPS} updates with one fault right after update {FAULT_STEP} (the paper's experiment). "
         "*Fault → resume* is the time from the fault to the commit of update 16. Ours runs with its per-node "
         "checkpoint daemons, as `accelpact-run` does: they write and verify the update-10 snapshot "
         "(checksums + coverage) on the same 2 cores, which can overlap the fault and update 16, most "
         "with the short timeout."
         + (f" Stopped early: {res['stopped_early']}." if res.get("stopped_early") else "")),
        "",
        "| system | topology | fault | detection | recovery |",
        "|---|---|---|---|---|",
        (f"| ours (`accelpact-run`, the job's real path) | 2 emulated nodes x 2 ranks (4 processes), FSDP1 "
         "`HYBRID_SHARD` on the 2-D mesh; replication groups {0,2} and {1,3} | "
         f"`{FAULT}`: rank 1 withholds its part of the boundary all-reduce (stays alive) | its peer's Gloo "
         f"timeout `timeouts.collective_s` = {T:g} s (and {S:g} s) | vote → L1 repair in process, zero replay; "
         f"snapshot at update {p['checkpoint_every']} as the job file says |"),
        (f"| torchft 0.2.0{off.get('torchft', '')} | lighthouse + 2 replica groups x 1 process, `Manager(min_replica_size=1)`, "
         "`ProcessGroupGloo`, `manager.allreduce` of the flattened gradients | group 1 is SIGKILLed right after "
         f"committing update {FAULT_STEP} | lighthouse heartbeat timeout {T:g} s (= our collective_s; torchft's "
         f"default) and {S:g} s; heartbeats every 100 ms | survivor continues alone; group 1 restarted once the "
         "survivor has committed update 16, joins and heals from its live state |"),
        (f"| nvidia-resiliency-ext 0.4.1{off.get('nvrx', '')} | 2 ranks, plain data parallel (Gloo all-reduce of the "
         "flattened gradients) "
         "| rank 1 raises `RuntimeError` right after committing update 15 | raised on the faulting rank; the peer "
         f"learns through the Wrapper's store (monitor intervals 1 s, `last_call_wait` 1 s; Gloo timeout {T:g} s) "
         "| `inprocess.Wrapper` (`health_check=None`) restarts the training function on both ranks; state kept "
         "in memory, zero replay |"),
        "",
    ]
    skipped = [(k, v) for k, v in peers.items() if v.get("status") != "ok"]
    for k, v in skipped:
        lines += [f"**Skipped: {PEERS[k]['title']}** — {v.get('reason', 'not available')}", ""]
    lines += [
        "| what | baseline | ratio (median) | spread (min–max) | n | absolute, s (reference: what vs baseline) |",
        "|---|---|---|---|---|---|",
    ]
    for r in res.get("rows", []):
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        note = f" — *{r['note']}*" if r.get("note") else ""
        lines.append(f"| {r['what']}{note} | {r['baseline']} | {ratio} | {r['spread'] or 'n/a'} | {r['n']} | "
                     f"{r.get('abs', '')} |")
    lines += [
        "",
        ("Goodput = (25 x the run's median uninterrupted update) / (wall time from the start of update 1 to the "
         "commit of update 25); each system against its own update time, so the three are not the same work. "
         "torchft's lighthouse counts its timeout from the dead group's last heartbeat (every 100 ms), so its "
         "\"− timeout\" figures below can be slightly negative."),
        "",
        "**Absolute medians (min–max), seconds, for reference.**",
        "",
        "| run | fault → update 16 | − timeout | − timeout − one update | uninterrupted update | other |",
        "|---|---|---|---|---|---|",
        (f"| ours, collective_s {T:g} s | {_abs(sm, 'ours_T', 'fault_to_resume_s')} | "
         f"{_abs(sm, 'ours_T', 'beyond_timeout_s', '{:.3f}')} | {_abs(sm, 'ours_T', 'recovery_work_s', '{:.3f}')} | "
         f"{_abs(sm, 'ours_T', 'step_s', '{:.3f}')} | "
         f"detection (rank 1 → rank 3 fault event) {_abs(sm, 'ours_T', 'detect_s')}; repair "
         f"{_abs(sm, 'ours_T', 'repair_total_s', '{:.3f}')}; update 16 itself "
         f"{_abs(sm, 'ours_T', 'resume_step_s', '{:.3f}')} |"),
        (f"| ours, collective_s {S:g} s | {_abs(sm, 'ours_S', 'fault_to_resume_s')} | "
         f"{_abs(sm, 'ours_S', 'beyond_timeout_s', '{:.3f}')} | {_abs(sm, 'ours_S', 'recovery_work_s', '{:.3f}')} | "
         f"{_abs(sm, 'ours_S', 'step_s', '{:.3f}')} | "
         f"repair {_abs(sm, 'ours_S', 'repair_total_s', '{:.3f}')}; update 16 itself "
         f"{_abs(sm, 'ours_S', 'resume_step_s', '{:.3f}')} |"),
    ]
    if peers.get("torchft", {}).get("status") == "ok":
        lines += [
            (f"| torchft, heartbeat {T:g} s | {_abs(sm, 'torchft_T', 'fault_to_resume_s')} | "
             f"{_abs(sm, 'torchft_T', 'beyond_timeout_s', '{:.3f}')} | {_abs(sm, 'torchft_T', 'recovery_work_s', '{:.3f}')} | "
             f"{_abs(sm, 'torchft_T', 'step_s', '{:.3f}')} | "
             f"rejoin {_abs(sm, 'torchft_T', 'rejoin_s')} (imports {_abs(sm, 'torchft_T', 'rejoin_import_s')}, "
             f"heal update {_abs(sm, 'torchft_T', 'rejoin_heal_step_s', '{:.3f}')}; the survivor meanwhile "
             f"committed {_abs(sm, 'torchft_T', 'survivor_updates_before_rejoin', '{:.0f}')} updates alone) |"),
            (f"| torchft, heartbeat {S:g} s | {_abs(sm, 'torchft_S', 'fault_to_resume_s')} | "
             f"{_abs(sm, 'torchft_S', 'beyond_timeout_s', '{:.3f}')} | {_abs(sm, 'torchft_S', 'recovery_work_s', '{:.3f}')} | "
             f"{_abs(sm, 'torchft_S', 'step_s', '{:.3f}')} | "
             f"rejoin {_abs(sm, 'torchft_S', 'rejoin_s')} |"),
        ]
    if peers.get("nvrx", {}).get("status") == "ok":
        lines.append(f"| nvidia-resiliency-ext | {_abs(sm, 'nvrx', 'fault_to_resume_s')} | — | — | "
                     f"{_abs(sm, 'nvrx', 'step_s', '{:.3f}')} | both ranks back in the function "
                     f"{_abs(sm, 'nvrx', 'restart_entered_s')}, Gloo ready {_abs(sm, 'nvrx', 'pg_ready_s')} |")
    failed = [(i, k, v.get("error")) for i, rep in enumerate(res.get("runs", []))
              for k, v in rep.items() if isinstance(v, dict) and v.get("ok") is False]
    if failed:
        lines += ["", "Runs that failed (left out of the figures): " + "; ".join(
            f"repeat {i + 1} {k}: {(e or '')[:200]}" for i, k, e in failed)]
    lines += ["", "**Reading.**", ""] + reading(res) + [MARK]
    return "\n".join(lines)


def reading(res: dict[str, Any]) -> list[str]:
    """Plain statements from the figures, including where a peer is ahead."""
    rows = {r["key"]: r for r in res.get("rows", [])}
    p = res["params"]
    T, S = p["main_timeout_s"], p["short_timeout_s"]
    out = []

    def ratio(key: str) -> float | None:
        return rows.get(key, {}).get("ratio")

    for key, t in (("f2r_torchft_T", T), ("f2r_torchft_S", S)):
        x = ratio(key)
        if x is not None:
            who = "torchft's survivor resumes sooner" if x < 1 else "ours resumes sooner"
            out.append(f"- Detection timeout {t:g} s on both sides: torchft/ours = {x:.2f} — {who}. Both are "
                       "dominated by the detection timeout; the rest is each system's recovery work.")
    x = ratio("work_torchft_T")
    if x is not None:
        out.append(f"- Past the timeout (recovery work plus update 16 itself), torchft takes {x:.2f}x ours ("
                   + ("torchft is ahead here" if x < 1 else "ours is ahead here") + "; tenths of a second at most "
                   "on either side, against seconds of detection; ours' update alone is several times torchft's "
                   "here, see the absolute table).")
    x, y = ratio("f2r_nvrx"), ratio("f2r_nvrx_after_detect")
    if x is not None:
        out.append(f"- nvidia-resiliency-ext resumes at {x:.2f}x our fault → resume "
                   + ("(ahead of ours: its fault announces itself, ours waits for the collective timeout)"
                      if x < 1 else "(behind ours)")
                   + (f"; counted from when the fault is known, it takes {y:.2f}x ours" if y is not None else "")
                   + ".")
    parts, unresolved = [], []
    for key, label in (("ovh_ours", "ours"), ("ovh_torchft", "torchft"), ("ovh_nvrx", "nvidia-resiliency-ext")):
        st = res.get("summary", {}).get(key) or {}
        if st.get("median") is not None:
            parts.append(f"{label} {st['median']:.2f}x ({st['min']:.2f}–{st['max']:.2f})")
            if st["min"] <= 1:  # a layer cannot make updates faster: a ratio at or below 1 is noise
                unresolved.append(label)
    if parts:
        out.append("- Per-update cost of the fault-tolerance layer, each against itself without it: "
                   + ", ".join(parts) + ". The topologies differ (ours 4 processes with FSDP on 2 cores, the peers "
                   "2), so the ratios, not the update times, are comparable."
                   + (f" For {', '.join(unresolved)} some paired ratios are at or below 1: the cost is below what "
                      "this machine's noise lets one resolve in this run." if unresolved else "")
                   + (" nvidia-resiliency-ext's figure compares two launches (the Wrapper cannot be switched off "
                      "inside one), so a change in the machine's load between them shows up in it; ours and "
                      "torchft's are interleaved in the same processes." if "ovh_nvrx" in rows else ""))
    if ratio("rejoin_torchft") is not None:
        out.append(f"- torchft brings a killed replica group back (restart → heal → training) at "
                   f"{ratio('rejoin_torchft'):.2f}x a cold start; our L1 does not replace a lost process (that is L2: "
                   "requeue and restart from the newest verified snapshot), it repairs the communicator of live "
                   "ranks.")
    return out or ["- No figures (every run failed or was skipped)."]
