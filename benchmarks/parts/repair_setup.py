"""L1 repair benchmark, set-up: constants, the faults' schedule, the job file and the job (``benchmarks/parts/repair.py``).

The job is started by the library's launcher (``harness.launch_job``: 2 emulated nodes x 2 ranks, no
checkpoint daemons); its job file names the benchmark's entry point (``repair_entry.main``) and carries the
plan in ``params.bench``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h

MARK = "<!-- repair-bench -->"
PART = "repair"
#: The engine's phases of a boundary repair, in their order (``repair.engine.PHASES``).
PHASES = ("observe", "control_barrier", "guard_sync", "replace", "rebind", "validate")
NODES, RPN = 2, 2
#: Order of the faulting rank: both replication groups ({0, 2} and {1, 3}) get repaired, each rank withholds.
FAULT_RANKS = (1, 2, 3, 0)
#: A group's floor samples run before its repair in these of its repairs (mod 4) and after it in the others:
#: ABBA within each group, so the position is not tied to the group (``floor_positions``).
FLOOR_FIRST = (0, 3)
PROBES = ("rebind_all", "framework_roots", "find_references", "retire_group")
#: Variables a caller's shell might carry that would change what the engine does.
SCRUB_ENV = ("ACCELPACT_TEST_SKIP_REBIND", "ACCELPACT_TEST_FRONTIER_SKEW", "ACCELPACT_ENVELOPE",
             "ACCELPACT_QUALIFYING", "ACCELPACT_MASTER_ADDR", "ACCELPACT_MASTER_PORT", "ACCELPACT_CONTROL_PORT")


def plan_faults(start: int, n: int, stride: int, offset: int = 0) -> list[tuple[int, int]]:
    """(update, faulting rank) for ``n`` faults from update ``start``, one every ``stride`` updates (pure)."""
    return [(start + stride * k, FAULT_RANKS[(k + offset) % len(FAULT_RANKS)]) for k in range(n)]


def floor_positions(faults: list[tuple[int, int]], group_of: Callable[[int], Any]) -> list[str]:
    """Where each repair's floor samples run, ``"before"`` or ``"after"`` the faulted update (pure).

    The order is ABBA per replication group (``group_of(faulting rank)``): a group's repairs 0 and 3 (mod 4)
    have their floor before, 1 and 2 after.  With ``FAULT_RANKS`` rotating over both groups, each group and
    each faulting rank gets both positions equally often over every 8 repairs: a floor taken always before
    one group's repairs and always after the other's would carry the groups' difference into the ratio."""
    seen: dict[Any, int] = {}
    out = []
    for _step, rank in faults:
        g = group_of(rank)
        j = seen.get(g, 0)
        seen[g] = j + 1
        out.append("before" if j % 4 in FLOOR_FIRST else "after")
    return out


def fault_spec(update: int, rank: int) -> str:
    """The job file's fault that makes ``rank`` withhold its part of the guard's boundary all-reduce in ``update``.

    ``boundary:STEP:RANK`` names the boundary after update STEP, which the guard checks at the decision of
    the next update (``BoundaryGuard.decide``: ``injector.fires("boundary", step - 1)``)."""
    return f"boundary:{update - 1}:{rank}"


def warm_fault(plan: dict[str, Any]) -> tuple[int, int]:
    """The untimed repair right after the warm-up updates (the repair's code warmed, and the vote's arrivals
    measured for the first repair's floor samples): the update after them, the last of ``FAULT_RANKS``."""
    return plan["warmup"] + 1, FAULT_RANKS[-1]


def main_faults(plan: dict[str, Any]) -> list[tuple[int, int]]:
    """The faults of the repairs-vs-floor scenario: one every other update after the warm-up repair."""
    return plan_faults(plan["warmup"] + 3, plan["repairs"], 2)


def write_job(plan: dict[str, Any], path: Path) -> Path:
    """The reference job file on 2 x 2 ranks, FSDP1 on the device mesh, no snapshots, the plan's timeouts,
    the faults of the first scenario (the sweep's are set per model on the rank), the plan in ``params.bench``."""
    from benchmarks.parts.workload import entry_of, write_job as write

    faults = [fault_spec(s, r) for s, r in [warm_fault(plan), *main_faults(plan)]]
    return write(path, {
        "steps": 100_000, "log_every": 100_000, "checkpoint.every_steps": 0, "topology.nodes": NODES,
        "topology.ranks_per_node": RPN, "timeouts.collective_s": plan["collective_s"],
        "timeouts.control_s": plan["control_s"], "timeouts.startup_s": plan["startup_s"], "faults": faults,
    }, entry=entry_of("repair_entry"), params={"fsdp": "fsdp1", "mesh": "device_mesh", "bench": plan})


def run_job(plan: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    """Start the four ranks, echo rank 0's progress; the ranks' results (``RuntimeError`` with the failing
    ranks' logs otherwise).  Each rank stops itself at the plan's deadline (``harness.guard_rank``)."""
    config = write_job(plan, workdir / "job.yaml")
    world = NODES * RPN
    done = lambda r: workdir / f"rank-{r}.json"  # noqa: E731
    t0 = time.monotonic()
    code = h.launch_job(config, workdir, extra_env={"OMP_NUM_THREADS": "1"}, scrub=SCRUB_ENV,
                        echo=h.LineFilter(("[bench]", "[accelpact] rank ")), job_id=f"bench-repair-{os.getpid()}")
    if code != 0 or not all(done(r).exists() for r in range(world)):
        why = (f"deadline of {plan['deadline_s']:.0f} s passed" if time.monotonic() - t0 > plan["deadline_s"]
               else f"the job exited with code {code}")
        raise RuntimeError(f"{why}; {h.failed_ranks(workdir, world, done)}")
    return [json.loads(done(r).read_text()) for r in range(world)]
