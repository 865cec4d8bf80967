"""L1 backward benchmark, the markdown block of a result (``benchmarks/parts/l1backward.py``, ``bench_all.py``)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.l1backward_analysis import CASE_RUN, PHASE_TITLES, PHASES, case_label, case_title

MARK = "<!-- l1backward-bench -->"
PART = "l1backward"
TITLE = "L1 backward: replication-link faults at random moments of the update"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.1f}"


def _s(d: dict[str, Any] | None) -> str:
    return h.fmt_spread(d, "{:.3f}")


def _plus(x: float | None, c: float) -> float | None:
    return None if x is None else x + c


def _what_ran(p: dict[str, Any]) -> str:
    f, u = p["faults"], p["fault_u"]
    xu = p["xnode_fault"][0]
    return (
        f"**What ran.** Our jobs: `accelpact-run JOB.yaml --inject-fault PHASE:STEP:RANK`, JOB.yaml being the decoder "
        f"example's (2 emulated nodes x 2 ranks, FSDP1 `HYBRID_SHARD` on the device mesh, {p['steps']} updates, a "
        f"snapshot every {p['checkpoint_every']}) with collective timeout {p['collective_s']:g} s, no relaunch "
        "(`recovery.max_restarts: 0`: a fault that goes to L2 ends the job) and a timed entry point "
        "(`benchmarks/parts/l1backward_entry.py`: the example's model, optimizer, schedule, data and update body; on every "
        "rank it times each phase and logs every data-plane collective that crosses nodes, with its start and end). "
        f"Replication-link faults: `{f['backward']}` (rank 1 withholds every replication all-reduce of update {u}'s "
        f"backward; its peers time out in theirs), `{f['boundary']}` (rank 1 withholds its part of the guard's boundary "
        f"all-reduce, which `boundary:{u - 1}` means: the boundary after update {u - 1}, taken in update {u}'s vote), "
        f"`{f['next']}` (the same as the first, one update later), and rank {p['xnode_fault'][1]} withholding its part "
        f"of the capture proof's cross-node collective after update {xu}'s commit (injected by the entry point: "
        "`--inject-fault` cannot reach it). Faults of another kind: "
        f"`{f['forward']}` (rank 1 skips its part of the whole forward: the shard group's all-gathers inside the node) "
        f"and rank {p['step_fault'][1]}'s optimizer step of update {p['step_fault'][0]} raising (entry point). A run is "
        "L1 when it has a `repair` event and no `fail_stop` or `restart_load`, L2 when it fails stop or its ranks "
        "crash (the launcher then exits 75, requeue).")


def _cases(res: dict[str, Any]) -> list[str]:
    p, s, v = res["params"], res["shares"], res["cases"]
    to = s["collective_s"]
    lines = [
        "### Where a replication-link fault is first seen, and what then happens",
        "",
        ("The link between the nodes fails at a uniformly random moment; nothing notices until the next collective "
         "that crosses nodes, whose timeout is the detection. Each moment is mapped to that collective from the "
         f"measured timings: {s['pooled_attempts']} clean update attempts x ranks (update 1, the faulted update, the "
         f"one after it and the last update left out; the time before each update, the next batch, included) of the "
         f"runs that ran all {p['steps']} updates; {p['draws']} moments drawn per run (`random.Random({p['seed']})`). "
         "Each case is reproduced by a real injection, and its outcome is that injection's real runs' outcome. "
         "Detection delay (strike → detection) is an *estimate* derived from the timings: the time until the "
         f"detecting collective starts (0 when the moment falls inside it) + the {to:g} s collective timeout; "
         "the measured columns come from the injected runs' `events.jsonl`."),
        "",
        "| the link fails … | injection | share of the moments (median, min–max over runs) | outcome (real runs) | "
        "est. wait for the collective, ms: median / p90 | est. detection delay s: median (mean) | measured: "
        "injection → last rank's detection s | measured: detection → update committed s |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    m = res.get("measured", {})
    for c in s["cases"]:
        cv, w = v[c], s["waits"].get(c, {})
        out = {"l1": "recovered in process (L1)", "l2": "L2", None: "not run: counted as not recovered"}[cv["verdict"]]
        inj = cv.get("injection") or {None: "none"}.get(cv.get("run_class"), f"run class `{cv.get('run_class')}`")
        inj = f"`{inj}`" if cv.get("run_class") in CASE_RUN.values() and cv.get("injection") else inj
        mm = m.get(cv.get("run_class") or "", {})
        meas = (_s(mm.get("detect_spread_s")), _s(mm.get("detect_to_commit_s"))) if mm.get("n") else ("n/a", "n/a")
        lines.append(f"| {case_title(c, s['updates_of'].get(c, ()))} | {inj} | {_s(s['case_share'].get(c))} | {out}: {cv['evidence']} | "
                     f"{_ms(w.get('median_s'))} / {_ms(w.get('p90_s'))} | "
                     f"{h.fmt(_plus(w.get('median_s'), to), '{:.3f}')} ({h.fmt(_plus(w.get('mean_s'), to), '{:.3f}')}) | "
                     f"{meas[0]} | {meas[1]} |")
    others = sorted({o for x in s["per_run"] for o in x.get("other_collectives", [])})
    per_rank = s["pooled_attempts"] / (s["runs_drawn"] * s["ranks"]) if s.get("runs_drawn") and s.get("ranks") else 0
    lines += [
        "",
        (f"Recovered in process now: {' + '.join(s['l1_cases']) or 'none'}, {_s(s['now'])} of the moments (goal "
         f"0.95). Before backward faults were repaired only the moments seen at the boundary all-reduce were: "
         f"{_s(s['boundary_only'])}. Per run (now / before): "
         + "; ".join(f"{x['run']} {x['now']:.3f} / {x['boundary']:.3f}" for x in s["per_run"]) + "."),
        "",
        ("Cross-node collectives other than the backward all-reduces and the boundary all-reduce, as logged (issued "
         "in, name, update): " + (", ".join(f"`{o}`" for o in others) or "none") + ". The snapshot's copy "
         "(`ckpt_service.capture.fsdp1_plan` and `Plan.copy_into`, FSDP1's flat shards) issues none; the first "
         "snapshot of each start also runs the capture proof (`ckpt_service.client`: "
         "`state_dict_plan` → `torch.distributed.checkpoint.state_dict.get_state_dict`), and under `HYBRID_SHARD` "
         "torch passes no group to `FSDP.optim_state_dict`, so its `all_gather_object` runs on the default group, "
         "across nodes; a link that fails after that update's boundary all-reduce and before that collective ends is "
         "seen there, outside the guard."
         + (f" It runs once per start, so its share is that of one snapshot update among the ~{per_rank:.0f} drawn "
            "updates of each rank here, and shrinks as a start runs more updates." if per_rank else "")),
        "",
        ("How the moments of each phase split between the cases, pooled over the runs (the case columns: share of "
         "all drawn moments; the time share weighs each attempt by its length, the draws each run alike):"),
        "",
        "| phase | mean ms per attempt | median ms | share of the time | "
        + " | ".join(case_label(c, s["updates_of"].get(c, ())) for c in s["cases"]) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(s["cases"]),
    ]
    tot = {c: sum(s["by_phase"].get(c, {}).values()) for c in s["cases"]}
    alln = sum(tot.values()) or 1
    for ph in PHASES:
        st = s["pooled"].get(ph, {})
        cells = [h.fmt(s["by_phase"].get(c, {}).get(ph, 0) / alln, "{:.3f}") for c in s["cases"]]
        lines.append(f"| {PHASE_TITLES[ph]} | {_ms(st.get('mean_s'))} | {_ms(st.get('median_s'))} | "
                     f"{h.fmt(st.get('share'), '{:.3f}')} | " + " | ".join(cells) + " |")
    after = s["pooled"].get("after", {})
    if after.get("median_s") is not None and after["mean_s"] > 5 * max(after["median_s"], 1e-4):
        lines += ["", (f"After the step: mean {_ms(after['mean_s'])} ms against a median of {_ms(after['median_s'])} "
                       f"ms: the snapshots (every {p['checkpoint_every']} updates) block there.")]
    lines += [
        "",
        ("Forward moments count as `backward` (and the optimizer step's as `next`): a failed inter-node link is not "
         "seen in the forward, whose collectives are the shard group's inside the node, nor in the step, which has "
         "none; it is seen in the next replication all-reduce, and the vote comes before any optimizer steps. "
         f"`{p['faults']['backward']}` withholds every replication all-reduce of the update from its first; a link "
         "that fails after some of them completed is seen at the next one, in the same backward, and the update is "
         "discarded and run again either way."),
    ]
    return lines


def _outside(res: dict[str, Any]) -> list[str]:
    o = res.get("outside", {})
    lines = ["", "### Faults that are not replication-link faults (a rank's forward fails: shard group; the optimizer "
                 "step raises): L2", ""]
    if not o.get("runs"):
        return lines + ["Not run this time (budget): see `skipped` in the raw data.", ""]
    lines.append("Not part of the drawn moments: the link between nodes is not involved. "
                 + "; ".join(f"{x['fault']}: {x['outcome'].upper()} (exit {x['exit']})" for x in o["runs"]) + ".")
    return lines + [""]


def _runs_table(res: dict[str, Any]) -> list[str]:
    lines = ["### Real injected runs", "", "| run | fault | outcome | repair / fail-stop | wall s |",
             "|---|---|---|---|---:|"]
    for r in res["runs"]:
        if not r.get("ok"):
            err = str(r.get("error", ""))[:200].replace("|", "/")
            wall = h.fmt(r.get("wall_s"), "{:.0f}")
            lines.append(f"| {r['name']} | {r.get('fault', '')} | failed: {err} | | {wall} |")
            continue
        if r["outcome"] == "l1":
            rep = r["repairs"][0] if r["repairs"] else {}
            how = (f"`repair` scope {rep.get('scope')}, frontier {rep.get('frontier')}, replayed "
                   f"{rep.get('replayed_updates')}, {h.fmt(rep.get('total_s'), '{:.3f}')} s")
        elif r.get("fail_stops"):
            why = (r.get("stop_reason") or "").split(": RuntimeError")[0]
            how = f"`fail_stop` on {r['fail_stops']} rank(s), exit {r.get('stop_exit')}: {why[:160]}"
        else:
            how = (r.get("stop_reason") or "")[:300]
        fault = f"`{r['fault']}`" if r.get("class") not in ("step", "xnode") else r["fault"]
        lines.append(f"| {r['name']} | {fault} | {r['outcome'].upper()} | {how.replace('|', '/')} | "
                     f"{r['wall_s']:.0f} |")
    return lines


def markdown(res: dict[str, Any]) -> str:
    p, d = res["params"], res["detection"]
    tft = res["torchft"]
    lines = [
        MARK,
        f"## {TITLE}",
        "",
        f"Written by `benchmarks/parts/l1backward.py` on {res['date']} (raw data: `{res['json']}`); "
        f"{res['total_wall_s']:.0f} s. **Machine.** {h.machine_line(res['machine'])}. Shared and noisy: only same-run "
        "ratios mean anything; absolute times are for reference.",
        "",
        _what_ran(p),
        "",
        "### Summary",
        "",
        "| what | baseline | ratio (median) | spread (min–max) | n | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['what']} | {r['baseline']} | {h.fmt(r['ratio'], '{:.3f}')} | {r['spread'] or 'n/a'} "
                     f"| {r['n']} | {r['note']} |")
    lines += [""] + _cases(res) + _outside(res) + _runs_table(res)
    if res.get("skipped"):
        lines += ["", f"Left out for the budget: {', '.join(res['skipped'])}."]
    lines += [
        "",
        f"### Detection → update {p['fault_u']} committed: ours against torchft's discard-and-heal",
        "",
        (f"Ours: `{p['faults']['backward']}`; detection = the last `fault` event of update {p['fault_u']} (every rank "
         "has seen the fault: its peers after the collective timeout), commit = the `step` event of the redone update "
         f"(`events.jsonl`). torchft ({tft.get('pin', 'torchft')}): a lighthouse and two replica groups of one process "
         "(`benchmarks/parts/peers_workers/torchft_withhold_worker.py`: the same model, optimizer, schedule and data; `Manager`, "
         f"`ProcessGroupGloo` with a {p['collective_s']:g} s timeout, `manager.allreduce` of the flattened gradients); "
         f"in update {p['fault_u']} group 1 reports its all-reduce failed to its manager and does not enter it, group "
         "0's all-reduce times out, `should_commit` is False on both, both discard the update, the next quorum "
         "reconfigures the process group and the update runs again. Detection = group 0's failed all-reduce "
         "returning; commit = the later of the two groups' commits of the update. Ours and torchft alternate (ABBA) "
         "within each round."),
        "",
    ]
    tft_ok = tft.get("status") == "ok" and d["ratio"]["n"] > 0
    if tft.get("status") != "ok":
        lines += [f"torchft not run: {tft.get('reason', 'unavailable')}.", ""]
    elif not tft_ok:
        errs = [x["torchft"].get("error") for x in res.get("rounds", []) if "torchft" in x]
        lines += [f"No torchft run completed: {(errs or ['none ran'])[0]}.", ""]
    lines += [
        "| | detection → commit s | fault → commit s (incl. the timeout) | repair s (engine) | median update s | "
        "detection → commit in updates |",
        "|---|---:|---:|---:|---:|---:|",
        f"| ours | {_s(d['ours']['detect_to_commit_s'])} | {_s(d['ours']['inject_to_commit_s'])} | "
        f"{_s(d['ours']['repair_total_s'])} | {_s(d['ours']['update_s'])} | {h.fmt_spread(d['ours_in_updates'])} |",
    ]
    if tft_ok:
        lines.append(f"| torchft | {_s(d['torchft']['detect_to_commit_s'])} | {_s(d['torchft']['inject_to_commit_s'])} "
                     f"| n/a | {_s(d['torchft']['update_s'])} | {h.fmt_spread(d['torchft_in_updates'])} |")
        lines += [
            "",
            (f"torchft / ours, paired per round: {h.fmt_spread(d['ratio'])} (n={d['ratio']['n']}). After detection, "
             "ours votes, discards FSDP's per-iteration state, replaces and rebinds every group of the mesh and redoes "
             "the update bitwise on 4 FSDP ranks sharing 2 cores; torchft forms a new quorum, reconfigures one Gloo "
             "group and redoes a plain all-reduce update of 2 processes. Each system's own uninterrupted update is in "
             "the table, so the last column compares the recovery in units of its own update."),
        ]
    lines += ["", MARK]
    return "\n".join(lines)
