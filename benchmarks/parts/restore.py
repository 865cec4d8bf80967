#!/usr/bin/env python3
"""Node-loss restore benchmark: start to training again when the snapshot comes from a peer node's copy or
from the shared tier, against the same restart from every node's own copy.

One job on the embedded default (2 emulated nodes x 2 ranks, the per-node checkpoint daemons), the decoder
example at the reference job's size unless ``--layers``/``--width`` say otherwise, started by the library's
own launcher (``harness.launch_job``; the ranks run the example's entry point through
``benchmarks/parts/restore_entry.py``), trains ``2 * every + 1`` updates with a snapshot every ``--every``
updates and ``checkpoint.shared_every: 1``: it leaves snapshots ``every`` and ``2 * every`` (= N) verified in
both node directories and in the shared tier.  That run directory is the pristine tree.  Each measured
restart starts the same job file again (one more update to train: N + 1) from a fresh copy of the pristine
tree (node directories, shared tier, the run's key and indexes, and of its events only the ``replay_ref``
records the replay check reads; as ``tests/e2e/test_l2_reload_e2e.py`` makes a requeued run directory), with
some copies removed first:

    own      nothing removed: every node loads its own copy of N (the baseline)
    peer     node1's directory removed and the shared tier's copy of N removed: node2's first rank copies its
             own N into the shared tier, the copy is re-read against the manifest, node1's ranks load it
             (``checkpoint_copy`` event; ``restart_load.copied``)
    shared   every node's directory removed: every rank loads the shared tier's copy of N
    mixed    node1's directory removed, the shared tier holds N: node1's ranks load it there, node2's their
             own

Every restart is checked to have taken that path (``restart_load``: step N, the path rank 0 loaded, the
copy or its absence; the replay check of update N + 1 ``match``; exit 0); a restart that did not is an error,
not a figure.  The variants run in rounds, the order rotating from round to round (round k starts with the
k-th variant), and every ratio is paired within one round.

Measured, per restart: **start to training again** = the ``ts`` of the first ``step`` event after the
``restart_load`` event (rank 0 writes it once update N + 1, the first after the load, has committed on every
rank: its forward, backward, vote, optimizer step and the replay check) minus the wall-clock time right before
the launcher was called (rank and daemon start-up, imports, rendezvous and the model's construction are
included, the same in every variant); and the restore's own time, ``restart_load.load_s`` (rank 0, from
entering the restore to its ``restart_load`` event: the offer round, which also waits for the slowest rank
to arrive, the copy, the re-check, the load).  Figures: per round the ratio of each variant to ``own``;
median (min–max) over the rounds; absolute seconds, the phases of the start and the bytes copied for this
run only.

Usage::

    .venv/bin/python benchmarks/parts/restore.py [--rounds 4] [--every 5] [--variants own,peer,shared,mixed]
                                              [--layers L] [--width W] [--json PATH] [--markdown FILE]
    .venv/bin/python benchmarks/parts/restore.py --quick --markdown ''    (one round: a smoke run)
    .venv/bin/python benchmarks/parts/restore.py --render runs/bench/<date>/restore.json

Output: ``--json`` (default ``runs/bench/<date>/restore.json``) and the block between
``<!-- restore-bench -->`` markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts' summaries).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as h  # noqa: E402

h.add_paths()

MARK = "<!-- restore-bench -->"
PART = "restore"
BASE = "own"
#: variant -> what is removed from the fresh copy of the pristine tree before the restart (docstring above)
VARIANTS = {
    "own": "nothing removed: every node loads its own copy",
    "peer": ("node1's directory and the shared tier's copy of the step removed: node2 copies its own to the shared "
             "tier, node1's ranks load that copy"),
    "shared": "every node's directory removed: every rank loads the shared tier's copy",
    "mixed": "node1's directory removed, the shared tier holds the step: node1's ranks load it there",
}
#: the same, short, for the overview rows
SHORT = {
    "peer": "node1's copy lost: the step copied from node2's copy through the shared tier",
    "shared": "every node's copy lost: every rank loads the shared tier's copy",
    "mixed": "node1's copy lost: its ranks load the shared tier's copy",
}
DEFAULT_VARIANTS = ("own", "peer", "shared", "mixed")
QUICK = {"rounds": 1}
#: what a fresh run directory does not take from the pristine tree (events: only the replay references travel)
NOT_COPIED = ("events.jsonl", "summary.json", "logs", ".ready", ".stop-requested-*")
RANK_DEADLINE_S = 150.0  # a rank of any job of this part exits by itself after this (the same in every job)


# ====================================================================== jobs


def write_job(path: Path, args: argparse.Namespace) -> Path:
    """The one job file of the measurement: the snapshot job and every restart start it (its ``params`` are
    recorded by the run directory's first start and compared at every later one, so nothing in it varies)."""
    from benchmarks.parts.workload import entry_of, write_job as write

    model = {k: v for k, v in (("layers", args.layers), ("width", args.width)) if v is not None}
    return write(path, {
        "name": "bench-restore", "steps": 2 * args.every + 1, "log_every": 100_000, "faults": [],
        "topology.nodes": 2, "topology.ranks_per_node": 2, "topology.threads_per_rank": 1,
        "checkpoint.every_steps": args.every, "checkpoint.keep_last": 2, "checkpoint.milestone_every": 0,
        "checkpoint.shared_every": 1, "checkpoint.shared_keep": 2,
        "checkpoint.at_end": False,  # every restart resumes from the periodic snapshot of update 2 x every
    }, entry=entry_of("restore_entry"), params={**model, "bench": {"deadline_s": RANK_DEADLINE_S}})


def _verified(d: Path) -> dict[int, int]:
    """``{step: bytes}`` of the verified snapshots in one directory (a node's or the shared tier)."""
    from ckpt_service.index import dir_size, scan

    return {r.step: dir_size(r.path) for r in scan(str(d)) if r.state == "verified"}


def snapshot_run(work: Path, config: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The job that leaves the pristine tree; its newest step must be verified on every node and in the shared tier."""
    run_dir = work / "pristine"
    t0 = time.monotonic()
    code = h.launch_job(config, run_dir, echo=h.LineFilter(("[bench]",)), job_id="bench-restore-snapshots")
    wall = time.monotonic() - t0
    if code != 0:
        raise RuntimeError(f"the snapshot job exited {code}; rank 0's log ends:\n"
                           f"{h.tail(run_dir / 'logs' / 'rank-0.log', 25)}")
    starts = [e for e in h.read_jsonl(run_dir / "events.jsonl") if e.get("event") == "job_start"]
    hosts = list(starts[0].get("hostnames") or []) if starts else []
    nodes = sorted(p.name for p in (run_dir / "node-local").iterdir() if p.is_dir())
    if len(hosts) != 2 or sorted(hosts) != nodes:
        raise RuntimeError(f"expected two emulated nodes, got hostnames {hosts} and node directories {nodes}")
    step = 2 * args.every
    where = {n: _verified(run_dir / "node-local" / n) for n in hosts}
    where["shared tier"] = _verified(run_dir / "shared-ckpt")
    lacking = [k for k, v in where.items() if step not in v]
    if lacking:
        raise RuntimeError(f"step {step} is not verified on {', '.join(lacking)} after the snapshot job "
                           f"(verified: {json.dumps({k: sorted(v) for k, v in where.items()})})")
    refs = [e for e in h.read_jsonl(run_dir / "events.jsonl") if e.get("event") == "replay_ref"]
    if not any(e.get("snapshot") == step for e in refs):
        raise RuntimeError(f"the snapshot job recorded no replay reference of step {step}")
    return {"run_dir": run_dir, "hosts": hosts, "step": step, "wall_s": wall, "bytes": where[hosts[0]][step],
            "shared_bytes": where["shared tier"][step],
            "verified": {k: sorted(v) for k, v in where.items()}}


def prepare(snap: dict[str, Any], dst: Path, variant: str) -> None:
    """A fresh run directory from the pristine tree, as a requeued job finds it, minus the variant's copies."""
    from ckpt_service.layout import step_dirname

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    src: Path = snap["run_dir"]
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(*NOT_COPIED))
    refs = [e for e in h.read_jsonl(src / "events.jsonl") if e.get("event") == "replay_ref"]
    (dst / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in refs))
    first, _second = snap["hosts"]
    shared_n = dst / "shared-ckpt" / step_dirname(snap["step"])
    if variant in ("peer", "mixed"):
        shutil.rmtree(dst / "node-local" / first)
    if variant == "peer":
        shutil.rmtree(shared_n)
    if variant == "shared":
        for n in snap["hosts"]:
            shutil.rmtree(dst / "node-local" / n)


def _same(a: Any, b: Any) -> bool:
    return a is not None and os.path.realpath(str(a)) == os.path.realpath(str(b))


def check_path(variant: str, load: dict[str, Any], copies: list[dict[str, Any]], run_dir: Path,
               snap: dict[str, Any]) -> str | None:
    """Why the restart did not take the variant's path (``None`` when it did); ``load`` is rank 0's ``restart_load``."""
    from ckpt_service.layout import step_dirname

    first, second = snap["hosts"]
    name = step_dirname(snap["step"])
    own, shared = run_dir / "node-local" / first / name, run_dir / "shared-ckpt" / name
    copied = load.get("copied")
    if load.get("step") != snap["step"] or load.get("skipped"):
        return f"loaded step {load.get('step')} (skipped {load.get('skipped')}), not {snap['step']}"
    if variant == "own" and not (copied is None and not copies and _same(load.get("path"), own)):
        return f"rank 0 loaded {load.get('path')} (copied {copied}), not its node's own copy {own}"
    if variant == "peer":
        if not (copied and copied.get("from") == second and copied.get("hosts") == [first]
                and _same(copied.get("to"), shared) and _same(load.get("path"), shared) and len(copies) == 1):
            return (f"expected a copy from {second} to {shared} for {first} (one checkpoint_copy event); got "
                    f"copied {copied}, path {load.get('path')}, {len(copies)} checkpoint_copy event(s)")
    if variant in ("shared", "mixed") and not (copied is None and not copies and _same(load.get("path"), shared)):
        return f"rank 0 loaded {load.get('path')} (copied {copied}), not the shared tier's copy {shared}"
    return None


def _logs_of(run_dir: Path, events: list[dict[str, Any]]) -> str:
    """What a failed restart left to read: the job's last events and the end of every non-empty log (the
    launcher's echo shows only the replay check's line; a start that fails before any rank logs, as a daemon
    that refuses, says why only there)."""
    out = [f"its last events: {[{k: e.get(k) for k in ('event', 'reason', 'cause', 'exit_code') if k in e} for e in events[-4:]]}"]
    logs = sorted(p for p in (run_dir / "logs").glob("*") if p.is_file() and p.stat().st_size)
    out += [f"{p.name} ends:\n{h.tail(p, 15)}" for p in logs[:6]]
    return "\n".join(out) if logs else out[0] + f"; no log under {run_dir / 'logs'} has anything in it"


def restart(work: Path, rnd: int, variant: str, snap: dict[str, Any], config: Path, keep: bool) -> dict[str, Any]:
    """One measured restart of one variant from a fresh copy of the pristine tree."""
    run_dir = work / f"{rnd}-{variant}"
    job_id = f"bench-restore-{rnd}-{variant}"
    prepare(snap, run_dir, variant)
    t_start = time.time()  # wall clock: the events' ``ts`` are wall-clock seconds of the same machine
    t0 = time.monotonic()
    code = h.launch_job(config, run_dir, echo=h.LineFilter(("[accelpact] replay check",)), job_id=job_id)
    wall = time.monotonic() - t0
    try:
        events = [e for e in h.read_jsonl(run_dir / "events.jsonl") if e.get("job_id") == job_id]
        kinds = [e.get("event") for e in events]
        problem = None if code == 0 else f"exit status {code}"
        if problem is None and kinds.count("restart_load") != 1:
            problem = f"{kinds.count('restart_load')} restart_load events, not one"
        load = events[kinds.index("restart_load")] if "restart_load" in kinds else {}
        after = events[kinds.index("restart_load") + 1:] if load else []
        step = next((e for e in after if e.get("event") == "step"), None)
        copies = [e for e in events if e.get("event") == "checkpoint_copy"]
        checks = [e for e in events if e.get("event") == "replay_check"]
        start = next((e for e in events if e.get("event") == "job_start"), None)
        if problem is None:
            problem = check_path(variant, load, copies, run_dir, snap)
        if problem is None and (step is None or step.get("step") != snap["step"] + 1):
            problem = f"no step event of update {snap['step'] + 1} after the restart_load event"
        if problem is None and [c.get("verdict") for c in checks] != ["match"]:
            problem = f"replay check verdicts {[c.get('verdict') for c in checks]}, not one match"
        if problem is not None:
            raise RuntimeError(f"the {variant} restart of round {rnd} did not take its path: {problem}; "
                               f"{_logs_of(run_dir, events)}")
        assert step is not None
        load_s = float(load["load_s"])
        return {"round": rnd, "variant": variant, "exit_code": code, "wall_s": wall,
                "start_to_train_s": step["ts"] - t_start, "load_s": load_s,
                "ranks_up_s": None if start is None else start["ts"] - t_start,
                "restore_start_s": load["ts"] - load_s - t_start,
                "load_to_train_s": step["ts"] - load["ts"], "first_update_s": step.get("step_s"),
                "path": os.path.relpath(load["path"], run_dir), "copied": load.get("copied") is not None,
                "copy_bytes": copies[0].get("size_bytes") if copies else None,
                "copy_s": copies[0].get("copy_s") if copies else None}
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def measure(args: argparse.Namespace, work: Path, log: Any, res: dict[str, Any]) -> None:
    budget = h.Budget(h.outer_deadline(270.0, margin_s=30.0, floor_s=60.0))
    config = write_job(work / "job.yaml", args)
    snap = snapshot_run(work, config, args)
    res["snapshot"] = {k: v for k, v in snap.items() if k != "run_dir"}
    log(f"snapshot job: step {snap['step']} verified on {', '.join(snap['hosts'])} and in the shared tier, "
        f"{snap['bytes'] / 2**20:.2f} MiB per copy ({snap['wall_s']:.0f} s)")
    runs: list[dict[str, Any]] = []
    res["runs"] = runs
    for rnd in range(args.rounds):
        need = len(args.variants) * budget.longest * 1.15
        if rnd and budget.elapsed() + need > budget.budget_s:
            log(f"round {rnd + 1} would not fit the budget ({budget.budget_s:.0f} s): stopping after {rnd} round(s)")
            res["cut_short"] = f"{rnd} of {args.rounds} rounds within the {budget.budget_s:.0f} s budget"
            break
        for variant in h.rotate(args.variants, rnd):
            r = restart(work, rnd, variant, snap, config, args.keep)
            budget.record(r["wall_s"])
            runs.append(r)
            extra = f", copied {r['copy_bytes'] / 2**20:.2f} MiB in {r['copy_s'] * 1000:.0f} ms" if r["copied"] else ""
            log(f"round {rnd + 1}/{args.rounds} {variant:<6} training again {r['start_to_train_s']:.2f} s after the "
                f"start, restore {r['load_s']:.2f} s from {r['path']}{extra} ({r['wall_s']:.0f} s)")


# ====================================================================== summary and report


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Paired ratios to ``own``, absolute medians and the overview rows, from the runs alone."""
    runs = res.get("runs") or []
    by = {(r["round"], r["variant"]): r for r in runs}
    rounds = sorted({r["round"] for r in runs})
    variants = [v for v in res["params"]["variants"] if any(r["variant"] == v for r in runs)]
    summ: dict[str, Any] = {}
    for v in variants:
        mine = [r for r in runs if r["variant"] == v]
        s: dict[str, Any] = {k: h.spread([r[k] for r in mine]) for k in
                             ("start_to_train_s", "load_s", "ranks_up_s", "restore_start_s", "load_to_train_s")}
        s["copy_bytes"] = h.spread([r["copy_bytes"] for r in mine])
        s["copy_s"] = h.spread([r["copy_s"] for r in mine])
        s["path"] = sorted({r["path"] for r in mine})
        if v != BASE:
            for k in ("start_to_train_s", "load_s"):
                s[f"ratio_{k}"] = h.ratio_stats([(by[i, v][k], by[i, BASE][k]) for i in rounds
                                                 if (i, v) in by and (i, BASE) in by])
        summ[v] = s
    res["summary"] = summ
    step = (res.get("snapshot") or {}).get("step")
    rows = []
    for v in variants:
        if v == BASE:
            continue
        s = summ[v]
        copy = (f"; {_mib(s['copy_bytes']['median'])} copied in {h.fmt(_ms(s['copy_s']['median']), '{:.0f}')} ms"
                if s["copy_bytes"]["median"] else "")
        t, lo = s["ratio_start_to_train_s"], s["ratio_load_s"]
        rows.append(h.row(f"node-loss restore, start to training again (first `step` event after `restart_load`): "
                          f"`{v}` ({SHORT.get(v, v)}; step {step})",
                          "the same restart from every node's own copy (`own`)",
                          t, note=f"{h.fmt(t['abs_test'])} s vs {h.fmt(t['abs_base'])} s (medians, absolute){copy}"))
        rows.append(h.row(f"node-loss restore, the restore's own time (`restart_load.load_s`): `{v}`",
                          "the same restart from every node's own copy (`own`)", lo,
                          note=f"{h.fmt(lo['abs_test'], '{:.3f}')} s vs {h.fmt(lo['abs_base'], '{:.3f}')} s "
                               f"(medians, absolute){copy}"))
    res["rows"] = rows
    return res


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def _abs(d: dict[str, Any] | None, f: str = "{:.2f}") -> str:
    return h.fmt_spread(d, f)


def markdown(res: dict[str, Any]) -> str:
    p, m, snap = res["params"], res["machine"], res.get("snapshot") or {}
    summ = res.get("summary") or {}
    size = ", ".join(f"{k} {v}" for k, v in (("layers", p.get("layers")), ("width", p.get("width"))) if v) \
        or "the reference job's size"
    n_rounds = len({r["round"] for r in res.get("runs") or []})
    step = snap.get("step")
    lines = [
        MARK,
        "## Node-loss restore: from a peer's copy or the shared tier, against the node's own copy",
        "",
        (f"Written by `benchmarks/parts/restore.py` on {res['date']} ({m.get('cpus')} CPU cores, load average at start "
         f"{', '.join(f'{x:.1f}' for x in m.get('loadavg_start') or [])})"
         f"{' in its quick mode' if p.get('quick') else ''}. "
         f"The decoder example at {size} on the embedded default (2 emulated nodes x 2 ranks, per-node daemons) "
         f"trains {2 * p['every'] + 1} updates with a snapshot every {p['every']} and `shared_every: 1`: step {step} "
         f"({_mib(snap.get('bytes'))} per copy) ends up verified in both node directories and in the shared tier. "
         f"Each restart starts the same job from a fresh copy of that tree (its replay references included), with "
         f"the variant's copies removed, and trains update {None if step is None else step + 1}; {n_rounds} round(s), "
         f"the order of the variants rotating from round to round, ratios paired within a round. Every restart is "
         "checked to have taken its path (the step and path `restart_load` names, the copy, the replay check's "
         "`match`)."),
        "",
        ("**Start to training again**: the `ts` of the first `step` event after the `restart_load` event (written "
         "by rank 0 once the first update after the load has committed on every rank, its replay check included) "
         "minus the wall-clock time right before the launcher was called. **Restore**: `restart_load.load_s` "
         "(rank 0, from entering the restore to the end of the load: the offer round, which waits for the last "
         "rank to arrive, any copy, the re-check of the checksums, the load)."),
        "",
        "| variant | start to training again, s | ratio to `own` | restore (`load_s`), s | ratio to `own` | n |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for v, s in summ.items():
        rt = "1 (baseline)" if v == BASE else h.fmt_spread(s.get("ratio_start_to_train_s"))
        rl = "1 (baseline)" if v == BASE else h.fmt_spread(s.get("ratio_load_s"))
        lines.append(f"| `{v}`: {VARIANTS.get(v, v)} | {_abs(s['start_to_train_s'])} | {rt} | "
                     f"{_abs(s['load_s'], '{:.3f}')} | {rl} | {s['start_to_train_s']['n']} |")
    lines += ["", "Medians (min–max). Where the time of a start goes (medians, seconds from the launcher's start):",
              "",
              "| variant | ranks up (`job_start`) | restore entered | restore done | training again | "
              "first update after the load |",
              "|---|---:|---:|---:|---:|---:|"]
    for v, s in summ.items():
        done = None
        if s["restore_start_s"]["median"] is not None and s["load_s"]["median"] is not None:
            done = s["restore_start_s"]["median"] + s["load_s"]["median"]
        lines.append(f"| `{v}` | {h.fmt(s['ranks_up_s']['median'])} | {h.fmt(s['restore_start_s']['median'])} | "
                     f"{h.fmt(done)} | {h.fmt(s['start_to_train_s']['median'])} | "
                     f"{h.fmt(s['load_to_train_s']['median'])} |")
    peer = summ.get("peer")
    if peer and peer["copy_bytes"]["median"]:
        c = peer["copy_s"]
        lines += ["", (f"`peer`: the copy to the shared tier (`checkpoint_copy`): {_mib(peer['copy_bytes']['median'])} "
                       f"in {h.fmt(_ms(c['median']), '{:.0f}')} ms (median; {h.fmt(_ms(c['min']), '{:.0f}')}–"
                       f"{h.fmt(_ms(c['max']), '{:.0f}')} ms).")]
    lines += ["", ("Here the node directories and the shared tier are on one local file system "
                   f"({res.get('work_fs')}), and each restart's tree was just copied (in the page cache): the "
                   "ratios show the restore's own extra work (the copy, the re-check of the new copy), not a shared "
                   "file system's bandwidth; on a cluster add the replica's size over that bandwidth for each copy "
                   "and each read of the shared tier.")]
    if res.get("cut_short"):
        lines += ["", f"Cut short by the part's budget: {res['cut_short']}."]
    lines += ["", MARK]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="bench_restore.py", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds, one restart of every variant each (default: %(default)s)")
    p.add_argument("--every", type=int, default=5,
                   help="checkpoint.every_steps of the snapshot job (default: %(default)s)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, `{BASE}` included, of {', '.join(VARIANTS)} (default: %(default)s)")
    p.add_argument("--layers", type=int, help="the decoder's depth (default: the reference job's)")
    p.add_argument("--width", type=int, help="the decoder's width (default: the reference job's)")
    p.add_argument("--quick", action="store_true",
                   help=f"{', '.join(f'--{k} {v}' for k, v in QUICK.items())}: a smoke run")
    p.add_argument("--keep", action="store_true", help="keep the work directory (and every restart's run directory)")
    h.output_args(p, None, "result file (default runs/bench/<date>/restore.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        res = summarize(h.read_result(args.render))
    else:
        if args.quick:
            for k, v in QUICK.items():
                setattr(args, k, v)
        args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in args.variants if v not in VARIANTS]
        distinct = len(set(args.variants)) == len(args.variants)
        if unknown or BASE not in args.variants or len(args.variants) < 2 or not distinct:
            raise SystemExit(f"--variants: distinct names of {', '.join(VARIANTS)}, `{BASE}` and at least one other")
        if args.rounds < 1 or args.every < 1:
            raise SystemExit("--rounds and --every must be >= 1")
        h.stop_on_signals("bench")  # unwind, so the launcher stops the ranks and daemons
        log = h.logger(PART, time.monotonic())
        res = h.new_result(PART, params={"rounds": args.rounds, "every": args.every, "variants": args.variants,
                                         "layers": args.layers, "width": args.width, "quick": args.quick})
        work = Path(tempfile.mkdtemp(prefix="accelpact-bench-restore-")).resolve()
        res["work_fs"] = h.fs_type(str(work))
        t0 = time.monotonic()
        try:
            measure(args, work, log, res)
        except Exception as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"
            res["wall_s"] = time.monotonic() - t0
            out = h.write_result(h.finish(res), args.json or f"runs/bench/{res['date']}/{PART}.json",
                                 failed=True)
            log(f"failed; wrote {out}")
            raise
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            else:
                log(f"work directory kept: {work}")
        res["wall_s"] = time.monotonic() - t0
        h.finish(res)
        summarize(res)
        out = h.write_result(res, args.json or f"runs/bench/{res['date']}/{PART}.json")
        log(f"wrote {out} ({res['wall_s']:.0f} s)")
    block = markdown(res)
    print(block)
    if args.markdown:
        print(f"[{PART}] updated {h.write_markdown(args.markdown, MARK, block)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
