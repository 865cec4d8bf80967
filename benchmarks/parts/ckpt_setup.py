"""Checkpoint benchmark, set-up: the modes, the model, the schedule of segments, the job file, the launch and
the machine watch while the job runs (``benchmarks/parts/ckpt.py``).

The schedule functions are pure; the ranks rebuild the schedule from the same plan (``ckpt_entry``, the
job's entry point).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h

MARK = "<!-- ckpt-bench -->"
MODES = ("none", "ours", "dcp_sync", "dcp_thread", "dcp_process", "dcp_stager", "dcp_stager_shm")
ASYNC_DCP = ("dcp_thread", "dcp_process", "dcp_stager", "dcp_stager_shm")
MODE_TEXT = {
    "none": "no snapshots (baseline)",
    "ours": "SnapshotClient + per-node daemons (as accelpact-run)",
    "dcp_sync": "dcp.save (synchronous)",
    "dcp_thread": "dcp.async_save, thread executor",
    "dcp_process": "dcp.async_save, process executor",
    "dcp_stager": "dcp.async_save + DefaultStager (async staging, no shm)",
    "dcp_stager_shm": "dcp.async_save + DefaultStager (async staging, shm)",
}

#: The job file's ``params`` that differ from the decoder example's: the model's shape (110M parameters),
#: FSDP1 on the device mesh, the optimizer's schedule (``--batch`` sets ``batch_per_rank``).
MODEL = {"layers": 12, "width": 768, "heads": 12, "vocab": 16384, "seq_len": 16, "dropout": 0.1,
         "fsdp": "fsdp1", "mesh": "device_mesh"}
TRAIN = {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 2}

# =========================================================================== the schedule (pure)


def build_schedule(plan: dict[str, Any]) -> dict[int, tuple[int, str, int]]:
    """``{update: (round, mode, position 1..L)}`` for the timed updates (pure); warm-up updates are absent."""
    sched: dict[int, tuple[int, str, int]] = {}
    length = segment_length(plan)
    step = plan["warmup"]
    for r, order in enumerate(plan["orders"]):
        for mode in order:
            for pos in range(1, length + 1):
                step += 1
                sched[step] = (r, mode, pos)
    return sched


def segment_length(plan: dict[str, Any]) -> int:
    """A segment: ``windows`` windows of K updates, each starting with a snapshot (``S x x`` for K=3)."""
    return plan["every"] * plan["windows"]


def is_snapshot(plan: dict[str, Any], mode: str, pos: int) -> bool:
    return mode != "none" and (pos - 1) % plan["every"] == 0


def total_steps(plan: dict[str, Any]) -> int:
    return plan["warmup"] + sum(len(o) for o in plan["orders"]) * segment_length(plan)


def rotated_orders(modes: tuple[str, ...] | list[str], rounds: int) -> list[list[str]]:
    """Round r runs the modes rotated by r (every mode visits several positions), with ``none`` twice,
    half a round apart, so that one burst of load from elsewhere does not own a round's baseline."""
    orders = []
    for r in range(rounds):
        order = h.rotate(modes, r)
        if "none" in order and len(order) > 2:
            i = order.index("none")
            order.insert((i + len(order) // 2 + 1) % (len(order) + 1), "none")
        orders.append(order)
    return orders


# =========================================================================== the job


def write_config(path: Path, plan: dict[str, Any], model: dict[str, Any], batch: int) -> None:
    """The decoder example's job file with the benchmark's entry point, the model's size and the plan in
    ``params``, 2 x 2 ranks, long timeouts.  ``checkpoint.every_steps`` > 0 makes the launcher start the
    per-node daemons; it is past the last update, so the run's client never snapshots by itself (the
    schedule in ``ckpt_entry`` does)."""
    from benchmarks.parts.workload import entry_of, write_job

    steps = total_steps(plan)
    write_job(path, {
        "name": "bench-ckpt", "seed": 7, "steps": steps, "log_every": 10_000, "faults": [],
        "topology": {"nodes": 2, "ranks_per_node": 2, "threads_per_rank": 1},
        "checkpoint": {"every_steps": steps + 1, "keep_last": 2, "milestone_every": 0},
        "timeouts": {"collective_s": 300, "control_s": 900, "startup_s": 900, "shutdown_s": 30},
    }, entry=entry_of("ckpt_entry"), params={**model, **TRAIN, "batch_per_rank": batch, "bench": plan})


def launch(config: Path, run_dir: Path) -> int:
    """The job as ``accelpact-run`` starts it (``harness.launch_job``: the library's launcher, ranks and
    per-node daemons); its entry point (``ckpt_entry``) runs the schedule."""
    # MASTER_ADDR: read only by DCP's process executor.  Memory: 4 ranks, 2 daemons, the ranks' staging slots and
    # DCP's process executor's copies share 23.5 GiB here; the segments of one mode must not hold another's.  A
    # rank that made both its staging slots ready ahead (one more 0.62 GiB slot each, kept through every
    # segment) ran round 3's ``dcp_process`` segment out of memory on 2026-12-03 (MemAvailable 0.03-0.2 GiB, a rank
    # OOM-killed); with one slot per rank while the daemon keeps up, MemAvailable stayed above 2 GiB
    return h.launch_job(config, run_dir, extra_env={"MASTER_ADDR": "127.0.0.1"})


# =========================================================================== the machine while it runs


class MachineWatch:
    """Samples MemAvailable and the 1-minute load average every ``period_s`` on a daemon thread."""

    def __init__(self, tag: str, period_s: float = 2.0) -> None:
        self.tag = tag
        self.period_s = period_s
        self.samples: list[tuple[float, float | None, float]] = []
        self.rss: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="bench-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            avail = None
            try:
                with open("/proc/meminfo", encoding="utf-8") as fh:
                    for line in fh:
                        if line.startswith("MemAvailable"):
                            avail = int(line.split()[1]) / 1024 / 1024
                            break
            except OSError:
                pass
            self.samples.append((time.time(), avail, os.getloadavg()[0]))
            self.rss.append((time.time(), process_rss_gib(self.tag)))
            self._stop.wait(self.period_s)

    def __enter__(self) -> MachineWatch:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=5)

    def summary(self) -> dict[str, Any]:
        avail = [a for _t, a, _l in self.samples if a is not None]
        load = [l for _t, _a, l in self.samples]
        return {"min_mem_available_gib": min(avail) if avail else None,
                "load1_median": h.med(load), "load1_max": max(load) if load else None,
                "peak_rss_gib": {k: max(r.get(k, 0.0) for _t, r in self.rss) for k in RSS_KINDS} if self.rss else {},
                "samples": [[round(t, 1), None if a is None else round(a, 2), round(l, 2), r]
                            for (t, a, l), (_t, r) in zip(self.samples, self.rss)]}


RSS_KINDS = ("ranks", "daemons", "dcp_children")
RANK_MARK = "accelpact_slurm.cli.worker"  # the rank command of launch_local (plain processes)
DAEMON_MARK = "accelpact_slurm.cli.ckptd"


def process_rss_gib(tag: str) -> dict[str, float]:
    """Resident memory (GiB, RSS incl. shared pages) of this benchmark's processes, summed by kind.

    Ranks and daemons carry ``tag`` (the run directory) on their command line; DCP's checkpoint processes
    are recognised as spawned children of a rank.
    """
    out = dict.fromkeys(RSS_KINDS, 0.0)
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
                st = {ln.split(":", 1)[0]: ln.split(":", 1)[1].strip() for ln in fh if ":" in ln}
            procs[pid] = (cmd, int(st.get("PPid", "0")), int((st.get("VmRSS") or "0 kB").split()[0]))
        except (OSError, ValueError):
            continue
    ranks = {int(p) for p, (cmd, _pp, _r) in procs.items() if RANK_MARK in cmd and tag in cmd}
    for cmd, ppid, rss in procs.values():
        if RANK_MARK in cmd and tag in cmd:
            kind = "ranks"
        elif DAEMON_MARK in cmd and tag in cmd:
            kind = "daemons"
        elif "multiprocessing.spawn" in cmd and ppid in ranks:
            kind = "dcp_children"
        else:
            continue
        out[kind] += rss / 1024 / 1024
    return {k: round(v, 2) for k, v in out.items()}
