"""Recovery benchmark: what the fault detector costs an update, against the code before it (``scripts/bench_recovery.py``).

The detector's cost sits in every collective of the HSDP groups (the tap numbers it and waits 20 ms before it
looks at anyone) and in a thread per rank that writes a heartbeat every interval.  Measured as the guard part
measures its own (``scripts/bench_guard.py``, whose job runner this reuses): the same job (the decoder example, 2
x 2 ranks, no snapshots, ``scripts/bench/guard_entry.py``: interleaved segments of plain and guarded updates, rank
0's clock) run by the current code and by the commit before the detector (``BEFORE``, a detached ``git worktree``),
in ABBA order; a pair's figure is the current job's median update over the earlier one's, for plain updates
(the FSDP collectives through the tap) and guarded ones (the tap, the vote's watched round).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench import harness as h


def measure(commit: str, pairs: int, log: Any, budget: Any, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    import bench_guard as bg  # scripts/bench_guard.py: its checkout and job runner

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
