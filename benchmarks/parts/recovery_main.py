"""Recovery benchmark: orchestration, analysis and the markdown block (``benchmarks/parts/recovery.py``)."""

from __future__ import annotations

import argparse
import importlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts import recovery_runs as rr

PART = "recovery"
MARK = "<!-- recovery-bench -->"
DEFAULT_BUDGET_S = 1440.0
#: The commit before the detector (the code it is compared with for its per-update cost).
BEFORE = "d4de086"
TITLES = {
    "link-boundary": "link fault at the boundary (stalled: every member inside the collective)",
    "link-backward": "link fault in backward (stalled replication all-reduce)",
    "kill": "SIGKILL of a rank",
    "stop": "SIGSTOP of a rank (hung)",
    "bug": "a training-code exception (to the job's exit)",
    "daemon-kill": "SIGKILL of a checkpoint daemon",
}
GOALS = {
    "link-boundary": "≤ 1.0 s plus the redone update, independent of collective_s",
    "link-backward": "≤ 1.0 s plus the redone update, independent of collective_s",
    "kill": "detected ≤ 0.5 s; training again ≤ 5 s (L2)",
    "stop": "≤ heartbeat_s + 1 s to the fail_stop, stacks in the log",
    "bug": "one start, exit ≤ 1 s after the exception",
    "daemon-kill": "training goes on",
}


#: The peers, each driving the same FSDP HSDP model on the same four ranks: name -> module (``FAULTS``: our fault
#: classes it has, ``run_trial``).
PEERS = {"torchft": "bench.recovery_torchft", "nvrx": "bench.recovery_nvrx"}
PEER_TITLES = {"torchft": "torchft (its Manager, lighthouse, restart-and-heal)",
               "nvrx": "NVRx in-job restart (ft_launcher, rank monitors, checkpoint every 4)"}


def _peer(name: str) -> Any:
    """The peer's driver module when it is there, else None."""
    try:
        return importlib.import_module(PEERS[name])
    except ImportError:
        return None


def run(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from accelpact_slurm.core.config import load_config
    from benchmarks.parts.workload import JOB_FILE

    budget = h.Budget(h.outer_deadline(args.budget_s, margin_s=20.0, floor_s=60.0))
    defaults = load_config(JOB_FILE).timeouts
    res = h.new_result(PART, json=h.json_field(args.json), plan={"trials": args.trials, "U": rr.U, "steps": rr.STEPS,
                       "every": rr.EVERY, "every_l1": rr.EVERY_L1, "classes": list(args.classes)},
                       timeouts={k: getattr(defaults, k) for k in ("collective_s", "control_s", "heartbeat_s",
                                                                    "heartbeat_interval_s", "link_floor_s",
                                                                    "shutdown_s")},
                       trials=[], peers={name: [] for name in args.peers}, traffic=None, cost=None)
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    peers = {name: m for name in args.peers if (m := _peer(name)) is not None}
    try:
        for i in range(args.trials):
            for cls in h.rotate(args.classes, i):  # every class in every round, the order rotated
                if i and not budget.fits():
                    log(f"round {i + 1}: {cls} would not fit the budget; stopping")
                    break
                t = rr.run_ours(cls, work, f"{i}")
                budget.record(t["wall_s"])
                res["trials"].append(t)
                log(f"round {i + 1} ours {cls}: " + (f"{t['recover_s']:.2f} s (slowest rank)" if t.get("ok")
                                                      else f"FAILED {t.get('error', '')[:300]}"))
                for name, mod in peers.items():
                    if i >= args.peer_trials or cls not in getattr(mod, "FAULTS", ()) or not budget.fits():
                        continue
                    f = _peer_trial(name, mod, cls, work, f"{i}")
                    res["peers"][name].append(f)
                    log(f"round {i + 1} {name} {cls}: {f.get('recover_s')} (handled {f.get('handled')})")
        tft = peers.get("torchft")
        for i in range(args.detect_pairs if tft is not None and "link-backward" in args.classes else 0):
            # Detection -> next commit, like for like: more pairs of the same fault on the same job, the order
            # alternating (ABBA), so that the goal's median rests on more than the rounds' one torchft trial.
            if not budget.fits():
                log(f"detection pair {i + 1}: would not fit the budget; stopping")
                break
            for who in h.abba(i, "ours", "torchft"):
                if who == "ours":
                    t = rr.run_ours("link-backward", work, f"d{i}")
                    budget.record(t["wall_s"])
                    res["trials"].append(t)
                else:
                    t = _peer_trial("torchft", tft, "link-backward", work, f"d{i}")
                    res["peers"]["torchft"].append(t)
                log(f"detection pair {i + 1} {who}: detection -> commit {t.get('detect_to_commit_s')}")
        for i in range(args.first_snapshot):
            if budget.elapsed() + 300 > budget.budget_s:
                log("first snapshot after a restart: would not fit the budget")
                break
            f = rr.run_first_snapshot(work, str(i))
            res.setdefault("first_snapshot", []).append(f)
            log("first snapshot after a restart / regular: " + (f"{f['restart_first_over_regular']:.2f}" if f["ok"]
                                                                else f"FAILED {f['error'][:300]}"))
        if args.cost_pairs and budget.fits(1.0):
            from benchmarks.parts.recovery_cost import measure

            res["cost"] = measure(BEFORE, args.cost_pairs, log, budget)
        if args.toggle_alternations and budget.fits(0.5):
            from benchmarks.parts.recovery_cost import toggle

            res["detector_toggle"] = toggle(log, alternations=args.toggle_alternations)
            budget.record(res["detector_toggle"]["wall_s"])
        if args.traffic and budget.fits(0.5):
            from benchmarks.parts.recovery_traffic import scaling

            res["traffic"] = scaling(seconds=args.traffic_s)
            log("traffic: " + ", ".join(f"{t['ranks']} ranks {t['writes_per_s']:.0f} writes/s" for t in res["traffic"]))
    finally:
        if args.keep:
            log(f"working directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    res["summary"] = rr.summary(res["trials"])
    res["detection"] = detection_pairs(res)
    res["total_wall_s"] = budget.elapsed()
    return res


def _peer_trial(name: str, mod: Any, cls: str, work: Path, tag: str) -> dict[str, Any]:
    """One trial of peer ``name`` on fault class ``cls`` (rank 1 at update U), tagged as our trial it pairs with."""
    try:
        f = mod.run_trial(mod.FAULTS[cls], step=rr.U, rank=1, workdir=work / f"{name}-{cls}-{tag}", timeout_s=90.0)
    except Exception as exc:  # noqa: BLE001 - a peer's harness failing is its result, not ours
        f = {"ok": False, "handled": None, "error": f"{type(exc).__name__}: {exc}"[:500]}
    f["cls"], f["tag"] = cls, tag
    return f


def detection_pairs(res: dict[str, Any], cls: str = "link-backward") -> dict[str, Any]:
    """Ours against torchft on ``cls``, paired by tag (the same round or detection pair): per pair and key
    (``detect_to_commit_s``: from the first rank's detection; ``known_to_commit_s``: from when every rank knew),
    both seconds and ours / torchft; medians and spreads over the pairs."""
    ours = {t["tag"]: t for t in res["trials"] if t["cls"] == cls and t.get("ok") and t.get("detect_to_commit_s")}
    theirs = {t.get("tag"): t for t in (res.get("peers") or {}).get("torchft", [])
              if t.get("cls") == cls and t.get("handled") and t.get("detect_to_commit_s")}
    pairs = [{"tag": k, **{f"{who}_{key}": src[k].get(key) for who, src in (("ours", ours), ("torchft", theirs))
                           for key in ("detect_to_commit_s", "known_to_commit_s", "detect_first_s", "recover_s")}}
             for k in ours if k in theirs]
    out: dict[str, Any] = {"cls": cls, "pairs": pairs}
    for key in ("detect_to_commit_s", "known_to_commit_s"):
        out[key] = {"ours": h.spread(p[f"ours_{key}"] for p in pairs),
                    "torchft": h.spread(p[f"torchft_{key}"] for p in pairs),
                    "ratio": h.spread(h.ratio(p[f"ours_{key}"], p[f"torchft_{key}"]) for p in pairs)}
    return out


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    fs = [f for f in res.get("first_snapshot") or [] if f.get("ok")]
    if fs:
        rows.append(h.row("first snapshot after a restart / a regular one (110M model)", "snapshots 12 and 15 of the "
                          "same start", h.spread(f["restart_first_over_regular"] for f in fs), note="goal ≤ 1.5x"))
    tg = res.get("detector_toggle") or {}
    if tg.get("ok"):
        r = tg["ratio"]
        rows.append(h.row("detector: guarded update time, detector on / off in the same job (slowest rank)",
                          f"the same job's guarded updates with the detector off (tap removed, rounds unwatched), "
                          f"{tg['k']} on and {tg['k']} off in turn, ABBA, every rank timed",
                          {"median": r["median"], "min": r["lo"], "max": r["hi"], "n": r["n"]},
                          note=f"{tg['added_ms']:+.2f} ms per update (the slowest rank's); the spread is the 90% "
                               f"bootstrap interval of the median; goal ≤ 1.01x"))
    cost = res.get("cost") or {}
    if cost.get("pairs"):
        rows.append(h.row("detector: update time, current / the code before the detector (guarded updates)",
                          f"the same job at commit {cost['commit']}, ABBA pairs", cost["guarded_ms"],
                          note=f"plain updates {h.fmt_spread(cost['plain_ms'], '{:.3f}')}; every change since that "
                               f"commit counts here, jobs at different moments (the goal: the row above)"))
    dp = res.get("detection") or {}
    if (dp.get("detect_to_commit_s") or {}).get("ratio", {}).get("n"):
        d, k = dp["detect_to_commit_s"], dp["known_to_commit_s"]
        rows.append(h.row("link fault in backward: detection → next commit, ours / torchft (the first rank's "
                          "detection to the slowest rank's commit of the redone update)",
                          "torchft driving the same FSDP HSDP job on the same 4 ranks, the same stalled all-reduce, "
                          "paired per round", d["ratio"],
                          note=f"ours {h.fmt_spread(d['ours'], '{:.3f}')} s, torchft "
                               f"{h.fmt_spread(d['torchft'], '{:.3f}')} s; from when every rank knew: "
                               f"{h.fmt_spread(k['ratio'], '{:.2f}')}x ({h.fmt(k['ours']['median'], '{:.3f}')} vs "
                               f"{h.fmt(k['torchft']['median'], '{:.3f}')} s); goal ≤ 1.0x"))
    s = res["summary"]
    for cls in res["plan"]["classes"]:
        c = s[cls]
        rows.append({"what": f"recovery: {TITLES[cls]}", "baseline": "seconds, slowest rank (absolute)",
                     "ratio": c["recover_s"]["median"], "spread": None if c["recover_s"]["median"] is None else
                     f"{h.fmt(c['recover_s']['min'])}–{h.fmt(c['recover_s']['max'])}", "n": c["recover_s"]["n"],
                     "unit": "s", "note": f"goal {GOALS[cls]}"})
    return rows


def markdown(res: dict[str, Any]) -> str:
    F = h.fmt_spread
    t = res["timeouts"]
    lines = [MARK, "## Recovery: from the fault to training again", "",
             f"Written by `benchmarks/parts/recovery.py` on {res['date']}"
             + (f" (raw data: `{res['json']}`)" if res.get("json") else "") + ".", "",
             f"**Machine.** {h.machine_line(res['machine'])}. Shared and noisy: absolute seconds, for the goals; "
             "the spread is over trials.", "",
             (f"**What ran.** Per fault class, {res['plan']['trials']} trials of `accelpact-run` on the embedded "
              f"default (2 emulated nodes x 2 ranks, the decoder example, FSDP1 `HYBRID_SHARD`, a snapshot every "
              f"{res['plan']['every']} updates, every {res['plan'].get('every_l1', res['plan']['every'])} for the "
              f"link faults: none in the update they redo), the fault at update {res['plan']['U']}, the shipped default timeouts "
              f"(collective_s {t['collective_s']:g}, control_s {t['control_s']:g}, heartbeat_s {t['heartbeat_s']:g}, "
              f"heartbeat_interval_s {t['heartbeat_interval_s']:g}, link_floor_s {t['link_floor_s']:g}). Every rank "
              "records its commits (`benchmarks/parts/recovery_entry.py`); a trial's figure is the slowest rank's time "
              "from the injection (the faulting rank's own record just before it) to its next committed update; "
              "for a bug, to the job's exit."), "",
             "| fault | ours: injection → next commit, slowest rank, median (min–max) | decided: first fail_stop, or "
             "the L1 repair's fault → resume | restarts | cause | goal |", "|---|---|---|---|---|---|"]
    for cls in res["plan"]["classes"]:
        c = res["summary"][cls]
        decided = (f"{F(c['detected_s'])} s (fail_stop)" if c["detected_s"]["n"] else
                   f"{F(c['repair_s'])} s (L1 repair)" if c["repair_s"]["n"] else "nothing to decide")
        lines.append(f"| {TITLES[cls]} | **{F(c['recover_s'])} s** (n {c['recover_s']['n']}) | {decided} | "
                     f"{', '.join(map(str, c['restarts']))} | {', '.join(c['causes']) or '-'} | {GOALS[cls]} |")
    failed = [(cls, e) for cls in res["plan"]["classes"] for e in res["summary"][cls]["failed"]]
    if failed:
        lines += ["", "Trials that failed: " + "; ".join(f"{c}: {e}" for c, e in failed[:6]) + "."]
    for name, trials in (res.get("peers") or {}).items():
        if not trials:
            continue
        lines += ["", f"{PEER_TITLES.get(name, name)}, driving the same FSDP HSDP model on the same four ranks "
                      f"(`benchmarks/parts/recovery_{name}.py`; rank 1's fault at update {res['plan']['U']}):", "",
                  "| fault | injection → next commit, slowest rank, median (min–max) | handled | n | how |",
                  "|---|---|---|---|---|"]
        for cls in res["plan"]["classes"]:
            ts = [x for x in trials if x.get("cls") == cls]
            if ts:
                handled = sorted({str(x.get("handled")) for x in ts})
                how = "; ".join(sorted({str(x.get("detected_by") or x.get("not_handled_because") or x.get("error")
                                            or "") for x in ts}))[:240]
                lines.append(f"| {TITLES[cls]} | {F(h.spread(x.get('recover_s') for x in ts))} s | "
                             f"{', '.join(handled)} | {len(ts)} | {how or '-'} |")
        lowered = next((x for x in trials if x.get("timeouts_lowered")), None)
        if lowered is not None and isinstance(lowered["timeouts_lowered"], dict):
            used = lowered.get("timeouts") or {}
            lines += ["", f"Timeouts {name} ran with that differ from its shipped ones (the reasons in the JSON): "
                          + "; ".join(f"`{k}` {used.get(k, '?')} s ({str(v).split(';')[0].split(':')[0][:100]})"
                                      for k, v in lowered["timeouts_lowered"].items()) + "."]
    dp = res.get("detection") or {}
    if dp.get("pairs"):
        d, k = dp["detect_to_commit_s"], dp["known_to_commit_s"]
        lines += ["", ("**Detection → next commit, like for like**: the link fault in backward "
                       "above, ours and torchft on the same FSDP HSDP job, the same four ranks, the same stalled "
                       "replication all-reduce of rank 1 in update 8's backward (torchft: rank 1 waits its process "
                       "group's timeout in place of the all-reduce, then reports the failure to its manager, as a "
                       "timed-out all-reduce does; its peer times out inside the all-reduce), paired per round "
                       "(the rounds' trials and the extra detection pairs, ABBA). Detection: the moment a rank's "
                       "collective was given up (ours: the detector's verdict, `detected_ts` of its `fault` event) "
                       "or failed (torchft: the `detect` record after the all-reduce returned failed); commit: the "
                       "slowest rank's commit of the redone update (neither takes a snapshot in it)."), "",
                  "| from | ours s | torchft s | ours / torchft, paired | n |", "|---|---|---|---|---|",
                  f"| the first rank's detection | {F(d['ours'], '{:.3f}')} | {F(d['torchft'], '{:.3f}')} | "
                  f"**{F(d['ratio'])}** | {d['ratio']['n']} |",
                  f"| every rank knew (ours: the last rank's verdict; torchft: the last of the failed all-reduces "
                  f"and `should_commit`'s aborts) | {F(k['ours'], '{:.3f}')} | {F(k['torchft'], '{:.3f}')} | "
                  f"{F(k['ratio'])} | {k['ratio']['n']} |",
                  "", (f"Goal ≤ 1.0x: {'met' if (d['ratio']['median'] or 9) <= 1.0 else 'not met'}. The detection "
                       f"itself is not in these figures: ours gave the stalled all-reduce up after "
                       f"{F(h.spread(p['ours_detect_first_s'] for p in dp['pairs']))} s (the learned bound), torchft "
                       f"after {F(h.spread(p['torchft_detect_first_s'] for p in dp['pairs']))} s (its timeout)."),
                  ]
    fs = [f for f in res.get("first_snapshot") or [] if f.get("ok")]
    if fs:
        lines += ["", ("**The first snapshot after a restart** (`recovery_runs.run_first_snapshot`: the checkpoint "
                       "part's 110M-parameter model, 2 x 2 ranks, a snapshot every 3 updates, the first start stopped "
                       "after snapshot 6 and relaunched): blocked "
                       f"{F(h.spread(f['restart_first_over_regular'] for f in fs))}x a regular snapshot of the same "
                       "start (goal ≤ 1.5x; the capture proof of this job's plans is not run again); the first start's "
                       f"first snapshot, which runs the proof, {F(h.spread(f.get('start_first_over_second') for f in fs))}x "
                       f"its second. Proof verdicts: {fs[-1]['proof']}.")]
    cost = res.get("cost")
    if cost and cost.get("skipped"):
        lines += ["", f"The detector's per-update cost was not measured: {cost['skipped']}."]
    elif cost and cost.get("pairs"):
        lines += ["", (f"**What the detector costs an update** (`benchmarks/parts/recovery_cost.py`: the guard part's "
                       f"job, the current code against commit `{cost['commit']}`, the code before the detector, "
                       f"{cost['pairs']} pairs in ABBA order, rank 0's median update): plain updates (FSDP's "
                       f"collectives through the tap, the heartbeat thread) {F(cost['plain_ms'], '{:.3f}')}x "
                       f"({F(cost['plain_ms_added'], '{:+.2f}')} ms), guarded updates (the vote's watched round "
                       f"too) {F(cost['guarded_ms'], '{:.3f}')}x ({F(cost['guarded_ms_added'], '{:+.2f}')} ms). "
                       "That comparison counts every change since that commit and compares jobs run at different "
                       "moments of a shared machine.")]
    tg = res.get("detector_toggle")
    if tg and tg.get("ok"):
        per = ", ".join(f"rank {x['rank']} {x['ratio']:.3f}x ({x['lo']:.3f}–{x['hi']:.3f}, {x['added_ms']:+.2f} ms)"
                        for x in tg["per_rank"])
        cpu = tg["liveness_cpu_share"]
        lines += ["", (f"**The detector's own cost** (`recovery_cost.toggle`: one job of the current code, "
                       f"{tg['alternations']} alternations of {tg['k']} guarded updates with the detector on and "
                       f"{tg['k']} with it off (its collective tap removed, the control plane's rounds unwatched), "
                       f"ABBA; an alternation's ratio is its on updates' mean over its adjacent off updates' mean, of the "
                       f"slowest rank in each; median, 90% bootstrap interval): {tg['ratio']['median']:.3f}x "
                       f"({tg['ratio']['lo']:.3f}–{tg['ratio']['hi']:.3f}), {tg['added_ms']:+.2f} ms per update. "
                       f"Goal ≤ 1.01x: {'met' if tg['ratio']['median'] <= 1.01 else 'not met'}. Each rank from its "
                       f"own times: {per}. "
                       f"The liveness thread, which writes the heartbeat in both halves, used "
                       f"{F(cpu, '{:.4f}')} of a core per rank over the section.")]
    elif tg:
        lines += ["", f"The detector's own cost was not measured: {tg.get('error', '?')}."]
    if res.get("traffic"):
        lines += ["", "The heartbeat path alone (no training): N publishers against one store host, "
                      f"interval {res['traffic'][0]['interval_s']:g} s (`benchmarks/parts/recovery_traffic.py`):", "",
                  "| ranks | writes/s | per rank | bytes/s | store host CPU s/s | per rank |", "|---|---|---|---|---|---|"]
        for x in res["traffic"]:
            lines.append(f"| {x['ranks']} | {x['writes_per_s']:.0f} | {x['writes_per_s_per_rank']:.2f} | "
                         f"{x['bytes_per_s']:.0f} | {x['host_cpu_s_per_s']:.4f} | {x['host_cpu_per_rank']:.2e} |")
    lines += ["", MARK]
    return "\n".join(lines)


def build_parser(doc: str) -> argparse.ArgumentParser:
    head, _, rest = doc.partition("\n\n")
    ap = argparse.ArgumentParser(prog="bench_recovery.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    h.output_args(ap, f"runs/bench/{h.today()}/{PART}.json")
    ap.add_argument("--trials", type=int, default=5, help="trials per fault class (default: %(default)s)")
    ap.add_argument("--classes", default=",".join(rr.CLASSES), type=lambda s: [c for c in s.split(",") if c],
                    help="fault classes (default: all: %(default)s)")
    ap.add_argument("--peers", default=",".join(PEERS), type=lambda x: [p for p in x.split(",") if p],
                    help="peers beside ours (default: %(default)s; '' for none)")
    ap.add_argument("--peer-trials", type=int, default=3, help="trials per fault class and peer (default: "
                                                                  "%(default)s)")
    ap.add_argument("--detect-pairs", type=int, default=3,
                    help="extra pairs of ours and torchft on link-backward, ABBA, for detection -> next commit "
                         "(default: %(default)s)")
    ap.add_argument("--no-traffic", dest="traffic", action="store_false", help="leave the heartbeat scaling out")
    ap.add_argument("--first-snapshot", type=int, default=1,
                    help="jobs measuring the first snapshot after a restart on the 110M model (default: %(default)s)")
    ap.add_argument("--cost-pairs", type=int, default=3,
                    help=f"job pairs for the per-update cost against commit {BEFORE} (0: leave it out; default: "
                         f"%(default)s)")
    ap.add_argument("--toggle-alternations", type=int, default=60,
                    help="alternations of the detector on / off in one job, for its own cost (0: leave it out; "
                         "default: %(default)s)")
    ap.add_argument("--traffic-s", type=float, default=6.0, help="seconds per size (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="start no trial that would not fit (default: %(default)s s; lowered to "
                         "$ACCELPACT_BENCH_DEADLINE_S - 20 when that is set)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    return ap


def main(argv: list[str] | None = None, doc: str = "") -> int:
    args = build_parser(doc).parse_args(argv)
    log = h.logger(PART)
    if args.render:
        res = h.read_result(args.render)
        if h.write_markdown(args.markdown, MARK, markdown(res)) is None:
            print(markdown(res))
        return 0
    bad = [c for c in args.classes if c not in rr.CLASSES]
    if bad or args.trials < 1:
        raise SystemExit(f"--classes: unknown {bad} (choose from {', '.join(rr.CLASSES)}); --trials must be >= 1")
    h.stop_on_signals(PART)
    res = run(args, log)
    h.finish(res)
    res["rows"] = summary_rows(res)
    out = h.write_result(res, args.json)
    log(f"written to {out}")
    if h.write_markdown(args.markdown, MARK, markdown(res)) is None and args.markdown != "":
        print(markdown(res))
    return 0
