"""Guard benchmark, the ranks' side: the entry point of its jobs (``benchmarks/parts/guard.py``).

The same file is the entry point of the jobs of both library versions measured: the current code and
the code of an earlier commit (a worktree first on ``PYTHONPATH``).  It uses only the public API both
versions have (``job.protect``, ``run.update``, ``update.loss``) and torch's ``dist.barrier`` on the default group.
Each rank builds what the decoder example builds (``benchmarks.parts.workload.decoder_parts``: the model wrapped
on the job's mesh, AdamW, its schedule and data), hands them to ``job.protect`` and then runs
interleaved segments of

    plain    the example's update body (forward, backward, optimizer step, schedule step)
    guarded  the same body inside ``with run.update()``, ``update.loss`` set before the step (where the
             current code's vote carries it; the earlier code reads it at the end of the update)

``steps`` updates each, the order alternating from round to round, after ``warmup`` plain and
``warmup`` guarded updates.  Rank 0 times each update of a segment (its forward waits for its shard peers
in FSDP's all-gathers) and the whole segment, from a barrier to the next one (the same two
barriers in both modes, so the segment ends when its slowest rank is done).  No snapshots: the guard's
cost alone.  Rank 0 appends one JSON line per segment to the plan's ``out``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).resolve().parents[2]),) if p not in sys.path]

from benchmarks.harness import common as h  # noqa: E402


class _Barrier:
    """The barriers that delimit a segment, the same in both modes and in both library versions: torch's own on the
    job's default group (public API; the earlier commit has no ``instrument`` hook, imported only where the current
    code's toggles need it)."""

    def barrier(self, _name: str) -> None:
        import torch.distributed as dist

        dist.barrier()


def main(job: Any) -> None:
    from benchmarks.parts.workload import batches_forever, decoder_parts, lm_loss

    plan = job.params["bench"]
    h.guard_rank(plan["deadline_s"])
    parts = decoder_parts(job)
    run = job.protect(parts.model, parts.optimizer, scheduler=parts.scheduler)
    control = _Barrier()  # the barriers that delimit a segment (the same in both modes)
    batches = batches_forever(parts.loader)
    fd = os.open(plan["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if job.is_lead else None

    def emit(kind: str, **fields: Any) -> None:
        if fd is not None:
            os.write(fd, (json.dumps({"ev": kind, "t": time.time(), **fields}) + "\n").encode())

    def body(update: Any = None) -> None:
        loss = lm_loss(parts.model, next(batches))
        loss.backward()
        if update is not None:
            update.loss = loss
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
        parts.scheduler.step()

    def guarded() -> None:
        with run.update() as u:
            body(u)

    for _ in range(plan["warmup"]):
        body()
        guarded()
    emit("ready", library=os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["accelpact_slurm"].__file__))))
    if plan.get("toggle"):  # the current code only: the detector on and off (or the store) in this same job
        toggle = toggle_store if plan["toggle"].get("what") == "store" else toggle_detector
        emit("toggle", **toggle(job, guarded, plan["toggle"]))
        control.barrier("bench-end")
        emit("done", world=job.world_size)
        if fd is not None:
            os.close(fd)
        return
    for r in range(plan["rounds"]):
        for mode in h.abba(r, "plain", "guarded"):
            control.barrier("bench-segment")
            dts = []
            start = time.perf_counter()
            for _ in range(plan["steps"]):
                t0 = time.perf_counter()
                if mode == "plain":
                    body()
                else:
                    guarded()
                dts.append(time.perf_counter() - t0)
            control.barrier("bench-segment-end")  # the segment ends when its slowest rank is done
            emit("segment", mode=mode, round=r, n=plan["steps"], seg_s=time.perf_counter() - start, dts=dts)
    control.barrier("bench-end")
    emit("done", world=job.world_size)
    if fd is not None:
        os.close(fd)


def _alternate(job: Any, guarded: Any, plan: dict[str, Any], switch: Any, probe: Any = None) -> dict[str, Any]:
    """``k`` guarded updates in mode ``on``, then ``k`` in mode ``off`` (``switch(on)`` between them), ``alternations``
    times, the order swapped every other time (ABBA), every rank timing its own updates; every rank decides from
    the update's index alone when to switch (the ranks are in lock step at every update's vote: no round of its
    own).  ``probe()``: a number read before and after (its difference is returned).  Every rank's times."""
    from accelpact_slurm.runtime.job import instrument  # the current code only (toggles)

    control = instrument.runtime(job).control
    k, n = int(plan.get("k", 2)), int(plan.get("alternations", 60))
    times: dict[str, list[float]] = {"on": [], "off": []}
    control.barrier("bench-toggle")
    p0, wall0 = probe() if probe else None, time.monotonic()
    try:
        for i in range(n):
            for mode in h.abba(i, "on", "off"):
                switch(mode == "on")
                for _ in range(k):
                    t0 = time.perf_counter()
                    guarded()
                    times[mode].append(time.perf_counter() - t0)
    finally:
        switch(True)
    p1, wall = probe() if probe else None, time.monotonic() - wall0
    mine = {"on": times["on"], "off": times["off"], "wall_s": wall,
            "liveness_cpu_s": None if p0 is None or p1 is None else p1 - p0}
    every = control.all_gather("bench-toggle-times", mine)
    return {"k": k, "alternations": n, "ranks": every}


def toggle_store(job: Any, guarded: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """What the job's store costs a guarded update, in this job: its control plane (the vote's round) on the job's
    store (``on``) and on a ``TCPStore`` that rank 0 hosts for the section (``off``), in turn (:func:`_alternate`).
    Everything else (the heartbeats, the detector's reads, the groups' stores) stays on the job's store in both."""
    from datetime import timedelta

    import torch.distributed as dist

    from accelpact_slurm.runtime.job import instrument
    from accelpact_slurm.runtime.transport.control import ControlPlane

    rt = instrument.runtime(job)
    control = rt.control
    ours = control.base_store
    host = getattr(ours, "host", "127.0.0.1")
    server = dist.TCPStore(host, 0, job.world_size, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60)) if job.rank == 0 else None
    port = control.all_gather("bench-tcpstore", server.port if server is not None else None)[0]
    tcp = server if server is not None else dist.TCPStore(host, port, job.world_size, is_master=False,
                                                          timeout=timedelta(seconds=60))

    # the guard votes on whichever control plane the runtime holds: the job's, or one on the TCPStore (every
    # rank switches at the same update, so both planes' rounds stay in step across ranks)
    planes = {True: control, False: ControlPlane(tcp, job.rank, job.world_size, control.timeout_s,
                                                 generation=control.generation)}
    planes[False].watch = control.watch

    def switch(on: bool) -> None:
        rt.control = planes[on]

    out = _alternate(job, guarded, plan, switch)
    control.barrier("bench-tcpstore-done")  # nobody reads the TCPStore any more: rank 0 may end it
    return out


def toggle_detector(job: Any, guarded: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """The detector's own cost, in this job: guarded updates with the detector on (its collective tap, the
    control plane's watched rounds) and off (neither), in turn (:func:`_alternate`).  The liveness thread writes its
    heartbeat in both (a rank without it would be called hung): its CPU seconds over the whole section are measured
    apart (``/proc/self/task/<tid>/schedstat``)."""
    from accelpact_slurm.repair import torch_compat as tc
    from accelpact_slurm.runtime.job import instrument

    rt = instrument.runtime(job)
    det, control = rt.detector, rt.control

    def switch(on: bool) -> None:
        if on:
            tc.install_collective_tap(det.on_call)
            control.watch = det
        else:
            tc.remove_collective_tap()
            control.watch = None

    def thread_cpu_s() -> float | None:  # schedstat: the thread's time on a CPU, in nanoseconds
        tid = next((t.native_id for t in threading.enumerate() if t.name == "accelpact-liveness"), None)
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as fh:
                return int(fh.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError, TypeError):
            return None

    return _alternate(job, guarded, plan, switch, thread_cpu_s)
