"""Peers benchmark, the analysis and the report: paired ratios, overview rows, the markdown block and its
reading, from the result JSON alone (``benchmarks/parts/peers.py``).
"""

from __future__ import annotations

import copy
from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.peers_classes import section as fault_class_section
from benchmarks.parts.peers_runs import FAULT, FAULT_STEP, PEERS, STEPS

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


def has(res: dict[str, Any], peer: str, feature: str) -> bool:
    """Whether ``peer`` was installed with the entry point ``feature`` (results before the features were
    recorded: torchft's manager and nvidia-resiliency-ext's in-process Wrapper, as then)."""
    info = res["peers"].get(peer, {})
    if info.get("status") != "ok":
        return False
    feats = info.get("features")
    if feats is None:
        return feature in ("manager", "inprocess")
    return bool(feats.get(feature, {}).get("ok"))


def title(res: dict[str, Any], peer: str) -> str:
    """The peer and the release that ran (``torchft nightly 2026.10.26``)."""
    info = res["peers"].get(peer, {})
    if info.get("title") and info.get("status") == "ok":
        return info["title"]
    pin = info.get("pin") or ""
    return pin.replace("==", " ") if "==" in pin else PEERS[peer]["name"]


def analyse(res: dict[str, Any]) -> None:
    runs, p = res["runs"], res["params"]
    T, S = p["main_timeout_s"], p["short_timeout_s"]
    sm: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    F = h.fmt

    def add(key: str, what: str, baseline: str, st: dict[str, Any], abs_text: str, note: str = "",
            added: dict[str, Any] | None = None, added_unit: str = "") -> None:
        sm[key] = st
        row = h.row(what, baseline, st, note=note)
        row["abs"] = abs_text
        row["key"] = key
        if added is not None:  # a fixed cost divided by different update lengths: the ratio alone misleads
            sm[f"{key}_added"] = added
            row["added"], row["added_unit"] = added, added_unit
        rows.append(row)

    for run in ("ours_T", "ours_S", "torchft_T", "torchft_S", "nvrx", "nvrx_injob"):
        for k in ("fault_to_resume_s", "step_s", "goodput", "beyond_timeout_s", "recovery_work_s", "after_detect_s",
                  "repair_total_s", "window_step_s",
                  "detect_s", "restart_entered_s", "pg_ready_s", "rejoin_s", "initial_start_s", "rejoin_import_s",
                  "rejoin_heal_step_s", "resume_step_s", "survivor_updates_before_rejoin", "relaunch_s",
                  "restart_imported_s", "restart_monitor_s", "restart_pg_ready_s", "load_s", "replayed_updates",
                  "replay_s", "first_commit_after_fault_s", "save_s", "run_25_s"):
            v = _vals(runs, run, k)
            if v:
                sm.setdefault("abs", {}).setdefault(run, {})[k] = h.spread(v)

    ft_ok = has(res, "torchft", "manager")
    nv_ok = has(res, "nvrx", "inprocess")
    nj_ok = has(res, "nvrx", "injob")
    ft, nv = title(res, "torchft"), title(res, "nvrx")
    for run, t in (("T", T), ("S", S)):
        if not ft_ok:
            break
        st = h.ratio_stats(_pairs(runs, f"torchft_{run}", f"ours_{run}", "fault_to_resume_s"))
        dflt = " (torchft's default)" if t == 5 else ""
        add(f"f2r_torchft_{run}", f"{ft} survivor: fault → update 16 committed; heartbeat timeout {t:g} s{dflt}",
            f"ours L1 (`accelpact-run`, {FAULT}), collective_s {t:g} s, same repeat", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s",
            "torchft: peer process killed; ours: peer withholds its part of the boundary all-reduce")
    if ft_ok:
        st = h.ratio_stats(_pairs(runs, "torchft_T", "ours_T", "beyond_timeout_s"))
        add("work_torchft_T", f"{ft}: fault → update 16 minus the heartbeat timeout ({T:g} s)",
            f"ours: fault → update 16 minus collective_s ({T:g} s), same repeat", st,
            f"{F(st['abs_test'], '{:.3f}')} s vs {F(st['abs_base'], '{:.3f}')} s",
            "what follows detection: quorum + PG reconfigure + update 16 (2 processes) vs vote + six-phase repair "
            "+ update 16 (4 processes on 2 cores)")
    if nv_ok:
        st = h.ratio_stats(_pairs(runs, "nvrx", "ours_T", "fault_to_resume_s"))
        add("f2r_nvrx", f"{nv} in-process Wrapper: injected exception → update 16 committed (default intervals)",
            f"ours L1: fault → update 16, collective_s {T:g} s, same repeat", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s",
            "nvidia-resiliency-ext's fault raises on the faulting rank (no timeout to wait); ours must detect a "
            "silent one")
        st = h.ratio_stats(_pairs(runs, "nvrx", "ours_T", "fault_to_resume_s", "after_detect_s"))
        add("f2r_nvrx_after_detect", f"{nv} in-process Wrapper: injected exception → update 16 committed",
            "ours L1: detection (last rank's fault event) → update 16, same repeat", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'], '{:.3f}')} s",
            "both from the moment the fault is known to the recovery machinery")
    if nj_ok:
        every = p.get("checkpoint_every")
        st = h.ratio_stats(_pairs(runs, "nvrx_injob", "ours_T", "fault_to_resume_s"))
        add("f2r_nvrx_injob", f"{nv} in-job restart (`ft_launcher`): rank killed → update 16 committed",
            f"ours L1: fault → update 16, collective_s {T:g} s, same repeat", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s",
            f"the launcher sees the dead process, stops the other and starts both again; they resume from the "
            f"update-{every} checkpoint and replay to 15 (ours: no process lost, zero replay)")
        st = h.ratio_stats(_pairs(runs, "nvrx_injob", "nvrx_injob", "first_commit_after_fault_s", "initial_start_s"))
        add("restart_nvrx_injob", f"{nv} in-job restart: rank killed → first update committed by the restarted "
            "ranks", "the same job's cold start: launcher started → update 1 committed, same run", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s",
            "both start new worker processes (imports, rank monitors, Gloo); the cold start also starts the "
            "launcher")

    # Per-update overhead: each system against itself without its fault-tolerance layer, as a ratio and as the
    # milliseconds it adds to an update (paired segment by segment): the layers add a roughly fixed cost, and
    # the updates they are divided by differ several-fold between the systems.
    ov = [r for rep in runs for r in [rep.get("ours_overhead")] if r and r.get("ok")]
    st = h.spread([x for r in ov for x in r["ratios"]])
    st["abs_test"] = h.med([x for r in ov for x in r["test_step_s"]])
    st["abs_base"] = h.med([x for r in ov for x in r["base_step_s"]])
    add("ovh_ours", f"ours: guarded update (boundary all-reduce + vote), 4 ranks HSDP, collective_s {T:g} s",
        "the same update without the guard, interleaved segments, same processes", st,
        f"{F(st['abs_test'], '{:.4f}')} s vs {F(st['abs_base'], '{:.4f}')} s",
        added=_added_ms(ov), added_unit="ms per update")
    if ft_ok:
        # like for like: torchft on the same four ranks and model (FSDP2 per replica group, its managed all-reduce
        # across), against the same FSDP2 updates with a plain Gloo all-reduce; a stored result from before that
        # run has the two-process form's segments instead (one process per replica group, no FSDP)
        ov = [rep["torchft_hsdp_overhead"] for rep in runs if rep.get("torchft_hsdp_overhead", {}).get("ok")]
        form = "4 ranks HSDP (FSDP2 per replica group of 2)"
        base = "the same FSDP2 updates, replicate all-reduce on a plain Gloo group; ABBA segments, same processes"
        if not ov:
            ov = [rep["torchft_T"]["overhead"] for rep in runs
                  if rep.get("torchft_T", {}).get("ok") and rep["torchft_T"].get("overhead", {}).get("ok")]
            form, base = "2 replica groups", "plain Gloo all-reduce update, interleaved segments, same processes"
        st = h.spread([x for r in ov for x in r["ratios"]])
        st["abs_test"] = h.med([x for r in ov for x in r["test_step_s"]])
        st["abs_base"] = h.med([x for r in ov for x in r["base_step_s"]])
        add("ovh_torchft", f"{ft}: managed update (quorum + allreduce + should_commit), {form}, "
            f"heartbeat timeout {T:g} s", base, st,
            f"{F(st['abs_test'], '{:.4f}')} s vs {F(st['abs_base'], '{:.4f}')} s",
            added=_added_ms(ov), added_unit="ms per update")
    if nv_ok:
        pairs = _pairs(runs, "nvrx", "nvrx_plain", "window_step_s")
        st = h.ratio_stats(pairs)
        add("ovh_nvrx", f"{nv}: update inside the in-process Wrapper, 2 ranks",
            f"the same loop without the Wrapper (separate launch, same repeat); {p.get('window_steps')} updates "
            "between two barriers each", st,
            f"{F(st['abs_test'], '{:.4f}')} s vs {F(st['abs_base'], '{:.4f}')} s",
            added=h.spread([(a - b) * 1e3 for a, b in pairs]), added_unit="ms per update")
    if ft_ok:
        pairs = _pairs(runs, "torchft_T", "torchft_T", "rejoin_s", "initial_start_s")
        st = h.ratio_stats(pairs)
        add("rejoin_torchft", f"{ft}: restarted group, start → first commit (quorum join + live heal), "
            f"heartbeat timeout {T:g} s", "the same group's first start (both groups starting) → first commit, "
            "same run", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s",
            "no equivalent in our L1: the faulting rank keeps its process and state")
    for key, run, label, ok in (("goodput_ours", "ours_T", "ours", True),
                                ("goodput_torchft", "torchft_T", f"{ft} survivor", ft_ok),
                                ("goodput_nvrx", "nvrx", f"{nv} in-process Wrapper", nv_ok),
                                ("goodput_nvrx_injob", "nvrx_injob", f"{nv} in-job restart", nj_ok)):
        if not ok:
            continue
        v = _vals(runs, run, "goodput")
        st = h.spread(v)
        st["abs_test"] = h.med(_vals(runs, run, "run_25_s"))
        st["abs_base"] = h.med([STEPS * x for x in _vals(runs, run, "step_s")])
        lost = h.spread(rep[run]["run_25_s"] - STEPS * rep[run]["step_s"] for rep in runs
                        if rep.get(run, {}).get("ok") and rep[run].get("run_25_s") is not None
                        and rep[run].get("step_s") is not None)
        add(key, f"goodput, {label}: 25 updates with the fault after 15 (timeout {T:g} s)",
            "25 x the run's own median uninterrupted update", st,
            f"{F(st['abs_test'])} s vs {F(st['abs_base'])} s", added=lost, added_unit="s lost per run")
    res["summary"], res["rows"] = sm, rows


def _added_ms(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """Milliseconds the layer adds to an update: test minus base, segment pair by segment pair."""
    return h.spread((a - b) * 1e3 for r in segments for a, b in zip(r["test_step_s"], r["base_step_s"]))


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The overview rows, computed again from the stored runs (a copy: ``res`` is left as it is), so a result
    stored before a row gained a column shows it too."""
    again = copy.deepcopy(res)
    analyse(again)
    return again["rows"]


def _added(r: dict[str, Any]) -> str:
    a = r.get("added")
    if not a or a.get("median") is None:
        return "—"
    return f"{h.fmt_spread(a, '{:+.2f}')} {r.get('added_unit', '')}".strip()


# ====================================================================== markdown


def _abs(sm: dict[str, Any], run: str, key: str, f: str = "{:.2f}") -> str:
    return h.fmt_spread(sm.get("abs", {}).get(run, {}).get(key), f)


def _versions(res: dict[str, Any]) -> list[str]:
    """What each peer got: the release in use, its venv and torch, and every newer candidate that failed."""
    out = []
    for k, v in res["peers"].items():
        name = PEERS[k]["name"]
        tried = [a for a in v.get("attempts", []) if a.get("status") != "ok"]
        why = "; ".join(f"`{a['pin']}`: {a['status']} — {a['reason']}" for a in tried)
        if v.get("status") == "ok":
            feats = v.get("features") or {}
            off = [f"{f} not available ({x.get('reason')})" for f, x in feats.items() if not x.get("ok")]
            line = (f"- **{name}**: `{v.get('pin')}`" + (f" — {v['about']} —" if v.get("about") else "")
                    + f" in its own venv `{v.get('venv')}` (torch {v.get('torch', 'n/a')}, {v.get('python', 'cp311')})"
                    + (f"; {'; '.join(off)}" if off else ""))
            if tried:
                line += f". Newer candidates, newest first, that do not work here: {why}"
        else:
            line = f"- **{name}**: skipped — {v.get('reason', 'not available')}"
        out.append(line + ("" if line.endswith(".") else "."))
    return out


def _commit_line(res: dict[str, Any]) -> str:
    c = res.get("commit") or {}
    if not c.get("sha"):
        return "Commit: not recorded."
    dirty = c.get("dirty") or []
    more = "" if not dirty else (f" plus uncommitted changes in {len(dirty)} file(s) of the measured code ("
                                 + ", ".join(f"`{d}`" for d in dirty[:6]) + (", …" if len(dirty) > 6 else "") + ")")
    return f"Measured at commit `{c['short']}`{more}."


def markdown(res: dict[str, Any], related: dict[str, Any] | None = None) -> str:
    """The part's block from its result alone; ``related`` may hold the recovery part's result
    (``{"recovery": res}``, as ``benchmarks/harness/run.py`` passes it) for the fault-class table."""
    res = copy.deepcopy(res)
    analyse(res)  # the rows and the added costs, from the stored runs
    p, sm = res["params"], res.get("summary", {})
    T, S = p["main_timeout_s"], p["short_timeout_s"]
    peers = res["peers"]
    n_ok = res.get("repeats_done", 0)
    ft, nv = title(res, "torchft"), title(res, "nvrx")
    off = {k: "" if v.get("status") == "ok" else " (skipped, see above)" for k, v in peers.items()}
    every = p.get("checkpoint_every")
    lines = [
        MARK,
        f"## Against other recovery systems: {ft} and {nv}",
        "",
        f"Written by `benchmarks/parts/peers.py` on {res['date']} (raw data: `{res.get('json')}`). {_commit_line(res)}",
        "",
        (f"**Machine.** {h.machine_line(res['machine'])}"
         + (f"; load average at the end {', '.join(f'{x:.1f}' for x in res['machine']['loadavg_end'])}"
            if res["machine"].get("loadavg_end") else "")
         + ". Shared and noisy: only ratios within one repeat mean anything; absolute times are for reference."),
        "",
        ("**Versions.** Each peer runs in a virtual environment of its own under `benchmarks/.venvs/`, made by the "
         "benchmark: `torch==2.13.0` (this machine's CPU build) and PyYAML first, then "
         + ("the newest candidate release that installs and imports here, held to that torch by a constraints file. "
            "A candidate without a wheel for this interpreter and C library, or that fails to install or import, "
            "is recorded and the next older one is tried."
            if any("attempts" in v for v in peers.values()) else "the pinned release.")),
        "",
        *_versions(res),
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
         f"snapshot at update {every} as the job file says |"),
        (f"| {ft}{off.get('torchft', '')} | lighthouse + 2 replica groups x 1 process, `Manager(min_replica_size=1)`, "
         "`ProcessGroupGloo`, `manager.allreduce` of the flattened gradients | group 1 is SIGKILLed right after "
         f"committing update {FAULT_STEP} | lighthouse heartbeat timeout {T:g} s (= our collective_s; torchft's "
         f"default) and {S:g} s; heartbeats every 100 ms | survivor continues alone; group 1 restarted once the "
         "survivor has committed update 16, joins and heals from its live state |"),
        (f"| {nv} in-process restart{off.get('nvrx', '')} | 2 ranks, plain data parallel (Gloo all-reduce of the "
         "flattened gradients) "
         f"| rank 1 raises `RuntimeError` right after committing update {FAULT_STEP} | raised on the faulting rank; "
         f"the peer learns through the Wrapper's store (monitor intervals 1 s, `last_call_wait` 1 s; Gloo timeout "
         f"{T:g} s) | `inprocess.Wrapper` (`health_check=None`) restarts the training function on both ranks; "
         "state kept in memory, zero replay |"),
        *([] if not has(res, "nvrx", "injob") and peers.get("nvrx", {}).get("status") == "ok" else [
        (f"| {nv} in-job restart{off.get('nvrx', '')} | `ft_launcher` (its torchrun-like agent, c10d rendezvous, "
         "`--max-restarts 1`, default any-failed restart policy) with 2 ranks on 1 node, a rank monitor per rank, "
         "a heartbeat after every update; plain data parallel as above | rank 1's process SIGKILLs itself right "
         f"after committing update {FAULT_STEP} | the launcher's process monitor (every 0.1 s); heartbeat "
         f"timeout {T:g} s for hangs (not the path here) | the launcher stops the surviving rank and starts both "
         f"again in the same job; each loads the checkpoint it wrote at update {every} (the job file's cadence) "
         f"and replays updates {every + 1}–{FAULT_STEP} |")]),
        "",
    ]
    lines += [
        *fault_class_section(res, (related or {}).get("recovery")),
        "| what | baseline | ratio (median) | spread (min–max) | added, median (min–max) | n "
        "| absolute, s (reference: what vs baseline) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res.get("rows", []):
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        note = f" — *{r['note']}*" if r.get("note") else ""
        lines.append(f"| {r['what']}{note} | {r['baseline']} | {ratio} | {r['spread'] or 'n/a'} | {_added(r)} "
                     f"| {r['n']} | {r.get('abs', '')} |")
    lines += [
        "",
        ("Goodput = (25 x the run's median uninterrupted update) / (wall time from the start of update 1 to the "
         "commit of update 25); each system against its own update time, so they are not the same work; *added* "
         "beside it is the run's wall time minus those 25 updates, the seconds the fault cost the run. The "
         "per-update costs' *added* is the guarded (managed, wrapped) update minus the plain one, paired segment "
         "by segment, in milliseconds: the layers add a roughly fixed cost, so the ratio also depends on how long "
         "the system's own update is. "
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
    if has(res, "torchft", "manager"):
        lines += [
            (f"| {ft}, heartbeat {T:g} s | {_abs(sm, 'torchft_T', 'fault_to_resume_s')} | "
             f"{_abs(sm, 'torchft_T', 'beyond_timeout_s', '{:.3f}')} | {_abs(sm, 'torchft_T', 'recovery_work_s', '{:.3f}')} | "
             f"{_abs(sm, 'torchft_T', 'step_s', '{:.3f}')} | "
             f"rejoin {_abs(sm, 'torchft_T', 'rejoin_s')} (imports {_abs(sm, 'torchft_T', 'rejoin_import_s')}, "
             f"heal update {_abs(sm, 'torchft_T', 'rejoin_heal_step_s', '{:.3f}')}; the survivor meanwhile "
             f"committed {_abs(sm, 'torchft_T', 'survivor_updates_before_rejoin', '{:.0f}')} updates alone) |"),
            (f"| {ft}, heartbeat {S:g} s | {_abs(sm, 'torchft_S', 'fault_to_resume_s')} | "
             f"{_abs(sm, 'torchft_S', 'beyond_timeout_s', '{:.3f}')} | {_abs(sm, 'torchft_S', 'recovery_work_s', '{:.3f}')} | "
             f"{_abs(sm, 'torchft_S', 'step_s', '{:.3f}')} | "
             f"rejoin {_abs(sm, 'torchft_S', 'rejoin_s')} |"),
        ]
    if has(res, "nvrx", "inprocess"):
        lines.append(f"| {nv} in-process Wrapper | {_abs(sm, 'nvrx', 'fault_to_resume_s')} | — | — | "
                     f"{_abs(sm, 'nvrx', 'step_s', '{:.3f}')} | both ranks back in the function "
                     f"{_abs(sm, 'nvrx', 'restart_entered_s')}, Gloo ready {_abs(sm, 'nvrx', 'pg_ready_s')} |")
    if has(res, "nvrx", "injob"):
        lines.append(f"| {nv} in-job restart | {_abs(sm, 'nvrx_injob', 'fault_to_resume_s')} | — | — | "
                     f"{_abs(sm, 'nvrx_injob', 'step_s', '{:.3f}')} | after the fault: both new processes "
                     f"started {_abs(sm, 'nvrx_injob', 'relaunch_s')}, torch and the peer imported "
                     f"{_abs(sm, 'nvrx_injob', 'restart_imported_s')}, rank monitors connected "
                     f"{_abs(sm, 'nvrx_injob', 'restart_monitor_s')}, checkpoint loaded and Gloo ready "
                     f"{_abs(sm, 'nvrx_injob', 'restart_pg_ready_s')}; replay of "
                     f"{_abs(sm, 'nvrx_injob', 'replayed_updates', '{:.0f}')} updates "
                     f"{_abs(sm, 'nvrx_injob', 'replay_s', '{:.3f}')}; checkpoint write "
                     f"{_abs(sm, 'nvrx_injob', 'save_s', '{:.3f}')}, load {_abs(sm, 'nvrx_injob', 'load_s', '{:.3f}')} |")
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
    ft, nv = title(res, "torchft"), title(res, "nvrx")
    out = []

    def ratio(key: str) -> float | None:
        return rows.get(key, {}).get("ratio")

    for key, t in (("f2r_torchft_T", T), ("f2r_torchft_S", S)):
        x = ratio(key)
        if x is not None:
            who = "torchft's survivor resumes sooner" if x < 1 else "ours resumes sooner"
            out.append(f"- Detection timeout {t:g} s on both sides: {ft}/ours = {x:.2f} — {who}. Both are "
                       "dominated by the detection timeout; the rest is each system's recovery work.")
    x = ratio("work_torchft_T")
    if x is not None:
        out.append(f"- Past the timeout (recovery work plus update 16 itself), torchft takes {x:.2f}x ours ("
                   + ("torchft is ahead here" if x < 1 else "ours is ahead here") + "; tenths of a second at most "
                   "on either side, against seconds of detection; ours' update alone is several times torchft's "
                   "here, see the absolute table).")
    x, y = ratio("f2r_nvrx"), ratio("f2r_nvrx_after_detect")
    if x is not None:
        out.append(f"- {nv}'s in-process Wrapper resumes at {x:.2f}x our fault → resume "
                   + ("(ahead of ours: its fault announces itself, ours waits for the collective timeout)"
                      if x < 1 else "(behind ours)")
                   + (f"; counted from when the fault is known, it takes {y:.2f}x ours" if y is not None else "")
                   + ".")
    x, y = ratio("f2r_nvrx_injob"), ratio("restart_nvrx_injob")
    if x is not None:
        out.append(f"- {nv}'s in-job restart (`ft_launcher`) resumes at {x:.2f}x our fault → resume "
                   + ("(ahead of ours: a dead process is seen by its launcher at once, ours waits for the "
                      "collective timeout of a rank that stays alive)" if x < 1 else
                      "(behind ours: new processes, imports, a checkpoint load and the replay cost more than our "
                      "collective timeout)")
                   + (f"; its restarted ranks commit their first update {y:.2f}x as long after the fault as the "
                      "job took to commit update 1 from a cold start" if y is not None else "")
                   + ". It replaces a process that is gone (the Wrapper restarts the training function inside "
                   "live processes), at the price of new processes and of replaying from the last checkpoint.")
    parts, unresolved = [], []
    for key, label in (("ovh_ours", "ours"), ("ovh_torchft", "torchft"), ("ovh_nvrx", "nvidia-resiliency-ext")):
        st = res.get("summary", {}).get(key) or {}
        ad = res.get("summary", {}).get(f"{key}_added") or {}
        if st.get("median") is not None:
            parts.append(f"{label} {st['median']:.2f}x ({st['min']:.2f}–{st['max']:.2f})"
                         + (f", {h.fmt_spread(ad, '{:+.2f}')} ms per update" if ad.get("median") is not None
                            else ""))
            if st["min"] <= 1:  # a layer cannot make updates faster: a ratio at or below 1 is noise
                unresolved.append(label)
    if parts:
        out.append("- Per-update cost of the fault-tolerance layer, each against itself without it: "
                   + ", ".join(parts) + ". The topologies differ (ours 4 processes with FSDP on 2 cores, the peers "
                   "2) and so do the updates (ours several times the peers'): the added milliseconds, not the "
                   "ratios, compare the layers' own cost."
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
