"""Recovery benchmark: what the fault detector costs an update, against the code before it (``benchmarks/parts/recovery.py``).

The detector's cost sits in every collective of the HSDP groups (the tap numbers it and waits 20 ms before it
looks at anyone) and in a thread per rank that writes a heartbeat every interval.  Measured as the guard part
measures its own (``benchmarks/parts/guard.py``, whose job runner this reuses): the same job (the decoder example, 2
x 2 ranks, no snapshots, ``benchmarks/parts/guard_entry.py``: interleaved segments of plain and guarded updates, rank
0's clock) run by the current code and by the commit before the detector (``BEFORE``, a detached ``git worktree``),
in ABBA order; a pair's figure is the current job's median update over the earlier one's, for plain updates
(the FSDP collectives through the tap) and guarded ones (the tap, the vote's watched round).  That comparison
counts every change since that commit, not the detector's alone, and compares jobs run at different moments of a
shared machine (their medians move by several percent from job to job).  The goal is decided by :func:`toggle`
instead: the detector on and off in turn inside one job of the current code, every rank timed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h


def measure(commit: str, pairs: int, log: Any, budget: Any, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    from benchmarks.parts import guard as bg  # benchmarks/parts/guard.py: its checkout and job runner

    plan = plan or {"rounds": 4, "steps": 8, "warmup": 3}
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-cost-"))
    old_tree = work / "earlier"
    res: dict[str, Any] = {"commit": commit, "plan": plan, "jobs": []}
    try:
        full, why = bg.checkout(commit, old_tree)
        if full is None:
            res["skipped"] = why
            return res
        res["commit_id"] = full
        trees = {"current": h.REPO, "earlier": old_tree}
        for i in range(pairs):
            if i and not budget.fits(2.1):
                log(f"cost: pair {i + 1} would not fit the budget; stopping at {i}")
                break
            for version in h.abba(i, "current", "earlier"):
                job = bg.run_job(trees[version], f"{version}-{i}", work, plan, 90.0)
                job["version"], job["pair"] = version, i
                budget.record(job["wall_s"])
                res["jobs"].append(job)
                log(f"cost pair {i + 1} {version}: " + (f"plain {job['plain_ms']:.1f} ms, guarded "
                                                         f"{job['guarded_ms']:.1f} ms" if job["ok"] else
                                                         f"FAILED {job.get('error', '')[:200]}"))
    finally:
        bg.remove_worktree(old_tree)
        shutil.rmtree(work, ignore_errors=True)
    by = {(j["pair"], j["version"]): j for j in res["jobs"] if j["ok"]}
    done = [i for i in range(pairs) if (i, "current") in by and (i, "earlier") in by]
    for kind in ("plain_ms", "guarded_ms"):
        res[kind] = h.spread(by[(i, "current")][kind] / by[(i, "earlier")][kind] for i in done)
        res[f"{kind}_added"] = h.spread(by[(i, "current")][kind] - by[(i, "earlier")][kind] for i in done)
    res["pairs"] = len(done)
    return res


def toggle(log: Any, k: int = 2, alternations: int = 60, deadline_s: float = 120.0,
           what: str = "detector") -> dict[str, Any]:
    """The detector's own cost in one job of the current code: ``k`` guarded updates with the detector on, then
    ``k`` with it off (its tap removed, the control plane's rounds unwatched), ``alternations`` times in ABBA order
    (``guard_entry.toggle_detector``).  The same work, the same processes, the same moments of the machine: an
    alternation's ratio is its ``on`` updates' mean over its adjacent ``off`` updates' mean, per rank; the goal's
    figure is the median over the alternations of the slowest rank's ratio (every rank timed), with a bootstrap
    interval of that median (:func:`toggle_analysis`).  ``what="store"``: the control plane on the job's store
    (``on``) and on a ``TCPStore`` (``off``) instead (``guard_entry.toggle_store``), for the store part."""
    from benchmarks.parts import guard as bg  # benchmarks/parts/guard.py: its job runner

    work = Path(tempfile.mkdtemp(prefix=f"bench-{what}-toggle-"))
    try:
        plan = {"rounds": 0, "steps": 0, "warmup": 3, "toggle": {"k": k, "alternations": alternations, "what": what}}
        recs, res, logf = bg.launch(h.REPO, "toggle", work, plan, deadline_s)
        got = next((r for r in recs if r.get("ev") == "toggle"), None)
        if got is None or not any(r.get("ev") == "done" for r in recs):
            why = "its deadline passed" if res["rc"] is None else f"exit code {res['rc']}"
            res.update(ok=False, error=f"no complete run ({why}): {h.tail(logf, 6, sep=' | ', limit=600)}")
            log(f"{what} on/off: FAILED {res['error'][:300]}")
            return res
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res.update(toggle_analysis(got))
    res["ok"] = True
    log(f"{what} on/off in one job: slowest rank {res['ratio']['median']:.3f}x "
        f"(90% interval {res['ratio']['lo']:.3f}-{res['ratio']['hi']:.3f}), {res['added_ms']:+.2f} ms")
    return res


def toggle_analysis(got: dict[str, Any], boot: int = 2000, seed: int = 20240611) -> dict[str, Any]:
    """An alternation's ratio: the mean of its ``on`` updates over the mean of its adjacent ``off`` updates, of the
    slowest rank in each (the ranks step in lock step at every vote: the job moves at its slowest rank's pace);
    the headline is their median, with a bootstrap 90% interval of it.  Per rank the same from its own times, the
    added milliseconds (median on - median off) and the liveness thread's CPU share of one core (pure,
    deterministic)."""
    import random
    import statistics as st

    k = got["k"]
    ranks = got["ranks"]

    def blocks(on: list[list[float]], off: list[list[float]]) -> list[float]:
        n = min(min(len(x) for x in on), min(len(x) for x in off))
        return [max(st.mean(x[i:i + k]) for x in on) / max(st.mean(x[i:i + k]) for x in off) for i in range(0, n, k)]

    def summary(ratios: list[float], salt: int) -> dict[str, Any]:
        rng = random.Random(seed + salt)
        meds = sorted(st.median(rng.choices(ratios, k=len(ratios))) for _ in range(boot))
        return {"median": st.median(ratios), "lo": meds[int(0.05 * boot)], "hi": meds[int(0.95 * boot) - 1],
                "n": len(ratios)}

    per_rank = []
    for r, t in enumerate(ranks):
        on, off = t["on"], t["off"]
        cpu = t.get("liveness_cpu_s")
        per_rank.append({"rank": r, **{("alternations" if key == "n" else key): v
                                       for key, v in summary(blocks([on], [off]), r).items()
                                       if key != "median"}, "ratio": st.median(blocks([on], [off])),
                         "on_ms": st.median(on) * 1e3, "off_ms": st.median(off) * 1e3,
                         "added_ms": (st.median(on) - st.median(off)) * 1e3,
                         "liveness_cpu_share": None if cpu is None else cpu / t["wall_s"]})
    slowest = blocks([t["on"] for t in ranks], [t["off"] for t in ranks])
    on_slow = [max(t["on"][i] for t in ranks) for i in range(min(len(t["on"]) for t in ranks))]
    off_slow = [max(t["off"][i] for t in ranks) for i in range(min(len(t["off"]) for t in ranks))]
    return {"k": k, "alternations": got["alternations"], "per_rank": per_rank,
            "ratio": summary(slowest, len(ranks)), "blocks": slowest,
            "on_ms": st.median(on_slow) * 1e3, "off_ms": st.median(off_slow) * 1e3,
            "added_ms": (st.median(on_slow) - st.median(off_slow)) * 1e3,
            "liveness_cpu_share": h.spread(x["liveness_cpu_share"] for x in per_rank)}
