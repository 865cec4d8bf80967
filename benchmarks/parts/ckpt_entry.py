"""Checkpoint benchmark, the rank side: the entry point of the benchmark's job (``benchmarks/parts/ckpt.py``).

``accelpact-run`` calls :func:`main` on every rank with the :class:`~accelpact_slurm.Job` (the job file's
``entry:``, written by ``ckpt_setup.write_config``; the plan is ``job.params["bench"]``).  The rank trains
the decoder example at the job file's size (``benchmarks.parts.workload.decoder_parts``: FSDP1 HYBRID_SHARD on the
job's mesh, AdamW, its schedule and data loader) through the public API (``job.protect``,
``run.batches``, ``with run.update()``: guard, commit, events), as the example's ``main`` does.  The job
file's ``checkpoint.every_steps`` is past the last update, so the per-node daemons run but the run's own
``SnapshotClient`` never snapshots by itself; the schedule decides instead.  After the warm-up updates,
every timed update belongs to one segment of one mode; the first update of each K-update window takes a
snapshot right after the update (``ours``: the run's client, ``instrument.snapshot_client(run).snapshot(step)``,
whose pieces rank 0's ``snapshot`` event holds; the DCP modes: ``ckpt_dcp.DcpModes``), and after its last update the
segment is drained outside the timed updates (async futures, our daemons' write + verification,
``malloc_trim``).  Each ``ours`` snapshot is bracketed by the memcpy floor (the rank's same bytes into a
touched buffer of their size), right before it (left out of the update's time) and right after it; before the
floor, the page probe (:class:`PageProbe`, also untimed).  Step
time = time between the ends of two consecutive updates (each followed by its snapshot, if any) on rank 0
(the ranks are in lock step), so it includes the blocking part.  Each rank dumps its records to
``plan["out"]/rank-<rank>.json`` after every segment.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).resolve().parents[2]),) if p not in sys.path]

from accelpact_slurm.runtime.job import instrument  # noqa: E402
from benchmarks.harness import common as h  # noqa: E402
from benchmarks.parts.ckpt_dcp import DcpModes  # noqa: E402
from benchmarks.parts.ckpt_setup import build_schedule, is_snapshot, segment_length  # noqa: E402


def main(job: Any) -> None:
    from benchmarks.parts.workload import decoder_parts, update

    parts = decoder_parts(job)
    run = job.protect(parts.model, parts.optimizer, scheduler=parts.scheduler, state={"data": parts.loader})
    bench = CkptBench(job, run, parts)
    try:
        for tokens in run.batches(parts.loader):
            with run.update() as u:
                update(parts, tokens, before_step=bench.wait_staging, into=u)
            bench.after_update(run.step)
    finally:
        bench.close()


class SnapshotEvents:
    """Rank 0's ``snapshot`` events as the job appends them (the client times its own pieces: ``parts_s`` and
    ``blocking_s``)."""

    def __init__(self, run_dir: str) -> None:
        from accelpact_slurm.core.events import EVENTS_FILE

        self.tail = h.EventTail(Path(run_dir) / EVENTS_FILE, 0)
        self.seen: dict[int, dict[str, Any]] = {}

    def parts(self, step: int) -> dict[str, Any]:
        for ev in self.tail.new():
            if ev.get("event") == "snapshot" and not ev.get("skipped"):
                self.seen[int(ev["step"])] = {**(ev.get("parts_s") or {}), "total": ev.get("blocking_s")}
        return self.seen.pop(step, {})


class CkptBench(DcpModes):
    """The schedule of segments on one rank: our snapshots through the run's client, DCP's through ``DcpModes``."""

    def __init__(self, job: Any, run: Any, parts: Any) -> None:
        self.job, self.run = job, run
        self.client = instrument.snapshot_client(run)  # never due by itself: see the module docstring
        self.rt, self.cfg = instrument.runtime(job), job.config  # the control plane's barriers between segments
        self.snap_events = SnapshotEvents(job.run_dir) if job.rank == 0 else None  # rank 0's records are read
        self.model, self.optimizer = parts.model, parts.optimizer
        self.plan = job.params["bench"]
        self.sched = build_schedule(self.plan)
        self.length = segment_length(self.plan)
        self.records: list[dict[str, Any]] = []
        self.segments: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.t_prev: float | None = None
        self.parts: dict[str, float] = {}
        self.ours_steps: list[int] = []
        self._floor_buf: Any = None  # the memcpy floor's target, during the ours segments (_prepare_next)
        self._probe: PageProbe | None = None  # made at the warm-up's end, beside the slot made there
        self.floor_cpu_s: float | None = None  # the last memcpy floor's CPU time (this thread's)
        self._init_dcp()
        self.out = os.path.join(self.plan["out"], f"rank-{job.rank}.json")

    # -------------------------------------------------------------- the schedule
    def after_update(self, step: int) -> None:
        now = time.monotonic()
        entry = self.sched.get(step)
        client = self.client
        if entry is None:  # warm-up
            self.records.append({"step": step, "mode": "warmup",
                                 "step_s": None if self.t_prev is None else now - self.t_prev})
            if step == self.plan["warmup"]:
                if "ours" in self.plan["modes"]:
                    # the first snapshot of a start creates the slot (first touch of its pages) and carries
                    # the capture proof (the staged bytes against the live state dict, a collective): a
                    # one-off per start, taken here, untimed, and reported apart; the timed snapshots are
                    # the steady state
                    client.snapshot(step)
                    self._probe = PageProbe(self.job.rank)
                    self.extra["ours_first_snapshot"] = self._snapshot_parts(step)
                    self.extra["ours_first_snapshot"]["state"] = client.wait(step, self.cfg.timeouts.startup_s)
                self._prepare_next(step)
                self.rt.control.barrier("bench-start", timeout_s=600)
            self.t_prev = time.monotonic()
            return
        rnd, mode, pos = entry
        snap = is_snapshot(self.plan, mode, pos)
        self.parts.clear()
        info: dict[str, Any] = {}
        block = 0.0
        untimed = 0.0
        if snap and mode == "ours":  # the floor right before the snapshot (its time left out of the update's)
            t = time.monotonic()
            if self._probe is not None:
                info["page_probe"] = self._probe.probe()
            f0 = _minor_faults()
            info["memcpy_floor_before_s"] = self._memcpy_floor()
            info["floor_before_cpu_s"] = self.floor_cpu_s
            info["floor_before_minflt"] = _minor_faults() - f0
            untimed = time.monotonic() - t
        wall = time.time()
        if snap:
            t = time.monotonic()
            if mode == "ours":
                f0 = _minor_faults()
                self._snap_ours(step, info)
                info["snapshot_minflt"] = _minor_faults() - f0  # page faults of the whole process (the copy's)
            else:
                self._snap_dcp(mode, step)
            block = time.monotonic() - t
        end = time.monotonic()
        self.records.append({
            "step": step, "round": rnd, "mode": mode, "pos": pos, "snap": snap, "wall": wall,
            "step_s": end - self.t_prev - untimed, "block_s": block, "staging_wait_s": self.staging_wait,
            "parts": dict(self.parts), **info,
        })
        self.staging_wait = 0.0
        if snap and mode == "ours":  # outside the timed update: the snapshot's pieces, the floor again
            self.records[-1]["parts"] = {k: v for k, v in self._snapshot_parts(step).items() if k != "total"}
            self.records[-1]["memcpy_floor_after_s"] = self._memcpy_floor()
        if pos == self.length:
            self._drain(rnd, mode, step)
        self.t_prev = time.monotonic()

    # -------------------------------------------------------------- our snapshot path
    def _snap_ours(self, step: int, info: dict[str, Any]) -> None:
        client = self.client
        client.snapshot(step)  # its pieces: rank 0's snapshot event, read after the timed update
        self.ours_steps.append(step)

    def _snapshot_parts(self, step: int) -> dict[str, Any]:
        """What the snapshot of update ``step`` blocked for, piece by piece, and in all (``total``), from rank 0's
        ``snapshot`` event; empty on the other ranks."""
        return {} if self.snap_events is None else self.snap_events.parts(step)

    def _floor_sources(self) -> list[Any] | None:
        """This rank's snapshot bytes as the snapshot copies them (FSDP1's plan: no collective), one uint8
        view per box; None where the plan does not apply."""
        import torch

        from ckpt_service.capture import fsdp1_plan

        plan = fsdp1_plan(self.model, self.optimizer)
        if plan is None:
            return None
        return [b.src.reshape(-1).view(torch.uint8) for e in plan.entries for b in e.boxes
                if b.src is not None and b.src.numel()]

    def _prepare_next(self, step: int) -> None:
        """Untimed, between segments: DCP's (``DcpModes``), then the floor's buffer: one of the rank's bytes'
        size, touched, for the ``ours`` segments only (4 ranks + 2 daemons leave no room for it beside DCP's
        staging copies), freed before the next segment of another mode."""
        super()._prepare_next(step)
        nxt = self.sched.get(step + 1)
        if nxt is not None and nxt[1] == "ours":
            if self._floor_buf is None:
                import torch

                srcs = self._floor_sources()
                if srcs:
                    self._floor_buf = torch.empty(sum(s.numel() for s in srcs), dtype=torch.uint8)
                    self._floor_buf.fill_(0)  # touch every page once
        else:
            self._floor_buf = None

    def _memcpy_floor(self) -> float | None:
        """Seconds of a plain copy of this rank's own snapshot bytes (the same tensors the snapshot copies) into
        a preallocated, already touched buffer of their size, as the snapshot copies them into its slot: the
        floor of the blocking time.  FSDP1 only (its plan needs no collective)."""
        buf = self._floor_buf
        srcs = self._floor_sources() if buf is not None else None
        if not srcs:
            return None
        t, c = time.monotonic(), time.thread_time()
        at = 0
        for src in srcs:
            n = src.numel()
            buf[at:at + n].copy_(src)
            at += n
        self.floor_cpu_s = time.thread_time() - c
        return time.monotonic() - t

    # -------------------------------------------------------------- between segments (untimed)
    def _drain(self, rnd: int, mode: str, step: int) -> None:
        control = self.rt.control
        t = time.monotonic()
        dcp_bg = self._drain_dcp()
        states = {s: self.client.wait(s, self.cfg.timeouts.startup_s) for s in self.ours_steps}
        drained = time.monotonic() - t
        control.barrier("bench-drained", timeout_s=600)
        if self.job.is_lead:
            shutil.rmtree(os.path.join(self.plan["dcp_dir"], mode), ignore_errors=True)
        control.barrier("bench-cleaned", timeout_s=600)
        self.segments.append({"round": rnd, "mode": mode, "last_step": step, "drain_s": drained,
                              "ours_states": states, "dcp_bg": dcp_bg})
        self.ours_steps = []
        self._reset_dcp()
        self._prepare_next(step)
        release_free_memory()
        control.barrier("bench-trimmed", timeout_s=600)
        self._dump()
        if self.job.is_lead:
            print(f"[bench] {time.strftime('%H:%M:%S')} round {rnd + 1} {mode:<15} done at update {step}; "
                  f"drained in {drained:.1f} s", flush=True)

    def _dump(self) -> None:
        tmp = self.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"rank": self.job.rank, "records": self.records, "segments": self.segments,
                       "extra": self.extra}, fh, indent=1, default=str)
        os.replace(tmp, self.out)

    def close(self) -> None:
        self.close_stagers()
        self._dump()


class PageProbe:
    """Two shared-memory buffers left idle like the staging slot, written twice each before every timed snapshot.

    Why: the copy into the slot took up to ~2x the memcpy floor in the rounds after another mode's segment, with a
    handful of page faults.  The slots of the two replicas of a shard hold the same bytes (HSDP replicas are
    identical; the emulated nodes are one machine), and a virtual machine's host may merge identical pages of its
    guest and copy a merged page on its first write, which the guest sees only as slower user time.  The probe
    shows it or rules it out at the snapshot's own moments: ``dup`` holds bytes every rank's ``dup`` and its
    source also hold, ``uniq`` bytes found nowhere else (random, re-drawn in place after each probe); each is
    written twice with the same source, each write's wall and CPU time taken (this thread's: the host's work on
    a guest's page shows as the guest's CPU time, with no page fault; waiting for a core does not).
    :data:`MIB` each (the effect is per page; the slot's size is not needed).  The files are unlinked at once.
    """

    MIB = 64

    def __init__(self, rank: int) -> None:
        import torch

        n = self.MIB * 2**20
        gen = torch.Generator().manual_seed(20261205)  # the same on every rank: the duplicated bytes
        self.src = torch.randn(n // 4, generator=gen).view(torch.uint8)
        self.dup, self.uniq = _shm_buffer(n), _shm_buffer(n)
        self.dup.copy_(self.src)
        self._gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") + rank)
        self.uniq.view(torch.float32).normal_(generator=self._gen)

    def probe(self) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {"mib": self.MIB}
        f0 = _minor_faults()
        for name, buf in (("dup", self.dup), ("uniq", self.uniq)):
            for k in ("first", "second"):
                t, c = time.perf_counter(), time.thread_time()
                buf.copy_(self.src)
                out[f"{name}_{k}_s"], out[f"{name}_{k}_cpu_s"] = time.perf_counter() - t, time.thread_time() - c
        out["minflt"] = _minor_faults() - f0
        self.uniq.view(torch.float32).normal_(generator=self._gen)  # unique again (dup holds src: duplicated)
        return out


def _shm_buffer(nbytes: int) -> Any:
    """A touched uint8 tensor over an unlinked ``/dev/shm`` file, mapped shared as the staging slots are."""
    import mmap
    import tempfile

    import torch

    fd, path = tempfile.mkstemp(prefix="accelpact-probe-", dir="/dev/shm")
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    buf.fill_(0)
    return buf


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


def _minor_faults() -> int:
    """This process's minor page faults so far (a copy into pages the kernel unmapped since: one per page)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
