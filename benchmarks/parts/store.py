#!/usr/bin/env python3
"""The job's authenticated store: what it costs an update, against the code before it (default ``2abb175``).

Before ``2abb175``'s successor the ranks' data plane, control plane and heartbeats used torch's ``TCPStore``; now
they use the job's own store (``accelpact_slurm/runtime/transport/store.py``: a handshake under the run's key, a MAC on
every frame, a Python server in a process of its own beside rank 0).  Four measurements, side by side in this one
run:

0. **Per update, in one job** (the goal's): the current code's job, its control plane (the vote's round) on the
   job's store and on a ``TCPStore`` that rank 0 hosts, ``k`` guarded updates each in turn, many alternations
   (ABBA), every rank timed (``guard_entry.toggle_store``, ``recovery_cost.toggle``): the same processes at the
   same moments of the machine, the store alone changed.
1. **Per update, ABBA**: the same job (the decoder example's model at its sizes, 2 emulated nodes x 2 ranks, no
   snapshots, ``benchmarks/parts/guard_entry.py``: interleaved segments of plain and guarded updates, rank 0's clock)
   run by the current code and by the earlier commit (a detached ``git worktree``), in the order current, earlier,
   earlier, current, ...; a pair's figure is the current job's median update over the earlier one's, for plain
   updates and for guarded ones (whose vote is a control-plane round through the store), with the added
   milliseconds beside the ratio.
2. **Per round trip**: one client's ``set`` then ``get`` of a vote-sized value, against the job's store and against
   a ``TCPStore``, both served by one other process (as rank 0 serves every other rank), interleaved in blocks
   (ABBA), many samples: what the ratio of (1) is made of.
3. **Where the server runs, ABBA**: the job of (1), current code only, its store served by a process of its own
   (the default) and by a thread of rank 0 (``ACCELPACT_STORE_THREAD=1``, as before
   ``runtime/transport/store_host.py``); a pair's figure is the thread job's median update over the process job's, with
   the added milliseconds.

Output: ``--json`` (default ``runs/bench/<date>/store.json``) and the block between ``<!-- store-bench -->``
markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts' summaries).

Usage: .venv/bin/python benchmarks/parts/store.py [--pairs 9] [--commit 2abb175]
       .venv/bin/python benchmarks/parts/store.py --render runs/bench/<date>/store.json

About 4 minutes here with the defaults (one job of about 50 s, then 18 jobs of about 10 s).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as h  # noqa: E402

h.add_paths()

PART = "store"
MARK = "<!-- store-bench -->"
BEFORE = "2abb175"
DEFAULT_BUDGET_S = 480.0


_HOST_BOTH = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from accelpact_slurm.runtime.transport.store import binding, host_store, port_candidates
key = bytes.fromhex(sys.stdin.readline().strip())
server = host_store("127.0.0.1", port_candidates(key, "bench"), key, binding("bench", 0))
plain = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
print(server.port, plain.port, flush=True)
sys.stdin.readline()  # until the benchmark is done
"""


def round_trips(blocks: int = 20, per_block: int = 200) -> dict[str, Any]:
    """Median microseconds of one ``set`` + ``get`` per block, the job's store against ``TCPStore`` (ABBA).

    Both servers live in one other process (as rank 0's does for every other rank), this process is the client.
    """
    import subprocess

    import torch.distributed as dist

    from accelpact_slurm.runtime.transport.store import JobStore, binding

    key = secrets.token_bytes(32)
    host = subprocess.Popen([sys.executable, "-c", _HOST_BOTH], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=str(h.REPO))
    try:
        assert host.stdin is not None and host.stdout is not None
        host.stdin.write(key.hex() + "\n")
        host.stdin.flush()
        ours_port, plain_port = (int(x) for x in host.stdout.readline().split())
        ours = JobStore("127.0.0.1", [ours_port], key, binding("bench", 0), 1, timedelta(seconds=30))
        plain = dist.TCPStore("127.0.0.1", plain_port, 1, is_master=False, timeout=timedelta(seconds=30))
        value = b'{"ok": true, "loss": 2.5, "update": 100, "phase": "boundary"}' * 2
        samples: dict[str, list[float]] = {"ours": [], "tcpstore": []}
        for i in range(blocks):
            for name in h.abba(i, "ours", "tcpstore"):
                store = ours if name == "ours" else plain
                t0 = time.perf_counter()
                for j in range(per_block):
                    store.set(f"vote/{j % 4}", value)
                    store.get(f"vote/{j % 4}")
                samples[name].append((time.perf_counter() - t0) / per_block * 1e6)
        ours.close()
    finally:
        host.kill()
        host.wait(10)
    ratios = [a / b for a, b in zip(samples["ours"], samples["tcpstore"])]
    return {"blocks": blocks, "per_block": per_block, "ours_us": h.spread(samples["ours"]),
            "tcpstore_us": h.spread(samples["tcpstore"]), "ratio": h.spread(ratios),
            "where": "both servers in one other process, this process the client"}


def where_served(pairs: int, plan: dict[str, Any], log: Any, budget: Any) -> dict[str, Any]:
    """Measurement 3: the current code's job with its store in a process of its own and in a thread of rank 0."""
    import shutil
    import tempfile

    from benchmarks.parts import guard as bg

    work = Path(tempfile.mkdtemp(prefix="bench-store-where-"))
    jobs: list[dict[str, Any]] = []
    try:
        for i in range(pairs):
            if i and not budget.fits(2.1):
                log(f"where: pair {i + 1} would not fit the budget; stopping at {i}")
                break
            for mode in h.abba(i, "process", "thread"):
                job = bg.run_job(h.REPO, f"{mode}-{i}", work, plan, 90.0,
                                 extra_env={"ACCELPACT_STORE_THREAD": "1" if mode == "thread" else "0"})
                job["mode"], job["pair"] = mode, i
                budget.record(job["wall_s"])
                jobs.append(job)
                log(f"where pair {i + 1} {mode}: " + (f"plain {job['plain_ms']:.1f} ms, guarded {job['guarded_ms']:.1f} ms"
                                                       if job["ok"] else f"FAILED {job.get('error', '')[:200]}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by = {(j["pair"], j["mode"]): j for j in jobs if j["ok"]}
    done = [i for i in range(pairs) if (i, "thread") in by and (i, "process") in by]
    res: dict[str, Any] = {"jobs": jobs, "pairs": len(done)}
    for kind in ("plain_ms", "guarded_ms"):
        res[kind] = h.spread(by[(i, "thread")][kind] / by[(i, "process")][kind] for i in done)
        res[f"{kind}_added"] = h.spread(by[(i, "thread")][kind] - by[(i, "process")][kind] for i in done)
    return res


def markdown(res: dict[str, Any]) -> str:
    lines = [MARK, "", f"Run {res.get('date', '?')} ({h.machine_line(res.get('machine', {}))}); "
             f"the current code against commit `{res.get('commit', BEFORE)}` (torch's `TCPStore`).", ""]
    cost = res.get("cost") or {}
    lines += ["| measured | ratio (median, min-max) | added | samples |", "|---|---|---|---|"]
    if cost.get("skipped"):
        lines.append(f"| per update | not measured: {cost['skipped']} | | |")
    else:
        for kind, what in (("plain_ms", "plain update (FSDP collectives, heartbeats)"),
                           ("guarded_ms", "guarded update (the vote: a control-plane round)")):
            r, a = cost.get(kind) or {}, cost.get(f"{kind}_added") or {}
            lines.append(f"| {what} | {h.fmt_spread(r, '{:.3f}')} | {h.fmt_spread(a, '{:+.2f}')} ms | "
                         f"{cost.get('pairs', 0)} pairs (ABBA) |")
    rt = res.get("round_trips") or {}
    if rt:
        lines.append(f"| one set + get, the job's store / TCPStore | {h.fmt_spread(rt.get('ratio'), '{:.2f}')} | "
                     f"{h.fmt(rt['ours_us']['median'], '{:.0f}')} us against "
                     f"{h.fmt(rt['tcpstore_us']['median'], '{:.0f}')} us | {rt['blocks']} blocks of "
                     f"{rt['per_block']} |")
    where = res.get("where") or {}
    for kind, what in (("plain_ms", "plain update"), ("guarded_ms", "guarded update")):
        if where.get(kind, {}).get("n"):
            lines.append(f"| {what}, the store in a thread of rank 0 / in its own process (current code) | "
                         f"{h.fmt_spread(where[kind], '{:.3f}')} | {h.fmt_spread(where[f'{kind}_added'], '{:+.2f}')} ms "
                         f"| {where['pairs']} pairs (ABBA) |")
    tg = res.get("toggle") or {}
    if tg.get("ok"):
        r = tg["ratio"]
        per = ", ".join(f"rank {x['rank']} {x['ratio']:.3f}x ({x['lo']:.3f}–{x['hi']:.3f})" for x in tg["per_rank"])
        lines.insert(lines.index("| measured | ratio (median, min-max) | added | samples |") - 1,
                     f"Measurement 0, the goal's: one job of the current code, its control plane (the vote's round) on "
                     f"the job's store and on a `TCPStore` hosted by rank 0, {tg['k']} guarded updates each in turn, "
                     f"{tg['alternations']} alternations (ABBA; the heartbeats and the detector's reads on the job's "
                     f"store in both); an alternation's ratio is the slowest rank's mean over its mean with TCPStore: "
                     f"{r['median']:.3f}x (90% bootstrap interval {r['lo']:.3f}–{r['hi']:.3f}), "
                     f"{tg['added_ms']:+.2f} ms per update; each rank from its own times: {per}.\n")
        goal = r["median"]
    elif tg:
        lines.insert(2, f"Measurement 0 (the job's store against a TCPStore in one job) failed: {tg.get('error')}.\n")
        goal = (cost.get("guarded_ms") or {}).get("median")
    else:
        goal = (cost.get("guarded_ms") or {}).get("median")
    lines += ["", f"Goal: the authenticated store costs an update at most 1% (guarded update ratio <= 1.01): "
              f"{'met' if goal is not None and goal <= 1.01 else 'not met' if goal is not None else 'not measured'}"
              f" ({h.fmt(goal, '{:.3f}')}).", "", MARK]
    return "\n".join(lines)


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The overview's rows (``benchmarks/harness/run.py``)."""
    cost, rows = res.get("cost") or {}, []
    tg = res.get("toggle") or {}
    if tg.get("ok"):
        r = tg["ratio"]
        rows.append(h.row("guarded update, authenticated store / TCPStore in the same job (slowest rank)",
                          f"the same job's guarded updates with the control plane on a TCPStore, {tg['k']} and "
                          f"{tg['k']} in turn, ABBA, every rank timed",
                          {"median": r["median"], "min": r["lo"], "max": r["hi"], "n": r["n"]},
                          note=f"{tg['added_ms']:+.2f} ms per update (the slowest rank's); the spread is the 90% "
                               f"bootstrap interval of the median; goal <= 1.01x"))
    if cost.get("guarded_ms"):
        added = (cost.get("guarded_ms_added") or {}).get("median")
        rows.append(h.row("guarded update, authenticated store, against the code before it",
                          f"the same job at {res.get('commit')} (TCPStore)", cost["guarded_ms"],
                          note=f"{h.fmt(added, '{:+.2f}')} ms per update" + (
                              "; every change since that commit counts here (the goal: the row above)"
                              if tg.get("ok") else "; goal <= 1.01x")))
    rt = res.get("round_trips") or {}
    if rt.get("ratio"):
        rows.append(h.row("one set + get", "TCPStore, same process, interleaved", rt["ratio"],
                          note=f"{h.fmt(rt['ours_us']['median'], '{:.0f}')} us"))
    where = res.get("where") or {}
    if (where.get("guarded_ms") or {}).get("n"):
        added = (where.get("guarded_ms_added") or {}).get("median")
        rows.append(h.row("guarded update, the store in a thread of rank 0", "the store in a process of its own, "
                          "same code (ABBA)", where["guarded_ms"], note=f"{h.fmt(added, '{:+.2f}')} ms per update"))
    return rows


def build_parser() -> argparse.ArgumentParser:
    head, _, rest = (__doc__ or "").partition("\n\n")
    ap = argparse.ArgumentParser(prog="bench_store.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=9, help="ABBA pairs of jobs (default: %(default)s)")
    ap.add_argument("--commit", default=BEFORE, help="the earlier commit (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=4, help="segment pairs per job (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=8, help="updates per segment (default: %(default)s)")
    ap.add_argument("--toggle-alternations", type=int, default=100,
                    help="alternations of measurement 0, the control plane on the job's store and on a TCPStore in "
                         "one job (0: leave it out; default: %(default)s)")
    ap.add_argument("--where-pairs", type=int, default=3,
                    help="ABBA pairs of measurement 3, the store's server in a process vs a thread (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time budget (default: %(default)s)")
    h.output_args(ap, f"runs/bench/{h.today()}/store.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = h.logger(PART)
    if args.render:
        res = h.read_result(args.render)
        if h.write_markdown(args.markdown, MARK, markdown(res)) is None:
            print(markdown(res))
        return 0
    if args.pairs < 0 or args.rounds < 1 or args.steps < 1 or args.where_pairs < 0 or args.toggle_alternations < 0:
        raise SystemExit("--rounds and --steps must be >= 1, --pairs, --where-pairs and --toggle-alternations >= 0")
    from benchmarks.parts import recovery_cost

    budget = h.Budget(h.outer_deadline(args.budget_s, margin_s=10.0, floor_s=30.0))
    h.stop_on_signals(PART)
    res = h.new_result(PART, json=h.json_field(args.json), commit=args.commit)
    res["round_trips"] = round_trips()
    rt = res["round_trips"]
    log(f"round trip: ours {rt['ours_us']['median']:.0f} us, TCPStore {rt['tcpstore_us']['median']:.0f} us")
    plan = {"rounds": args.rounds, "steps": args.steps, "warmup": 3}
    if args.toggle_alternations:
        res["toggle"] = recovery_cost.toggle(log, alternations=args.toggle_alternations, what="store")
        budget.record(res["toggle"]["wall_s"])
    res["cost"] = recovery_cost.measure(args.commit, args.pairs, log, budget, plan) if args.pairs else {
        "skipped": "--pairs 0"}
    if args.where_pairs:
        res["where"] = where_served(args.where_pairs, plan, log, budget)
    res["total_wall_s"] = budget.elapsed()
    h.finish(res)
    cost = res["cost"]
    if not (res.get("toggle") or {}).get("ok") and not cost.get("pairs"):
        res["error"] = "neither the in-job alternation nor a complete pair of jobs"
        out = h.write_result(res, args.json, failed=True)
        log(f"FAILED: {res['error']} (written to {out})")
        return 1
    res["rows"] = summary_rows(res)
    out = h.write_result(res, args.json)
    h.write_markdown(args.markdown, MARK, markdown(res))
    g = (res.get("toggle") or {}).get("ratio") or cost.get("guarded_ms") or {}
    log(f"result written to {out}: guarded update {h.fmt(g.get('median'), '{:.3f}')}x with TCPStore")
    return 0


if __name__ == "__main__":
    sys.exit(main())
