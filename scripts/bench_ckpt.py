#!/usr/bin/env python3
"""Checkpoint-service acceptance benchmark: our snapshot path against stock DCP, side by side in one job.

Part 1 (training-step cost).  One job on the embedded default (2 emulated nodes x 2 ranks, FSDP1
HYBRID_SHARD on the 2-D device mesh over Gloo, a >= 100M-parameter ``CausalDecoder`` with AdamW).  Its
ranks run the real ``accelpact-run`` rank path (``accelpact_slurm.cli.run.main`` -> ``job.run_rank``:
guard, commit, events) and the per-node checkpoint daemons are started as ``accelpact-run`` starts them.
The only difference is a benchmark hook (environment variable ``ACCELPACT_BENCH_CKPT_PLAN``, implemented
here, not in job.py): the ``SnapshotClient`` that ``run_rank`` builds is replaced by a subclass whose
``after_commit`` follows a schedule.  After a few warm-up updates, every round runs one *segment* per
mode (``none`` twice, half a round apart), in an order rotated from round to round:

    none           no snapshots (the baseline)
    ours           SnapshotClient.snapshot() (boxes copied into a /dev/shm slot + daemon write/verify)
    dcp_sync       dcp.save, every rank its shards, into a per-run directory
    dcp_thread     dcp.async_save, thread executor
    dcp_process    dcp.async_save, async_checkpointer_type=PROCESS
    dcp_stager     dcp.async_save + DefaultStager(StagingOptions(False, False, True, False))
    dcp_stager_shm dcp.async_save + DefaultStager(StagingOptions(False, True, True, False))

A segment is ``--windows`` windows of K updates; the first update of each window takes a snapshot
(``S x x`` for K=3: one period of "a snapshot every K updates", with the K-1 updates that run while the
snapshot is written in the background).  After its last update the segment is drained *outside* the
timed updates (async futures, our daemons' write + verification, ``malloc_trim``), so the next segment
starts clean; how long that drain took is reported as the background work left over.  DefaultStagers
are closed and DCP's checkpoint process stopped between segments too: on this 24 GiB machine 4 ranks + 2
daemons otherwise ran out of memory.  Step time = time between the ends of two consecutive
``after_commit`` calls on rank 0 (the ranks are in lock step), so it includes the blocking part.
DefaultStager stages in a background thread while training goes on: for a consistent snapshot the
next ``optimizer.step`` first waits for staging to finish (counted in that step).

Part 2 (write bandwidth).  One node's snapshot (the same model + AdamW, two ranks' shards) staged as
the client stages it, then the daemon's write path (``staging.read_descriptor`` + ``map_slot`` x2 +
``writer.write_snapshot``: boxes as DCP chunks, fsync overlapped with checksums, manifest, rename) against ``dd if=/dev/zero bs=4M conv=fsync`` of
the same size on the same filesystem, paired and interleaved.

Every figure is a ratio against a baseline measured in the same run (paired by round), reported as the
median of the paired ratios with min-max; absolute times are printed beside them for reference only.

Output: ``benchmarks/results/<date>-ckpt.json`` and the block between ``<!-- ckpt-bench -->`` markers in
``docs/benchmarks.md`` (other blocks are kept).

Usage: .venv/bin/python scripts/bench_ckpt.py [--rounds 3] [--every 3] [--windows 1] [--bw-pairs 6]
       .venv/bin/python scripts/bench_ckpt.py --render benchmarks/results/<date>-ckpt.json   (markdown only)

About 7 minutes here (110M parameters, 3 rounds, every mode but dcp_stager_shm; longer when the machine
is busy).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PLAN_VAR = "ACCELPACT_BENCH_CKPT_PLAN"
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

MODEL = {"layers": 12, "width": 768, "heads": 12, "vocab": 16384, "seq_len": 16, "dropout": 0.1,
         "fsdp": "fsdp1", "mesh": "device_mesh"}


# =========================================================================== the rank side (worker)


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
    modes = list(modes)
    orders = []
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        if "none" in order and len(order) > 2:
            i = order.index("none")
            order.insert((i + len(order) // 2 + 1) % (len(order) + 1), "none")
        orders.append(order)
    return orders


def _timed(fn, sink: dict[str, float], key: str):
    """Wrap ``fn`` so that its outermost calls add their duration to ``sink[key]`` (recursion counted once)."""
    depth = threading.local()

    def wrapper(*a, **kw):
        level = getattr(depth, "n", 0)
        depth.n = level + 1
        t = time.monotonic()
        try:
            return fn(*a, **kw)
        finally:
            depth.n = level
            if level == 0:
                sink[key] = sink.get(key, 0.0) + time.monotonic() - t
    return wrapper


def make_bench_client():
    """The SnapshotClient subclass the hook installs (built lazily: the module stays import-light)."""
    from ckpt_service.client import SnapshotClient

    parts: dict[str, float] = {}

    class BenchClient(SnapshotClient):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.plan = json.loads(os.environ[PLAN_VAR])
            self.sched = build_schedule(self.plan)
            self.length = segment_length(self.plan)
            self.records: list[dict[str, Any]] = []
            self.segments: list[dict[str, Any]] = []
            self.extra: dict[str, Any] = {}
            self.t_prev: float | None = None
            self.parts = parts
            self.futures: list[tuple[int, Any, dict[str, Any]]] = []
            self.ours_steps: list[int] = []
            self.stagers: dict[str, Any] = {}
            self.staging_future = None
            self.staging_wait = 0.0
            orig_step = self.trainer.optimizer_step

            def optimizer_step() -> None:  # DefaultStager: never mutate what is still being copied
                if self.staging_future is not None:
                    t = time.monotonic()
                    self.staging_future.result()
                    self.staging_wait += time.monotonic() - t
                    self.staging_future = None
                orig_step()

            self.trainer.optimizer_step = optimizer_step
            self.out = os.path.join(self.plan["out"], f"rank-{self.rt.rank}.json")

        # -------------------------------------------------------------- the schedule
        def after_commit(self) -> None:
            step = self.trainer.progress.step
            now = time.monotonic()
            entry = self.sched.get(step)
            if entry is None:  # warm-up
                self.records.append({"step": step, "mode": "warmup",
                                     "step_s": None if self.t_prev is None else now - self.t_prev})
                if step == self.plan["warmup"]:
                    if "ours" in self.plan["modes"]:
                        # the first snapshot of a start creates the slot (first touch of its pages) and
                        # carries the live fixed-batch loss that proves the capture: a one-off per start,
                        # taken here, untimed, and reported apart; the timed snapshots are the steady state
                        self.snapshot()
                        self.extra["ours_first_snapshot"] = dict(self.last_parts)
                        self.extra["ours_first_snapshot"]["state"] = self.wait(step, self.cfg.timeouts.startup_s)
                    self._prepare_next(step)
                    self.rt.control.barrier("bench-start", timeout_s=600)
                self.t_prev = time.monotonic()
                return
            rnd, mode, pos = entry
            snap = is_snapshot(self.plan, mode, pos)
            self.parts.clear()
            info: dict[str, Any] = {}
            block = 0.0
            wall = time.time()
            if snap:
                t = time.monotonic()
                self._snap(mode, step, info)
                block = time.monotonic() - t
            end = time.monotonic()
            self.records.append({
                "step": step, "round": rnd, "mode": mode, "pos": pos, "snap": snap, "wall": wall,
                "step_s": end - self.t_prev, "block_s": block, "staging_wait_s": self.staging_wait,
                "parts": dict(self.parts), **info,
            })
            self.staging_wait = 0.0
            if pos == self.length:
                self._drain(rnd, mode, step)
            self.t_prev = time.monotonic()

        def _path(self, mode: str, step: int) -> str:
            return os.path.join(self.plan["dcp_dir"], mode, f"step-{step:06d}")

        def _state_dict(self) -> dict[str, Any]:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            t = time.monotonic()
            msd, osd = get_state_dict(self.trainer.model, self.trainer.optimizer)
            self.parts["state_dict"] = time.monotonic() - t
            return {"model": msd, "optim": osd}

        def _wait_prev(self) -> None:
            t = time.monotonic()
            for _step, fut, _rec in self.futures:
                fut.result()
            self.parts["wait_prev"] = time.monotonic() - t

        def _snap(self, mode: str, step: int, info: dict[str, Any]) -> None:
            import torch.distributed.checkpoint as dcp

            if mode == "ours":
                self.snapshot()  # SnapshotClient times its own pieces (last_parts)
                self.parts.update({k: v for k, v in self.last_parts.items()
                                   if isinstance(v, float) and k != "total"})
                info["ours_bytes"] = self.last_parts.get("bytes")
                info["ours_new_slot"] = self.last_parts.get("new_slot")
                info["ours_source"] = self.last_parts.get("source")
                self.ours_steps.append(step)
                return
            if mode == "dcp_sync":
                dcp.save(self._state_dict(), checkpoint_id=self._path(mode, step))
                return
            self._wait_prev()
            sd = self._state_dict()
            t0 = time.monotonic()
            rec: dict[str, Any] = {}
            if mode == "dcp_thread":
                fut = dcp.async_save(sd, checkpoint_id=self._path(mode, step))
            elif mode == "dcp_process":
                from torch.distributed.checkpoint.state_dict_saver import (
                    AsyncCheckpointerType,
                )

                fut = dcp.async_save(sd, checkpoint_id=self._path(mode, step),
                                     async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            else:
                resp = dcp.async_save(sd, checkpoint_id=self._path(mode, step), async_stager=self._stager(mode))
                self.staging_future = resp.staging_completion
                resp.staging_completion.add_done_callback(
                    lambda _f, rec=rec, t0=t0: rec.__setitem__("staged_after_s", time.monotonic() - t0))
                fut = resp.upload_completion
            fut.add_done_callback(lambda _f, rec=rec, t0=t0: rec.__setitem__("written_after_s", time.monotonic() - t0))
            self.futures.append((step, fut, rec))

        def _stager(self, mode: str):
            from torch.distributed.checkpoint.staging import (
                DefaultStager,
                StagingOptions,
            )

            if mode not in self.stagers:
                self.stagers[mode] = DefaultStager(StagingOptions(
                    use_pinned_memory=False, use_shared_memory=(mode == "dcp_stager_shm"),
                    use_async_staging=True, use_non_blocking_copy=False))
            return self.stagers[mode]

        def _prepare_next(self, step: int) -> None:
            """Untimed: start DCP's checkpoint process before a ``dcp_process`` segment, stop it after one.

            The process keeps the last staged copy resident (2.3 GiB over 4 ranks here) and this machine has
            no room for it next to our daemons, so it lives only for its own segments; its start-up is
            measured here and reported apart (a long job pays it once).
            """
            cur, nxt = self.sched.get(step), self.sched.get(step + 1)
            if cur is not None and cur[1] == "dcp_process" and (nxt is None or nxt[1] != "dcp_process"):
                from torch.distributed.checkpoint import _async_process_executor as ape

                proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
                if proc is not None:
                    proc.__del__()  # sends TERMINATE and joins (what interpreter exit would do)
                    del proc
            if nxt is not None and nxt[1] == "dcp_process" and (cur is None or cur[1] != "dcp_process"):
                self._warm_up_dcp()

        def _warm_up_dcp(self) -> None:
            """Start DCP's checkpoint process (a tiny state dict); the first-call cost is reported apart."""
            import torch
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict_saver import (
                AsyncCheckpointerType,
            )

            t = time.monotonic()
            fut = dcp.async_save({"x": torch.zeros(4)}, checkpoint_id=os.path.join(self.plan["dcp_dir"], "warm-up"),
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            call = time.monotonic() - t
            fut.result()
            self.extra.setdefault("dcp_process_start", []).append({"call_s": call, "done_s": time.monotonic() - t})

        def _drain(self, rnd: int, mode: str, step: int) -> None:
            t = time.monotonic()
            states = {}
            for _s, fut, _rec in self.futures:
                fut.result()
            if self.staging_future is not None:
                self.staging_future.result()
                self.staging_future = None
            if self.ours_steps:
                for s in self.ours_steps:
                    states[s] = self.wait(s, self.cfg.timeouts.startup_s)
            drained = time.monotonic() - t
            self.rt.control.barrier("bench-drained", timeout_s=600)
            if self.rt.rank == 0:
                shutil.rmtree(os.path.join(self.plan["dcp_dir"], mode), ignore_errors=True)
            self.rt.control.barrier("bench-cleaned", timeout_s=600)
            self.segments.append({
                "round": rnd, "mode": mode, "last_step": step, "drain_s": drained, "ours_states": states,
                "dcp_bg": {str(s): rec for s, _f, rec in self.futures},
            })
            self.futures, self.ours_steps = [], []
            for stager in self.stagers.values():  # a live stager keeps its last staged copy (and caches) resident
                stager.close()
            self.stagers.clear()
            self._prepare_next(step)
            release_free_memory()
            self.rt.control.barrier("bench-trimmed", timeout_s=600)
            self._dump()
            if self.rt.rank == 0:
                print(f"[bench] {time.strftime('%H:%M:%S')} round {rnd + 1} {mode:<15} done at update {step}; "
                      f"drained in {drained:.1f} s", flush=True)

        def _dump(self) -> None:
            tmp = self.out + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump({"rank": self.rt.rank, "records": self.records, "segments": self.segments,
                           "extra": self.extra}, fh, indent=1, default=str)
            os.replace(tmp, self.out)

        def close(self) -> None:
            super().close()
            for s in self.stagers.values():
                s.close()
            self._dump()

    return BenchClient


def release_free_memory() -> None:
    """``malloc_trim(0)``: hand freed heap pages back to the kernel between segments (outside the timed updates).

    glibc keeps freed buffers below its mmap threshold (up to 32 MiB) in its heaps, so every rank would keep
    the high-water mark of all the modes' copies resident and 4 ranks + 2 daemons run out of 24 GiB
    (seen: OOM kill during the first round).  A fixed ``MALLOC_MMAP_THRESHOLD_`` avoids that too but made
    every update 20-50% slower (page faults), so it is not used.
    """
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def worker_main(config: str, run_dir: str) -> int:
    """One rank: the real accelpact-run rank path with the benchmark's SnapshotClient."""
    import ckpt_service.client as client_mod

    client_mod.SnapshotClient = make_bench_client()  # job.run_rank imports it at call time
    from accelpact_slurm.cli.run import main

    return main([config, "--run-dir", run_dir])


# =========================================================================== the launcher side


def write_config(path: Path, plan: dict[str, Any], model: dict[str, Any], batch: int) -> None:
    import yaml

    cfg = {
        "name": "bench-ckpt", "seed": 7, "steps": total_steps(plan),
        "topology": {"nodes": 2, "ranks_per_node": 2},
        "model": model,
        "train": {"batch_per_rank": batch, "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 2,
                  "log_every": 10_000, "threads_per_rank": 1},
        # every_steps > 0 makes the launcher start the daemons; the benchmark's client decides when to snapshot
        "checkpoint": {"every_steps": plan["every"], "keep_last": 2},
        "timeouts": {"collective_s": 300, "control_s": 900, "startup_s": 900, "shutdown_s": 30},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


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
                "load1_median": _med(load), "load1_max": max(load) if load else None,
                "peak_rss_gib": {k: max(r.get(k, 0.0) for _t, r in self.rss) for k in RSS_KINDS} if self.rss else {},
                "samples": [[round(t, 1), None if a is None else round(a, 2), round(l, 2), r]
                            for (t, a, l), (_t, r) in zip(self.samples, self.rss)]}


RSS_KINDS = ("ranks", "daemons", "dcp_children", "replay")


def process_rss_gib(tag: str) -> dict[str, float]:
    """Resident memory (GiB, RSS incl. shared pages) of this benchmark's processes, summed by kind.

    Ranks, daemons and replay checks carry ``tag`` (the run directory) on their command line; DCP's
    checkpoint processes are recognised as spawned children of a rank.
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
    ranks = {int(p) for p, (cmd, _pp, _r) in procs.items() if "--worker" in cmd and tag in cmd}
    for cmd, ppid, rss in procs.values():
        if "--worker" in cmd and tag in cmd:
            kind = "ranks"
        elif "accelpact_slurm.cli.ckptd" in cmd and tag in cmd:
            kind = "daemons"
        elif "workload.replay" in cmd and tag in cmd:
            kind = "replay"
        elif "multiprocessing.spawn" in cmd and ppid in ranks:
            kind = "dcp_children"
        else:
            continue
        out[kind] += rss / 1024 / 1024
    return {k: round(v, 2) for k, v in out.items()}


def launch(config: Path, run_dir: Path, plan: dict[str, Any]) -> int:
    """``launcher.launch_local`` with the benchmark worker as the rank command (same env, daemons, supervision)."""
    from accelpact_slurm.launch import local as launcher
    from accelpact_slurm.launch.daemons import start_local_daemons, stop_daemons
    from accelpact_slurm.core.config import load_config
    from accelpact_slurm.slurm.env import emulated_environ

    cfg = load_config(config)
    job_id = f"bench-{os.getpid()}"
    environ = dict(os.environ)
    environ[PLAN_VAR] = json.dumps(plan)
    environ["PYTHONPATH"] = str(REPO) + (os.pathsep + environ["PYTHONPATH"] if environ.get("PYTHONPATH") else "")
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    data_port = launcher.free_port()
    control_port = launcher.free_port()
    while control_port == data_port:
        control_port = launcher.free_port()
    daemons = start_local_daemons(str(config), cfg, str(run_dir), job_id, environ)
    ranks = []
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(config), "--run-dir", str(run_dir)]
    try:
        for rank in range(cfg.world_size):
            env = dict(environ)
            env.update(emulated_environ(job_id, rank, cfg.topology.nodes, cfg.topology.ranks_per_node))
            env.update({"ACCELPACT_MASTER_ADDR": "127.0.0.1", "ACCELPACT_MASTER_PORT": str(data_port),
                        "ACCELPACT_CONTROL_PORT": str(control_port), "ACCELPACT_EMULATED": "1",
                        "PYTHONUNBUFFERED": "1",
                        "MASTER_ADDR": "127.0.0.1"})  # read only by DCP's process executor
            log_path = str(logs / f"rank-{rank}.log")
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
            rp = launcher.RankProcess(rank, proc, log_path)
            rp.pump = threading.Thread(target=launcher._pump, args=(proc.stdout, log_path,
                                                                     sys.stdout if rank == 0 else None),
                                       daemon=True)
            rp.pump.start()
            ranks.append(rp)
        return launcher._supervise(ranks, cfg.timeouts.shutdown_s, sys.stdout)
    finally:
        stop_daemons(daemons)


# =========================================================================== analysis (pure)


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize_steps(records: list[dict[str, Any]], segments: list[dict[str, Any]],
                    plan: dict[str, Any]) -> dict[str, Any]:
    """Per mode: paired (by round) step-time ratios vs none and added time per snapshot (pure)."""
    drains = {(s["round"], s["mode"]): s["drain_s"] for s in segments}
    timed = [r for r in records if r.get("mode") not in (None, "warmup")]
    by: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in timed:
        by.setdefault((r["round"], r["mode"]), []).append(r)
    rounds = sorted({k[0] for k in by})
    modes = [m for m in MODES if any(k[1] == m for k in by)]
    out: dict[str, Any] = {}
    for m in modes:
        per_round = []
        for rnd in rounds:
            seg, base = by.get((rnd, m)), by.get((rnd, "none"))
            if not seg or not base:
                continue
            base_all = _mean([r["step_s"] for r in base])  # both none segments of the round
            snaps = [r for r in seg if r["snap"]]
            # a DefaultStager snapshot also costs the wait it causes before the next optimizer step
            nxt = {r["step"]: r for r in seg}
            charges = [r["step_s"] + (nxt[r["step"] + 1]["staging_wait_s"] if r["step"] + 1 in nxt else 0.0)
                       for r in snaps]
            per_round.append({
                "round": rnd,
                "baseline_step_s": base_all,
                "mean_step_s": _mean([r["step_s"] for r in seg]),
                "ratio": _mean([r["step_s"] for r in seg]) / base_all,
                "others_ratio": (_mean([r["step_s"] for r in seg if not r["snap"]])
                                 / _mean([r["step_s"] for r in base if not is_snapshot(plan, m, r["pos"])])
                                 if m != "none" else 1.0),
                "drain_s": drains.get((rnd, m)),
                "snapshot_step_s": _mean([r["step_s"] for r in snaps]),
                "added_per_snapshot_s": (_mean(charges) - base_all) if snaps else None,
                "blocking_s": _mean([r["block_s"] + (nxt[r["step"] + 1]["staging_wait_s"]
                                                     if r["step"] + 1 in nxt else 0.0) for r in snaps]) if snaps else None,
                "parts": _mean_parts([r["parts"] for r in snaps]),
            })
        out[m] = {"rounds": per_round, **_spread(per_round)}
    return out


def _mean_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for p in parts for k in p})
    return {k: sum(p.get(k, 0.0) for p in parts) / len(parts) for k in keys} if parts else {}


def _spread(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for key in ("ratio", "others_ratio", "drain_s", "added_per_snapshot_s", "blocking_s", "snapshot_step_s",
                "baseline_step_s", "mean_step_s"):
        xs = [p[key] for p in per_round if p.get(key) is not None]
        res[key] = {"median": _med(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None, "n": len(xs)}
    return res


def daemon_latencies(events_path: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds from rank 0's snapshot call to each node daemon's committed / verified event."""
    calls = {r["step"]: r["wall"] for r in records if r.get("mode") == "ours" and r.get("snap")}
    out: dict[str, list[float]] = {"committed": [], "verified": []}
    sizes = []
    parts: dict[str, list[float]] = {}
    if not events_path.exists():
        return {}
    for line in events_path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") != "checkpoint" or ev.get("step") not in calls:
            continue
        st = ev.get("state")
        if st in out:
            out[st].append(ev["ts"] - calls[ev["step"]])
        if st == "committed" and ev.get("size_bytes"):
            sizes.append(ev["size_bytes"])
        if st == "committed":
            for k in ("reference_s", "dcp_save_s", "fsync_hash_s"):
                if ev.get(k) is not None:
                    parts.setdefault(k, []).append(ev[k])
    res = {k: {"median": _med(v), "min": min(v) if v else None, "max": max(v) if v else None, "n": len(v)}
           for k, v in out.items()}
    res["node_snapshot_bytes"] = _med(sizes)
    res["writer_parts_s"] = {k: _med(v) for k, v in parts.items()}
    return res


def goals(steps: dict[str, Any], bw: dict[str, Any]) -> dict[str, Any]:
    ours = steps.get("ours", {})
    best_mode, best = None, None
    for m in ASYNC_DCP:
        v = steps.get(m, {}).get("added_per_snapshot_s", {}).get("median")
        if v is not None and (best is None or v < best):
            best_mode, best = m, v
    ours_added = ours.get("added_per_snapshot_s", {}).get("median")
    g1 = None
    if ours_added is not None and best is not None:
        g1 = ours_added <= 0.5 * best
    best_blk_mode, best_blk = None, None
    for m in ASYNC_DCP:
        v = steps.get(m, {}).get("blocking_s", {}).get("median")
        if v is not None and (best_blk is None or v < best_blk):
            best_blk_mode, best_blk = m, v
    ours_blk = ours.get("blocking_s", {}).get("median")
    ratio = bw.get("ratio_full", {}).get("median")
    return {
        "snapshot_cost": {
            "goal": "added time per snapshot <= 0.5 x DCP's best async mode",
            "ours_added_s": ours_added, "best_async_mode": best_mode, "best_async_added_s": best,
            "limit_s": None if best is None else 0.5 * best, "pass": g1,
            "blocking_check": {"ours_blocking_s": ours_blk, "best_async_mode": best_blk_mode,
                               "best_async_blocking_s": best_blk,
                               "pass": None if ours_blk is None or best_blk is None else ours_blk <= 0.5 * best_blk},
        },
        "write_bandwidth": {"goal": "daemon write bandwidth >= 0.9 x dd conv=fsync", "median_ratio": ratio,
                            "pass": None if ratio is None else ratio >= 0.9},
    }


# =========================================================================== part 2: write bandwidth


def node_descs(model_cfg: dict[str, Any], stage_root: str, step: int, ranks: int = 2,
               seed: int = 0) -> tuple[list[dict[str, Any]], list[Any], int]:
    """One node's staged state as the client stages it: ``ranks`` ranks, each holding an FSDP1-like 1-D
    range (cut inside rows) of every parameter and of both AdamW moments, copied into its slot, plus its
    descriptor.  Returns (descriptors, slots, bytes)."""
    import base64

    import torch

    from accelpact_slurm.core.config import ModelConfig
    from accelpact_slurm.workload.model import CausalDecoder
    from ckpt_service import staging
    from ckpt_service.capture import Box, Entry, Plan, range_boxes

    torch.manual_seed(seed)
    model = CausalDecoder(ModelConfig(**model_cfg))
    full = {n: p.detach() for n, p in model.named_parameters()}
    moments = {"exp_avg": {n: torch.randn_like(p) * 1e-3 for n, p in full.items()},
               "exp_avg_sq": {n: torch.rand_like(p) * 1e-6 for n, p in full.items()}}
    rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    meta = {"job_id": "bench", "config_digest": "0" * 64, "config": {}, "world_size": 4,
            "eval": {"batch_size": 4, "live_loss": 0.0},
            "extra": {"step": 10, "cursor": 40, "losses": [1.0] * 10, "scheduler": {},
                      "rng": {str(r): rng for r in range(4)}}}
    descs, slots, total = [], [], 0
    for lr in range(ranks):
        entries = []
        for n, t in full.items():
            numel = t.numel()
            lo, hi = numel * lr // ranks, numel * (lr + 1) // ranks
            cuts = range_boxes(list(t.shape), lo, hi)
            for key, src in [(("model", n), t)] + [(("optim", "state", n, k), moments[k][n]) for k in moments]:
                flat = src.reshape(-1)
                entries.append(Entry(key, list(t.shape), t.dtype,
                                     [Box(list(o), list(sz), flat[f:f + math.prod(sz)]) for o, sz, f in cuts]))
        plain = {"model": {}, "optim": {"state": {n: {"step": torch.tensor(10.0)} for n in full},
                                        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8,
                                                          "weight_decay": 0.01, "params": sorted(full)}]}}
        plan = Plan(entries, plain, "bench")
        slot = staging.Slot(staging.slot_path(stage_root, lr, 0))
        nbytes = plan.layout()
        slot.ensure(nbytes)
        plan.copy_into(slot.buf)
        total += nbytes
        desc = staging.write_descriptor(stage_root, step, lr, {
            "step": step, "rank": lr, "local_rank": lr, "meta": meta, "slot": slot.path, "slot_ino": slot.ino,
            "nbytes": nbytes, "entries": plan.describe(), "plain": plan.plain, "source": plan.source})
        descs.append(desc)
        slots.append(slot)
    return descs, slots, total


def bench_bandwidth(model_cfg: dict[str, Any], work: Path, pairs: int) -> dict[str, Any]:
    """Paired, interleaved: the daemon's write of one node's snapshot vs dd conv=fsync of the same size."""
    import gc
    import warnings

    from ckpt_service import staging, writer

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    stage_root = tempfile.mkdtemp(prefix="accelpact-bench-stage-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ndir = work / "bw-node"
    ndir.mkdir(parents=True, exist_ok=True)
    parts: dict[str, float] = {}
    orig = (writer.build_state, writer.fsync_and_hash)
    writer.build_state = _timed(writer.build_state, parts, "build_state")
    writer.fsync_and_hash = _timed(writer.fsync_and_hash, parts, "fsync_and_hash")
    rows = []
    try:
        for i in range(pairs):
            step = i + 1
            paths, slots, staged = node_descs(model_cfg, stage_root, step)
            os.sync()
            res: dict[str, Any] = {"pair": i}
            order = ("ours", "dd") if i % 2 == 0 else ("dd", "ours")
            for which in order:
                os.sync()  # both writes start with no dirty pages of the other
                if which == "ours":
                    parts.clear()
                    t = time.monotonic()
                    descs = []
                    for p in paths:  # what the daemon's writer thread does
                        d = staging.read_descriptor(p)
                        d["buf"] = staging.map_slot(d["slot"], d["slot_ino"], d["nbytes"])
                        descs.append(d)
                    t_map = time.monotonic() - t
                    _path, size = writer.write_snapshot(str(ndir), step, descs, node="bench")
                    total = time.monotonic() - t
                    del descs
                    gc.collect()
                    res.update({"ours_s": total, "ours_bytes": size, "map_s": t_map, **dict(parts)})
                    res["ours_write_only_s"] = (total - t_map - parts.get("build_state", 0)
                                                - parts.get("fsync_and_hash", 0))
                else:
                    size = res.get("ours_bytes") or staged
                    count = -(-size // (4 << 20))
                    f = ndir / "dd.bin"
                    t = time.monotonic()
                    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=4M", f"count={count}", "conv=fsync"],
                                   check=True, capture_output=True)
                    res["dd_s"] = time.monotonic() - t
                    res["dd_bytes"] = count * (4 << 20)
                    f.unlink()
            shutil.rmtree(ndir / f"step-{step:010d}", ignore_errors=True)
            staging.drop_step(stage_root, step)
            del slots
            gc.collect()
            os.sync()
            res["ours_GBps"] = res["ours_bytes"] / res["ours_s"] / 1e9
            res["dd_GBps"] = res["dd_bytes"] / res["dd_s"] / 1e9
            res["ratio_full"] = res["ours_GBps"] / res["dd_GBps"]
            rows.append(res)
            print(f"[bench] bandwidth pair {i + 1}/{pairs}: ours {res['ours_GBps']:.2f} GB/s, dd {res['dd_GBps']:.2f} "
                  f"GB/s, ratio {res['ratio_full']:.2f}", flush=True)
    finally:
        writer.build_state, writer.fsync_and_hash = orig
        shutil.rmtree(stage_root, ignore_errors=True)
        shutil.rmtree(ndir, ignore_errors=True)
    out: dict[str, Any] = {"pairs": rows, "filesystem": _fs_type(str(work))}
    for key in ("ratio_full", "ours_GBps", "dd_GBps"):
        xs = [r[key] for r in rows]
        out[key] = {"median": _med(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
    for key in ("map_s", "build_state", "ours_write_only_s", "fsync_and_hash", "ours_s", "dd_s"):
        out.setdefault("parts_median_s", {})[key] = _med([r.get(key, 0.0) for r in rows])
    return out


def _fs_type(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], check=False, capture_output=True, text=True, timeout=10).stdout.splitlines()
        f = out[-1].split()
        return f"{f[1]} ({f[0]}, mounted on {f[-1]})"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


# =========================================================================== report


def machine() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal"):
                    mem = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory_gib": mem, "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "loadavg_start": os.getloadavg()}


def param_count(model_cfg: dict[str, Any]) -> int:
    from accelpact_slurm.core.config import ModelConfig
    from accelpact_slurm.workload.model import CausalDecoder

    return sum(p.numel() for p in CausalDecoder(ModelConfig(**model_cfg)).parameters())


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _rng(d: dict[str, Any], fmt: str = "{:.2f}") -> str:
    if not d or d.get("median") is None:
        return "n/a"
    return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}–{fmt.format(d['max'])})"


def markdown(res: dict[str, Any]) -> str:
    m, p, st, bw, g = res["machine"], res["params"], res["steps"], res["bandwidth"], res["goals"]
    lines = [
        MARK,
        "## Checkpoint service: snapshot cost and write bandwidth",
        "",
        f"Written by `scripts/bench_ckpt.py` on {res['date']} (raw data: `{res['json']}`).",
        "",
        f"**Machine.** {m['cpus']} CPU cores ({m['cpu_model']}), {m['memory_gib']} GiB memory, shared and noisy "
        f"(load average at start {', '.join(f'{x:.1f}' for x in m['loadavg_start'])}); Python {m['python']}, torch "
        f"{m['torch']}; snapshots written to {bw.get('filesystem', 'unknown')}.",
        "",
        f"**What ran.** One job on the embedded default: 2 emulated nodes x 2 ranks, FSDP1 `HYBRID_SHARD` on the "
        f"2-D device mesh over Gloo, `CausalDecoder` with {p['layers']} layers, width {p['width']}, vocab "
        f"{p['vocab']}, seq_len {p['seq_len']} (**{res['param_count'] / 1e6:.1f}M parameters**; model + AdamW "
        f"= {res['state_bytes'] / 2**30:.2f} GiB per node copy), batch {res['batch']} per rank. The ranks run the "
        f"real `accelpact-run` rank path and the per-node daemons; a benchmark-only `SnapshotClient` subclass "
        f"picks the mode. {res['plan']['warmup']} warm-up updates, then {res['plan']['rounds']} round(s); each round "
        f"runs every mode for {res['plan']['every'] * res['plan']['windows']} updates, a snapshot in the first of "
        f"every K={res['plan']['every']} (order rotated per round), then drains outside the timed updates "
        f"(async writes, the daemons' write + verification). Between segments, untimed: DefaultStagers "
        f"are closed (a live one keeps its last staged copy), freed heap is returned (`malloc_trim`), DCP's "
        f"checkpoint process is started before and stopped after each `dcp_process` segment (start-up reported "
        f"below) — without these, 4 ranks + 2 daemons exceeded the 24 GiB here (OOM kills in two attempts); lowest "
        f"MemAvailable in this run {_f((res.get('machine_during_steps') or {}).get('min_mem_available_gib'))} GiB. "
        f"DefaultStager's copy runs while training goes on, so the next `optimizer.step` waits for it (counted; "
        f"it never had to wait more than "
        f"{max([r.get('staging_wait_s', 0.0) for r in res.get('raw', {}).get('records', [])] or [0.0]):.2f} s). "
        f"Whole benchmark: {_f((res.get('total_wall_s') or 0) / 60, '{:.1f}')} min. Ratios are "
        f"paired with the two `none` segments of the same round; figures are the median over rounds (min–max).",
        "",
        "- *step-time ratio* = mean update time over the mode's windows (a snapshot update and the K−1 updates "
        "that run while it is written) / mean `none` update time of the same round; *others* = the same for "
        "the updates without a snapshot only (background interference);",
        "- *added per snapshot* = mean time of the updates that took a snapshot (blocking part included; for "
        "DefaultStager plus the wait for staging before the next `optimizer.step`) − the round's mean `none` "
        "update time;",
        "- *blocking* = time the training loop spent inside the checkpoint call (plus that staging wait), measured "
        "directly — less noisy than the difference of update times;",
        "- *left over* = background work still running after the window's K updates (the drain), seconds.",
        "",
        "| mode | step-time ratio vs none | others | added per snapshot (s) | blocking (s) | left over (s) "
        "| mean update (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        s = st.get(mode)
        if not s:
            continue
        if mode == "none":
            lines.append(f"| none — {MODE_TEXT[mode]} | 1 | 1 | — | — | — | {_rng(s['mean_step_s'])} |")
            continue
        lines.append(f"| {mode} — {MODE_TEXT[mode]} | {_rng(s['ratio'])} | {_rng(s['others_ratio'])} "
                     f"| {_rng(s['added_per_snapshot_s'])} | {_rng(s['blocking_s'])} | {_rng(s['drain_s'], '{:.1f}')} "
                     f"| {_rng(s['mean_step_s'])} |")
    ours = st.get("ours", {})
    parts = _mean_parts([r["parts"] for r in ours.get("rounds", [])])
    if parts:
        rest = (ours.get("blocking_s", {}).get("median") or 0.0) - sum(v for k, v in parts.items() if "." not in k)
        lines += ["", "Where `ours` blocks (mean per snapshot, s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in parts.items()) + f", rest {max(rest, 0.0):.2f}. *wait_slot*: asking the "
            "daemon whether the slot to reuse is free (backpressure); *rng*: the RNG exchange over the control "
            "plane; *eval_loss*: the live fixed-batch forward, only until one snapshot proved the capture (the "
            "first of each start); *plan*: reading FSDP's flat-parameter shard info; *copy*: the memcpy into the "
            "shared-memory slot; *hand_over*: descriptor + message to the daemon. DCP writes one deduplicated "
            "copy per job; ours writes one complete copy per node (two here) and verifies each (checksums + "
            "replay) in the background."]
    dl = res.get("daemon_latency") or {}
    if dl.get("committed", {}).get("n"):
        wp = dl.get("writer_parts_s") or {}
        lines += [f"Daemon latency from the snapshot call (both nodes): committed after {_rng(dl['committed'], '{:.1f}')} s, "
                  f"verified (checksums + replay in a fresh process) after {_rng(dl['verified'], '{:.1f}')} s. "
                  "Inside the writer (medians): " + ", ".join(f"{k} {v:.2f}" for k, v in wp.items() if v is not None)
                  + " (reference = the fixed-batch forward on the staged weights)."]
    first = res.get("ours_first_snapshot")
    if first:
        lines += [f"The first `ours` snapshot of a start (taken untimed at the end of the warm-up, then waited for: "
                  f"{first.get('state')}) blocked {_f(first.get('total'))} s: it creates the shared-memory slot "
                  f"(first touch of its pages; copy {_f(first.get('copy'))} s) and carries the live fixed-batch "
                  f"loss ({_f(first.get('eval_loss'))} s) that proves the capture. A job pays this once per start."]
    fc = res.get("dcp_process_start") or []
    if fc:
        lines += [f"DCP process executor start (a tiny first save, untimed, before each `dcp_process` segment; the "
                  f"process is stopped after the segment for lack of memory): call "
                  f"{_med([f['call_s'] for f in fc]):.2f} s, done after {_med([f['done_s'] for f in fc]):.2f} s "
                  f"(medians of {len(fc)})."]
    lines += [
        "",
        f"**Write bandwidth** (one node's snapshot, {bw['pairs'][0]['ours_bytes'] / 2**30:.2f} "
        f"GiB; {len(bw['pairs'])} pairs, order alternated): the daemon's write path (map the two ranks' "
        "shared-memory slots, build the DCP state from their boxes, DCP save of every box as a chunk, fsync of "
        "every file overlapped with its SHA-256, manifest, rename; the reference forward pass, CPU work that "
        "the daemon runs before writing, is not part of it) vs `dd if=/dev/zero bs=4M conv=fsync` of the same "
        "size on the same filesystem.",
        "",
        "| | median (min–max) |",
        "|---|---|",
        f"| ours / dd, whole write path | {_rng(bw['ratio_full'])} |",
        f"| ours, GB/s (absolute, this run only) | {_rng(bw['ours_GBps'])} |",
        f"| dd, GB/s (absolute, this run only) | {_rng(bw['dd_GBps'])} |",
        "",
        "Median seconds per write: " + ", ".join(f"{k} {v:.2f}" for k, v in bw["parts_median_s"].items()) + ".",
        *order_effect_lines(bw),
        "",
        "**Goals.**",
        "",
    ]
    g1, g2 = g["snapshot_cost"], g["write_bandwidth"]
    verdict = {True: "**PASS**", False: "**FAIL**", None: "**n/a**"}
    lines.append(f"1. Added time per snapshot ≤ half of DCP's best async mode: {verdict[g1['pass']]} — ours "
                 f"{_f(g1['ours_added_s'])} s vs best async `{g1['best_async_mode']}` {_f(g1['best_async_added_s'])} s "
                 f"(limit {_f(g1['limit_s'])} s). By directly measured blocking time: ours "
                 f"{_f(g1['blocking_check']['ours_blocking_s'])} s vs `{g1['blocking_check']['best_async_mode']}` "
                 f"{_f(g1['blocking_check']['best_async_blocking_s'], '{:.3f}')} s: "
                 f"{verdict[g1['blocking_check']['pass']]}.")
    lines.append(f"2. Daemon write bandwidth ≥ 90% of dd's: {verdict[g2['pass']]} — median ratio "
                 f"{_f(g2['median_ratio'])}.")
    if res.get("analysis"):
        lines += ["", *res["analysis"]]
    lines += ["", MARK]
    return "\n".join(lines)


def order_effect_lines(bw: dict[str, Any]) -> list[str]:
    """dd's rate by position in the pair (even pairs: ours first, so dd runs right after our write)."""
    after = [p for p in bw.get("pairs", []) if p["pair"] % 2 == 0]
    first = [p for p in bw.get("pairs", []) if p["pair"] % 2 == 1]
    if not after or not first:
        return []
    return ["", f"dd ran at {_f(_med([p['dd_GBps'] for p in first]))} GB/s (median) when it went first and "
                f"{_f(_med([p['dd_GBps'] for p in after]))} GB/s right after our write; against dd run second ours is at {_f(_med([p['ratio_full'] for p in after]))}, "
                f"against dd run first at {_f(_med([p['ratio_full'] for p in first]))}."]


def analysis_lines(res: dict[str, Any]) -> list[str]:
    """Plain-language reasons, from the measured numbers."""
    out = []
    st, g, bw = res["steps"], res["goals"], res["bandwidth"]
    ours = st.get("ours", {})
    parts = _mean_parts([r["parts"] for r in ours.get("rounds", [])])
    dcp_sd = _med([v for m in ASYNC_DCP for r in st.get(m, {}).get("rounds", [])
                   for k, v in r["parts"].items() if k == "state_dict"])
    if parts:
        verdict = "passes" if g["snapshot_cost"]["pass"] else "fails"
        out.append(
            f"Goal 1 {verdict}: `SnapshotClient.snapshot()` never calls `get_state_dict` on FSDP1 (DCP's modes "
            f"pay {_f(dcp_sd)} s for it per snapshot: FSDP1 all-gathers every parameter's AdamW state and "
            f"re-shards it). It reads FSDP's flat-parameter shard info ({parts.get('plan', 0.0):.2f} s), copies the "
            f"rank's slice of weights and both moments into a preallocated shared-memory slot "
            f"({parts.get('copy', 0.0):.2f} s) and hands a descriptor to the daemon; the live fixed-batch forward "
            f"({parts.get('eval_loss', 0.0):.2f} s on average here) runs only until one snapshot proved the "
            f"capture, after which the daemon computes the reference loss from the staged weights.")
    if ours.get("others_ratio", {}).get("median"):
        dl = res.get("daemon_latency", {})
        window = res["plan"]["every"] * (st.get("none", {}).get("mean_step_s", {}).get("median") or 0)
        verified = dl.get("verified", {}).get("median")
        committed = dl.get("committed", {}).get("median")
        behind = (f"longer than a K={res['plan']['every']} window (~{window:.0f} s): at this cadence the "
                  f"daemons would fall behind, and the ranks' backpressure would skip snapshots rather than stall"
                  if committed is not None and committed > window else
                  f"within a K={res['plan']['every']} window (~{window:.0f} s), so the slot is free again before "
                  f"the next snapshot")
        out.append(
            f"Background cost: the updates after an `ours` snapshot ran at {_f(ours['others_ratio']['median'])}x "
            f"the baseline (DCP async: {', '.join(_f(st[m]['others_ratio']['median']) for m in ASYNC_DCP if m in st)}): "
            f"each node's daemon computes the reference loss, writes and hashes a full copy, and later runs the "
            f"replay check in a fresh process, on the same 2 cores as the 4 ranks. Committed after "
            f"{_f(committed, '{:.1f}')} s, verified after {_f(verified, '{:.1f}')} s: {behind}.")
    pm = bw["parts_median_s"]
    out.append(
        f"Write path {'meets' if g['write_bandwidth']['pass'] else 'misses'} goal 2: per write, mapping the slots "
        f"takes {pm.get('map_s', 0):.2f} s, building the state from the boxes {pm.get('build_state', 0):.2f} s "
        f"(no copy), DCP's serialisation + writes into the page cache {pm.get('ours_write_only_s', 0):.2f} s and "
        f"fsync overlapped with SHA-256 {pm.get('fsync_and_hash', 0):.2f} s; dd took {pm.get('dd_s', 0):.2f} s "
        f"(a noisy disk: dd ran at {_f(bw['dd_GBps']['min'])}–{_f(bw['dd_GBps']['max'])} GB/s).")
    return out


def rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The overview rows (``scripts/benchlib.py`` contract)."""
    from benchlib import row

    st, bw, g = res.get("steps", {}), res.get("bandwidth", {}), res.get("goals", {})
    out = []
    best = (g.get("snapshot_cost") or {}).get("best_async_mode")
    ours = st.get("ours", {}).get("rounds", [])
    if best and ours:
        base = {r["round"]: r["added_per_snapshot_s"] for r in st.get(best, {}).get("rounds", [])}
        ratios = [r["added_per_snapshot_s"] / base[r["round"]] for r in ours
                  if r.get("added_per_snapshot_s") is not None and base.get(r["round"])]
        out.append(row(f"checkpoint: added time per snapshot, ours (110M params, 2x2 ranks, K={res['plan']['every']})",
                       f"DCP's best async mode in the same round (`{best}`)", _spread_of(ratios),
                       note="goal <= 0.5: " + ("PASS" if g["snapshot_cost"]["pass"] else "FAIL")))
        blk = {r["round"]: r["blocking_s"] for r in st.get(best, {}).get("rounds", [])}
        bratios = [r["blocking_s"] / blk[r["round"]] for r in ours if r.get("blocking_s") and blk.get(r["round"])]
        out.append(row("checkpoint: training blocked per snapshot, ours", f"`{best}` in the same round",
                       _spread_of(bratios)))
    if "none" in st and ours:
        out.append(row("checkpoint: mean update time with a snapshot every K updates, ours",
                       "no snapshots, same round", st["ours"]["ratio"]))
    if bw.get("ratio_full"):
        out.append(row("checkpoint: daemon write bandwidth (whole write path)",
                       "`dd conv=fsync` of the same size, same filesystem, paired", bw["ratio_full"],
                       note="goal >= 0.9: " + ("PASS" if g["write_bandwidth"]["pass"] else "FAIL")))
    return out


def _spread_of(xs: list[float]) -> dict[str, Any]:
    return {"median": _med(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None, "n": len(xs)}


def write_markdown(path: Path, block: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if text.count(MARK) >= 2:
        a = text.index(MARK)
        b = text.index(MARK, a + len(MARK)) + len(MARK)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# =========================================================================== main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=3, help="K: snapshot every K updates")
    ap.add_argument("--windows", type=int, default=1,
                    help="K-update windows per segment, each starting with a snapshot")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default=",".join(m for m in MODES if m != "dcp_stager_shm"),
                    help="comma-separated subset of %s (none is always run)" % ",".join(MODES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=MODEL["layers"])
    ap.add_argument("--width", type=int, default=MODEL["width"])
    ap.add_argument("--heads", type=int, default=MODEL["heads"])
    ap.add_argument("--vocab", type=int, default=MODEL["vocab"])
    ap.add_argument("--seq-len", type=int, default=MODEL["seq_len"])
    ap.add_argument("--bw-pairs", type=int, default=4)
    ap.add_argument("--skip-steps", action="store_true", help="only the bandwidth part")
    ap.add_argument("--work", help="work directory (default: a new one under /tmp, removed afterwards)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", help="output JSON (default benchmarks/results/<date>-ckpt.json)")
    ap.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks.md"), help="'' to skip")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the markdown from an earlier result file")
    ap.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.run_dir)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        res["goals"] = goals(res["steps"], res["bandwidth"])
        res["analysis"] = analysis_lines(res)
        res["rows"] = rows(res)
        write_markdown(Path(args.markdown), markdown(res))
        print(markdown(res))
        return 0

    t_start = time.monotonic()
    modes = [m for m in MODES if m == "none" or m in args.modes.split(",")]
    model = dict(MODEL, layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="accelpact-bench-ckpt-"))
    work.mkdir(parents=True, exist_ok=True)
    date = _dt.date.today().isoformat()
    json_path = Path(args.json) if args.json else REPO / "benchmarks" / "results" / f"{date}-ckpt.json"
    nparams = param_count(model)
    state_bytes = nparams * 4 * 3  # fp32 weights + two AdamW moments
    print(f"[bench] model: {nparams / 1e6:.1f}M parameters ({state_bytes / 2**30:.2f} GiB with AdamW); work {work}",
          flush=True)
    res: dict[str, Any] = {"part": "ckpt", "date": date, "machine": machine(), "params": model, "param_count": nparams,
                           "state_bytes": state_bytes, "batch": args.batch,
                           "json": str(json_path.relative_to(REPO)) if json_path.is_relative_to(REPO) else str(json_path)}
    try:
        if not args.skip_steps:
            plan = {"every": args.every, "windows": args.windows, "warmup": args.warmup, "rounds": args.rounds,
                    "modes": modes, "orders": rotated_orders(modes, args.rounds),
                    "out": str(work / "bench-out"), "dcp_dir": str(work / "run" / "dcp")}
            os.makedirs(plan["out"], exist_ok=True)
            res["plan"] = plan
            config = work / "bench.yaml"
            write_config(config, plan, model, args.batch)
            t = time.monotonic()
            with MachineWatch(str(work / "run")) as watch:
                code = launch(config, work / "run", plan)
            res["steps_wall_s"] = time.monotonic() - t
            res["machine_during_steps"] = watch.summary()
            rank0 = json.loads((Path(plan["out"]) / "rank-0.json").read_text())
            res["raw"] = {"records": rank0["records"], "segments": rank0["segments"]}
            res["exit_code"] = code
            res["dcp_process_start"] = rank0["extra"].get("dcp_process_start")
            res["ours_first_snapshot"] = rank0["extra"].get("ours_first_snapshot")
            res["steps"] = summarize_steps(rank0["records"], rank0["segments"], plan)
            res["daemon_latency"] = daemon_latencies(work / "run" / "events.jsonl", rank0["records"])
            if code != 0:
                print(f"[bench] the job exited with code {code}; logs under {work / 'run' / 'logs'}", flush=True)
        else:
            res["plan"] = {"every": args.every, "windows": args.windows, "warmup": args.warmup, "rounds": 0}
            res["steps"] = {}
        t = time.monotonic()
        res["bandwidth"] = bench_bandwidth(model, work, args.bw_pairs)
        res["bandwidth_wall_s"] = time.monotonic() - t
        res["goals"] = goals(res["steps"], res["bandwidth"])
        res["analysis"] = analysis_lines(res)
        res["rows"] = rows(res)
        res["total_wall_s"] = time.monotonic() - t_start
        res["machine"]["loadavg_end"] = os.getloadavg()
        if res.get("exit_code", 0) != 0:  # keep the last good result; write this one beside it
            json_path = json_path.with_name(json_path.stem + "-failed.json")
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"[bench] wrote {json_path}", flush=True)
        if args.markdown and res.get("exit_code", 0) != 0:
            print("[bench] the job failed: docs not updated", flush=True)
        elif args.markdown:
            write_markdown(Path(args.markdown), markdown(res))
            print(f"[bench] updated {args.markdown}", flush=True)
        print(markdown(res))
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if res.get("exit_code", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
