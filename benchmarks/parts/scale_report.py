"""The scale part's figures, overview rows, goals, README bullet and docs section (``benchmarks/parts/scale.py``),
from its raw result alone (pure: a result in, text out).

Per run (:func:`run_figures`): the blocking of rank 0's snapshots (``snapshot.blocking_s`` less
``parts_s.wait_slot``, the wait for a slot the daemon still writes: the disk's backpressure, the same for any
snapshot; the raw blocking beside it), the first snapshot of each start against the median of the same run's
other snapshots; the job's memory (every node's ranks' and daemon's ``RssAnon`` plus its ``/dev/shm`` staging) at
its peak and its steady level (the median over the run's second half), per parameter; the reload's rate
(``restart_load.load_s``) against a plain sequential read of the same files right after the job; the final
state's digest against the uninterrupted run of the same size and trial.  Per size (:func:`size_figures`): the
median (min–max) of each over the runs.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import common as h

MARK = "<!-- scale-bench -->"
PART = "scale"
FIRST_GOAL = 1.5  # a first snapshot (of a job, of a restart) blocks <= 1.5x a regular one
MEM_GOAL = 2.0  # B/param: the peak within 2 bytes per parameter of the steady level
LOAD_GOAL = 0.67  # the reload's rate >= 0.67x the plain read's
GIB = 2**30


# ====================================================================== per run


def _own(s: dict[str, Any]) -> float | None:
    b = s.get("blocking_s")
    return None if b is None else b - float((s.get("parts_s") or {}).get("wait_slot") or 0.0)


def snapshot_figures(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """The first snapshot of the first start, the first of the newest restart and the median of the others (own
    blocking, seconds; ``raw_*``: with the wait for a slot)."""
    by: dict[int, list[dict[str, Any]]] = {}
    for s in snaps:
        if isinstance(s.get("restart"), int) and isinstance(s.get("step"), int):
            by.setdefault(s["restart"], []).append(s)
    firsts = {r: min(ss, key=lambda s: s["step"]) for r, ss in by.items()}
    regular = [s for r, ss in by.items() for s in ss if s is not firsts[r]]
    out: dict[str, Any] = {"regular_s": h.med(_own(s) for s in regular),
                           "raw_regular_s": h.med(s.get("blocking_s") for s in regular), "regular_n": len(regular)}
    job = firsts.get(0)
    restart = firsts[max(firsts)] if firsts and max(firsts) > 0 else None
    for key, s in (("job", job), ("restart", restart)):
        out[f"first_{key}_s"] = None if s is None else _own(s)
        out[f"raw_first_{key}_s"] = None if s is None else s.get("blocking_s")
        out[f"first_{key}_step"] = None if s is None else s.get("step")
        out[f"first_{key}_proof"] = None if s is None else ("cached" if "proven earlier" in str(s.get("proof") or "")
                                                             else "ran" if s.get("proof") else None)
        out[f"first_{key}_ratio"] = h.ratio(out[f"first_{key}_s"], out["regular_s"])
    return out


def node_bytes(n: dict[str, Any]) -> int:
    """A node's memory at a sample: its ranks' and daemon's ``RssAnon`` plus its ``/dev/shm`` staging."""
    return int(n.get("anon", 0)) + int(n.get("shm", 0))


def job_bytes(sample: dict[str, Any]) -> int:
    return sum(node_bytes(n) for n in sample["nodes"].values())


def complete(samples: list[dict[str, Any]]) -> list[bool]:
    """Whether each sample saw every process of a start (as many nodes, ranks per node and daemons per node as
    the most any sample saw): a sample between two starts, or of a start still coming up, is not steady."""
    nodes = max(len(s["nodes"]) for s in samples)
    ranks = max(n.get("ranks", 0) for s in samples for n in s["nodes"].values())
    daemons = max(n.get("daemons", 0) for s in samples for n in s["nodes"].values())
    return [len(s["nodes"]) == nodes and all(n.get("ranks") == ranks and n.get("daemons") == daemons
                                             for n in s["nodes"].values()) for s in samples]


def memory_figures(samples: list[dict[str, Any]], params: int,
                   windows: list[list[float]] | None = None) -> dict[str, Any]:
    """Peak (over every sample) and steady level (the median over the samples of the run's second half that saw
    every process) of the job's and of each node's memory (:func:`node_bytes`), bytes and bytes per parameter.

    ``windows`` (``[[from, to]]``, the samples' time base: every snapshot from its blocking to its last daemon's
    word, and the job's end): the peak inside them against the peak outside them, over the samples that saw every
    process (``snap_excess_pp``: what snapshots and the final digest add to the peak of training alone)."""
    if not samples or not params:
        return {"n": 0}
    t_lo, t_hi = samples[0]["t"], samples[-1]["t"]
    mid = (t_lo + t_hi) / 2
    late = [s for s, ok in zip(samples, complete(samples)) if ok and s["t"] >= mid] or \
        [s for s in samples if s["t"] >= mid]
    job = [job_bytes(s) for s in samples]
    peak = max(job)
    steady = h.med(job_bytes(s) for s in late) or 0
    out: dict[str, Any] = {"n": len(samples), "steady_n": len(late), "span_s": round(t_hi - t_lo, 1),
                           "peak": peak, "steady": steady, "peak_t": samples[job.index(peak)]["t"],
                           "vmrss_peak": max(sum(int(n.get("vmrss", 0)) for n in s["nodes"].values())
                                             for s in samples),
                           "shm_peak": max(sum(int(n.get("shm", 0)) for n in s["nodes"].values()) for s in samples),
                           "peak_pp": peak / params, "steady_pp": steady / params,
                           "excess_pp": (peak - steady) / params, "nodes": {}}
    if windows:
        inside = [any(a <= s["t"] <= b for a, b in windows) for s in samples]
        full = complete(samples)
        snap = [job_bytes(s) for s, i, ok in zip(samples, inside, full) if i and ok]
        train = [job_bytes(s) for s, i, ok in zip(samples, inside, full) if not i and ok]
        if snap and train:
            out.update(snap_peak=max(snap), train_peak=max(train), snap_n=len(snap), train_n=len(train),
                       snap_excess_pp=(max(snap) - max(train)) / params)
    for node in sorted({k for s in samples for k in s["nodes"]}):
        p = max(node_bytes(s["nodes"][node]) for s in samples if node in s["nodes"])
        st = h.med(node_bytes(s["nodes"][node]) for s in late if node in s["nodes"]) or 0
        out["nodes"][node] = {"peak": p, "steady": st, "peak_pp": p / params, "steady_pp": st / params,
                              "excess_pp": (p - st) / params}
    return out


def run_figures(run: dict[str, Any], params: int, ref_digest: str | None) -> dict[str, Any]:
    """One run's figures (module docstring)."""
    out: dict[str, Any] = {**snapshot_figures(run.get("snapshots") or []),
                           "memory": memory_figures(run.get("samples") or [], params, run.get("windows")),
                           "step_s": h.med(run.get("step_s") or [])}
    load, plain = run.get("load") or {}, run.get("plain_read") or {}
    out["load_s"], out["plain_s"], out["load_bytes"] = load.get("load_s"), plain.get("read_s"), plain.get("bytes")
    out["load_step"] = load.get("step")
    out["load_ratio"] = h.ratio(plain.get("read_s"), load.get("load_s"))  # reload rate / plain rate (same bytes)
    out["bitwise"] = None if run.get("kind") == "ref" or not ref_digest else run.get("digest") == ref_digest
    out["peak_at"] = run.get("peak_at")
    return out


# ====================================================================== per size


def ok_runs(res: dict[str, Any], size: str) -> list[dict[str, Any]]:
    return [r for r in res.get("runs") or [] if r.get("size") == size and not r.get("error")]


def ref_digest(res: dict[str, Any], size: str, trial: int) -> str | None:
    return next((r.get("digest") for r in ok_runs(res, size) if r.get("trial") == trial and r.get("kind") == "ref"),
                None)


def size_figures(res: dict[str, Any], size: str) -> dict[str, Any]:
    params = ((res.get("sizes") or {}).get(size) or {}).get("params") or 0
    runs = ok_runs(res, size)
    figs = [(r, run_figures(r, params, ref_digest(res, size, r.get("trial", 0)))) for r in runs]
    failed = [r for r in res.get("runs") or [] if r.get("size") == size and r.get("error")]
    restarted = [(r, f) for r, f in figs if r.get("kind") != "ref"]
    mem = [f["memory"] for _r, f in figs if f["memory"].get("n")]
    checked = [f["bitwise"] for _r, f in restarted if f["bitwise"] is not None]
    return {
        "params": params, "runs": len(runs), "failed": len(failed),
        "first_job": h.spread(f["first_job_ratio"] for _r, f in figs),
        "first_restart": h.spread(f["first_restart_ratio"] for _r, f in restarted),
        "first_job_s": h.spread(f["first_job_s"] for _r, f in figs),
        "first_restart_s": h.spread(f["first_restart_s"] for _r, f in restarted),
        "regular_s": h.spread(f["regular_s"] for _r, f in figs),
        "excess_pp": h.spread(m["excess_pp"] for m in mem),
        "snap_excess_pp": h.spread(m["snap_excess_pp"] for m in mem if "snap_excess_pp" in m),
        "peak_pp": h.spread(m["peak_pp"] for m in mem), "steady_pp": h.spread(m["steady_pp"] for m in mem),
        "node_excess_pp": h.spread(n["excess_pp"] for m in mem for n in m["nodes"].values()),
        "peak_gib": h.spread(m["peak"] / GIB for m in mem),
        "footprint_adds_gib": h.med((r.get("footprint") or {}).get("adds", 0) / GIB for r, _f in figs
                                    if (r.get("footprint") or {}).get("adds")),
        "load": h.spread(f["load_ratio"] for _r, f in restarted),
        "load_s": h.spread(f["load_s"] for _r, f in restarted),
        "plain_s": h.spread(f["plain_s"] for _r, f in restarted),
        "load_gib": h.med((f["load_bytes"] or 0) / GIB for _r, f in restarted if f["load_bytes"]),
        "bitwise": {"equal": sum(1 for b in checked if b), "n": len(checked),
                    "expected": sum(1 for r in res.get("runs") or [] if r.get("size") == size
                                    and r.get("kind") != "ref")},
        "step_s": h.spread(f["step_s"] for _r, f in figs),
        "wall_s": {k: h.med(r.get("wall_s") for r, _f in figs if r.get("kind") == k) for k in ("ref", "fault", "kill")},
        "per_run": [{"trial": r.get("trial"), "kind": r.get("kind"), "wall_s": r.get("wall_s"),
                     "restarts": r.get("restarts"), **{k: v for k, v in f.items() if k != "memory"},
                     "memory": {k: v for k, v in f["memory"].items() if k != "nodes"}} for r, f in figs],
        "failures": [f"trial {r.get('trial')} {r.get('kind')}: {str(r.get('error'))[:400]}" for r in failed],
    }


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    res["summary"] = {size: size_figures(res, size) for size in res.get("params", {}).get("sizes") or []}
    res["rows"] = summary_rows(res)
    return res


def _label(res: dict[str, Any], size: str) -> str:
    p = ((res.get("sizes") or {}).get(size) or {}).get("params")
    return f"{size} ({p / 1e6:.1f}M parameters)" if p else size


def _sm(res: dict[str, Any]) -> dict[str, Any]:
    return res.get("summary") or {s: size_figures(res, s) for s in res.get("params", {}).get("sizes") or []}


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for size, s in _sm(res).items():
        lab = _label(res, size)
        reg = "the same run's other snapshots (median; blocking less the wait for a slot)"
        rows.append(h.row(f"{lab}: the job's first snapshot, training blocked", reg, s["first_job"],
                          note=f"{h.fmt(s['first_job_s']['median'])} s vs {h.fmt(s['regular_s']['median'])} s "
                               f"(medians); goal ≤ {FIRST_GOAL}x"))
        rows.append(h.row(f"{lab}: a restart's first snapshot (after a forward fault or a SIGKILL, L2), training "
                          "blocked", reg, s["first_restart"],
                          note=f"{h.fmt(s['first_restart_s']['median'])} s (median); goal ≤ {FIRST_GOAL}x"))
        rows.append(h.row(f"{lab}: memory at its peak above its steady level (ranks' and daemons' RssAnon + "
                          "/dev/shm)", "the steady level: the median over the run's second half", s["excess_pp"],
                          unit="B/param", note=f"peak {h.fmt(s['peak_pp']['median'])} B/param, steady "
                                               f"{h.fmt(s['steady_pp']['median'])} B/param; goal ≤ {MEM_GOAL:g} "
                                               "B/param in every run"))
        if s.get("snap_excess_pp", {}).get("n"):
            rows.append(h.row(f"{lab}: memory at its peak during snapshots and the final digest, above its peak "
                              "while only training", "the same run's peak outside every snapshot (from training "
                              "blocked to the last daemon's verdict) and outside the job's end",
                              s["snap_excess_pp"], unit="B/param",
                              note="what the snapshots add to the job's own peak (training alone swings between "
                                   "its peak and its steady level within each update); ≤ 0 adds nothing"))
        rows.append(h.row(f"{lab}: the restart's reload rate (`restart_load.load_s`)",
                          "a plain sequential read of the same files right after the job", s["load"],
                          note=f"{h.fmt(s['load_s']['median'])} s vs {h.fmt(s['plain_s']['median'])} s for "
                               f"{h.fmt(s['load_gib'])} GiB (medians); goal ≥ {LOAD_GOAL}x"))
        b = s["bitwise"]
        share = None if not b["n"] else b["equal"] / b["n"]
        rows.append(h.row(f"{lab}: runs with a fault or a kill ending bitwise equal to the uninterrupted run",
                          "every such run compared", {"median": share, "min": share, "max": share, "n": b["n"]},
                          unit="", note=f"{_bitwise(b)} (`final_state_digest`)"))
    return rows


# ====================================================================== goals and the README


def _bitwise(b: dict[str, Any]) -> str:
    """``E of N`` runs equal; the runs not compared (their size's uninterrupted run failed) said as such."""
    text = f"{b['equal']} of {b['n']}"
    if b["n"] < b["expected"]:
        text += f" compared ({b['expected'] - b['n']} without an uninterrupted run to compare with)"
    return text


def _verdict(value: float | None, ok: bool) -> str:
    return "not decided" if value is None else ("met" if ok else "not met")


def goal_rows(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The goals table's lines of this part: (goal, verdict, measured)."""
    out = []
    for size, s in _sm(res).items():
        lab = _label(res, size)
        for key, what in (("first_job", "the job's first snapshot"), ("first_restart", "a restart's first snapshot")):
            st = s[key]
            out.append((f"{lab}: {what} blocks ≤ {FIRST_GOAL}x a regular one", _verdict(
                st["median"], st["median"] is not None and st["median"] <= FIRST_GOAL),
                f"{h.fmt_spread(st)}x (n {st['n']})" if st["median"] is not None else "no run measured it"))
        st = s["excess_pp"]
        out.append((f"{lab}: memory peak ≤ steady + {MEM_GOAL:g} B/param", _verdict(
            st["median"], st["max"] is not None and st["max"] <= MEM_GOAL),
            f"{h.fmt_spread(st)} B/param above steady (n {st['n']}); peak {h.fmt(s['peak_gib']['max'])} GiB"
            if st["median"] is not None else "no memory samples"))
        st = s["load"]
        out.append((f"{lab}: reload rate ≥ {LOAD_GOAL}x a plain sequential read of the same files", _verdict(
            st["median"], st["median"] is not None and st["median"] >= LOAD_GOAL),
            f"{h.fmt_spread(st)}x (n {st['n']})" if st["median"] is not None else "no reload measured"))
        b = s["bitwise"]
        out.append((f"{lab}: {res.get('params', {}).get('steps')} updates with a forward fault (L2) and with a "
                    "SIGKILL of a rank end bitwise equal to the uninterrupted run",
                    "not met" if b["equal"] < b["n"] else ("met" if b["expected"] and b["n"] == b["expected"]
                                                           else "not decided"),
                    f"{_bitwise(b)} runs" + (f"; {s['failed']} run(s) failed" if s["failed"] else "")))
    if out:
        out.append(("the first snapshot of a changed plan blocks ≤ 1.5x a regular one", "not decided",
                    "this part changes no plan: it awaits a run that restarts with another capture plan"))
    return out


def readme_bullet(res: dict[str, Any]) -> str | None:
    sm = _sm(res)
    if not sm:
        return None
    each = []
    for size, s in sm.items():
        b = s["bitwise"]
        each.append(f"{_label(res, size)}: the job's first snapshot blocks {h.fmt_spread(s['first_job'])}x a regular "
                    f"one, a restart's first {h.fmt_spread(s['first_restart'])}x (goal ≤ {FIRST_GOAL}x); memory "
                    f"peaks {h.fmt_spread(s['excess_pp'])} B/param above its steady level (goal ≤ {MEM_GOAL:g}); the "
                    f"reload runs at {h.fmt_spread(s['load'])}x a plain read's rate (goal ≥ {LOAD_GOAL}x); "
                    f"{_bitwise(b)} runs with a fault or a kill end bitwise equal")
    p = res.get("params") or {}
    return (f"- **Snapshots at the size people train** (`scale`, the decoder on 2 x 2 ranks, a snapshot every "
            f"{p.get('every')} of {p.get('steps')} updates, uninterrupted, with a forward fault and with a SIGKILLed "
            "rank): " + "; ".join(each) + ".")


# ====================================================================== the docs section


def _gib(x: float | None) -> str:
    return h.fmt(None if x is None else x / GIB)


def markdown(res: dict[str, Any]) -> str:
    p, m = res.get("params") or {}, res.get("machine") or {}
    sm = _sm(res)
    sizes = ", ".join(f"{_label(res, s)}: {', '.join(f'{k} {v}' for k, v in (res['sizes'][s].get('shape') or {}).items())}"
                      for s in sm)
    trials = ", ".join(f"{s} {n}" for s, n in (p.get("trials") or {}).items())
    lines = [
        MARK, "## Snapshots at the size people train: first snapshots, memory, reload", "",
        (f"Written by `benchmarks/parts/scale.py` on {res.get('date')} ({m.get('cpus')} CPU cores, "
         f"{m.get('memory_gib')} GiB of memory, load average at start "
         f"{', '.join(f'{x:.1f}' for x in m.get('loadavg_start') or [])})"
         f"{' in its quick mode (a tiny model: a smoke run, not a figure of the sizes)' if p.get('quick') else ''}. "
         f"The decoder example ({sizes}) on the embedded default (2 emulated nodes x 2 ranks, per-node daemons) "
         f"trains {p.get('steps')} updates with a snapshot every {p.get('every')}, three runs per trial (trials: "
         f"{trials}): uninterrupted (the reference `final_state_digest`); with the fault `{p.get('fault')}` (a fault "
         f"in uncommitted compute: L2, the job restarts from its newest snapshot); and with a SIGKILL of rank "
         f"{p.get('kill_rank')} right after rank 0's `step` event of update {p.get('kill_after')} (L2)."),
        "",
        ("**Blocking**: rank 0's `snapshot.blocking_s` less `parts_s.wait_slot` (the wait for a staging slot the "
         "daemon still writes: the disk's backpressure, the same for any snapshot); a first snapshot (of the job: "
         "its staging slot made and touched, the capture proof; of a restart: the slot again) against the median "
         "of the same run's other snapshots. **Memory**: every 0.2 s, the `RssAnon` of each node's ranks and daemon "
         "(from `/proc/<pid>/status`, the pids from the run's `process` events) plus the bytes its staging holds in "
         "`/dev/shm` (mapped by the rank and the daemon, counted once); the peak and the steady level (the median "
         "over the run's second half), per parameter of the model; and the peak inside the snapshots' windows (from "
         "training blocked to the last daemon's verdict, and the job's end with its final digest) against the peak "
         "outside them, over the samples that saw every process: what snapshots add to the job's own peak. "
         "**Reload**: `restart_load.load_s` (rank 0, the "
         "offer rounds, the re-check of the checksums and the load) against one sequential read, 8 MiB at a time, "
         "of the same step's files on every node, right after the job in the benchmark's process (the files "
         "hard-linked when the reload began, so that retention cannot remove them): the ratio of the two rates, "
         "plain seconds over reload seconds."),
        "",
        "| size | first snapshot / regular | restart's first / regular | peak − steady, B/param | snapshots' peak − "
        "training's peak, B/param | peak, B/param | steady, B/param | reload / plain read rate | bitwise equal | "
        "per update, s | runs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, s in sm.items():
        b = s["bitwise"]
        lines.append(f"| {_label(res, size)} | {h.fmt_spread(s['first_job'])} | {h.fmt_spread(s['first_restart'])} | "
                     f"{h.fmt_spread(s['excess_pp'])} | {h.fmt_spread(s.get('snap_excess_pp') or {})} | "
                     f"{h.fmt_spread(s['peak_pp'])} | {h.fmt_spread(s['steady_pp'])} "
                     f"| {h.fmt_spread(s['load'])} | {_bitwise(b)} | {h.fmt_spread(s['step_s'])} | "
                     f"{s['runs']}" + (f" ({s['failed']} failed)" if s["failed"] else "") + " |")
    lines += ["", ("Medians (min–max) over the runs. Each run, in seconds and GiB (the job's memory; blocking "
                   "without the wait for a slot, with it in brackets where it differs):"), "",
              "| size | trial | run | wall, s | restarts | first snapshot (step), s | regular, s | restart's first "
              "(step, proof), s | memory peak / steady, GiB | the peak: after | `/dev/shm` peak, GiB | reload, s | "
              "plain read, s | GiB read | bitwise |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for size, s in sm.items():
        for r in s["per_run"]:
            mem = r["memory"]

            def bl(own: float | None, raw: float | None) -> str:
                txt = h.fmt(own)
                return txt + (f" ({h.fmt(raw)})" if own is not None and raw is not None and raw - own > 0.005 else "")
            rf = ("-" if r["first_restart_s"] is None else
                  f"{bl(r['first_restart_s'], r['raw_first_restart_s'])} ({r['first_restart_step']}, "
                  f"{r['first_restart_proof'] or 'none'})")
            lines.append(
                f"| {size} | {r['trial']} | {r['kind']} | {h.fmt(r['wall_s'], '{:.0f}')} | {r['restarts']} | "
                f"{bl(r['first_job_s'], r['raw_first_job_s'])} ({r['first_job_step']}) | "
                f"{bl(r['regular_s'], r['raw_regular_s'])} | {rf} | "
                f"{_gib(mem.get('peak'))} / {_gib(mem.get('steady'))} | {r.get('peak_at') or 'n/a'} | "
                f"{_gib(mem.get('shm_peak'))} | "
                f"{h.fmt(r['load_s'])} | {h.fmt(r['plain_s'])} | {_gib(r['load_bytes'])} | "
                f"{'-' if r['bitwise'] is None else ('yes' if r['bitwise'] else 'NO')} |")
    pred = [f"{size} {h.fmt(s['footprint_adds_gib'])} GiB" for size, s in sm.items() if s.get("footprint_adds_gib")]
    if pred:
        lines += ["", ("What the job predicted it would add after its start on this one host (the `footprint` event "
                       "at `job.protect`: gradients, optimizer state, the staging and the first capture proof; a "
                       f"floor, medians): {'; '.join(pred)}.")]
    fails = [f"{size}: {f}" for size, s in sm.items() for f in s["failures"]]
    if fails:
        lines += ["", "Runs that failed (not in the figures): " + "; ".join(fails) + "."]
    lines += ["", ("The first snapshot of a changed plan (a restart whose capture plan differs from the proven "
                   "ones) is not measured here. The plain read follows the job, so its files may still be in the "
                   "page cache from the reload, as the reload's may have been from their writing: both read this "
                   "machine's memory as much as its disk.")]
    if res.get("cut_short"):
        cut = res["cut_short"]
        lines += ["", f"Cut short by the part's budget: {'; '.join(cut) if isinstance(cut, list) else cut}."]
    lines += ["", MARK]
    return "\n".join(lines)
