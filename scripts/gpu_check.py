#!/usr/bin/env python3
"""GPU check for a machine with one NVIDIA GPU (run through ``scripts/gpu-check.sh``; never needed by the tests).

Three questions the CPU machines cannot answer:

1. **Staging bandwidth.** How fast a rank can copy its shards from the GPU into host memory for a
   snapshot: device-to-host into a preallocated *pinned* buffer (``copy_(non_blocking=True)`` on a side
   stream) against the plain copy a framework does by default (``tensor.cpu()`` into new pageable memory)
   and against a preallocated pageable buffer. Paired and interleaved, median of the paired ratios.
   Also: how much a side-stream copy slows compute running at the same time (matrix products alone vs
   with the copy in flight), the part of staging training would feel.
2. **The client's own staging path.** ``Plan.copy_into`` of GPU tensors into a page-locked ``/dev/shm``
   slot (``Slot.pin``) against the same slot left pageable, every byte checked (section ``slot``; it
   imports ``ckpt_service`` from this checkout, the rest imports only torch).
3. **Communicator create/destroy (NCCL).** What replacing a communicator costs: create a new group with
   the same members (``new_group``, eager and lazy), its first all-reduce, ``abort``/destroy, and
   ``split_group`` where torch has it, each against one all-reduce on the live communicator of the same
   size (the floor the repair engine is measured against on CPU). One GPU allows world size 1; a
   second process on the same GPU is tried and its outcome recorded (NCCL refuses duplicate devices).

Output: JSON (``--json``, default ``$OUT/gpu-check.json`` or ``runs/gpu-check.json``, outside git) with
``"rows"`` in the format of ``benchmarks/harness/stats.py`` and the raw medians; back on the project's machine,
``python -m benchmarks.harness.run --gpu-check FILE`` writes its summary (``benchmarks/summaries/gpu-check.json``).
Runs in well under 5 minutes.
Runs on the device machine's own torch (not the project's pin).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness.stats import row as _row  # noqa: E402  (stdlib only: the device machine has just torch)
from benchmarks.harness.stats import spread as _spread  # noqa: E402
from benchmarks.parts import gpu_project as gp  # noqa: E402  (the project's own checks: runs accelpact-run etc.)

MiB = 1 << 20


def _log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ 1. staging bandwidth


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def staging(sizes_mib: list[int], pairs: int) -> dict[str, Any]:
    dev = torch.device("cuda", 0)
    side = torch.cuda.Stream()
    out: dict[str, Any] = {"sizes": {}}
    for size in sizes_mib:
        n = size * MiB // 4
        src = torch.randn(n, device=dev)
        t0 = time.perf_counter()
        pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
        pin_alloc_s = time.perf_counter() - t0
        pageable = torch.empty(n, dtype=torch.float32)
        pageable.fill_(0)  # touch the pages once: a preallocated buffer, as a staging pool would be

        def to_pinned(src=src, pinned=pinned) -> None:
            with torch.cuda.stream(side):
                pinned.copy_(src, non_blocking=True)
            side.synchronize()

        def plain_cpu(src=src) -> None:
            src.cpu()

        def to_pageable(src=src, pageable=pageable) -> None:
            pageable.copy_(src)

        for fn in (to_pinned, plain_cpu, to_pageable):  # warm-up
            fn()
        rec: dict[str, list[float]] = {"pinned_s": [], "cpu_s": [], "pageable_s": []}
        for i in range(pairs):
            order = [("pinned_s", to_pinned), ("cpu_s", plain_cpu), ("pageable_s", to_pageable)]
            if i % 2:
                order.reverse()
            for key, fn in order:
                rec[key].append(_timed(fn))
        assert torch.equal(pinned[:1024], src[:1024].cpu()), "pinned copy differs from the source"
        nbytes = n * 4
        out["sizes"][str(size)] = {
            "bytes": nbytes, "pin_alloc_s": pin_alloc_s,
            "pinned_GBps": _spread([nbytes / t / 1e9 for t in rec["pinned_s"]]),
            "cpu_GBps": _spread([nbytes / t / 1e9 for t in rec["cpu_s"]]),
            "pageable_GBps": _spread([nbytes / t / 1e9 for t in rec["pageable_s"]]),
            "speedup_vs_cpu": _spread([c / p for p, c in zip(rec["pinned_s"], rec["cpu_s"])]),
            "speedup_vs_pageable": _spread([c / p for p, c in zip(rec["pinned_s"], rec["pageable_s"])]),
        }
        _log(f"staging {size} MiB: pinned {out['sizes'][str(size)]['pinned_GBps']['median']:.1f} GB/s, "
             f".cpu() {out['sizes'][str(size)]['cpu_GBps']['median']:.1f} GB/s")
        del src, pinned, pageable
        torch.cuda.empty_cache()

    # Interference: matrix products on the default stream, alone vs with a pinned D2H copy on a side stream.
    size = max(sizes_mib)
    n = size * MiB // 4
    src = torch.randn(n, device=dev)
    pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def compute() -> float:
        """Seconds of the matmuls on the default stream, timed with CUDA events (not the copy's wait)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(100):
            a @ b
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def compute_with_copy() -> float:
        with torch.cuda.stream(side):
            pinned.copy_(src, non_blocking=True)
        s_ = compute()
        side.synchronize()
        return s_

    compute()
    compute_with_copy()
    alone, mixed, copy_alone = [], [], []
    for i in range(pairs):
        pair = [(alone, compute), (mixed, compute_with_copy)]
        if i % 2:
            pair.reverse()
        for sink, fn in pair:
            torch.cuda.synchronize()
            sink.append(fn())
        copy_alone.append(_timed(lambda: (pinned.copy_(src, non_blocking=True), torch.cuda.synchronize())))
    out["interference"] = {"copy_mib": size, "compute_alone_s": _spread(alone), "compute_with_copy_s": _spread(mixed),
                           "copy_alone_s": _spread(copy_alone),
                           "slowdown": _spread([m / a_ for a_, m in zip(alone, mixed)])}
    _log(f"interference: compute with a side-stream copy / alone = {out['interference']['slowdown']['median']:.3f}")
    return out


# ------------------------------------------------------------------ 2. the project's staging slot


def slot_staging(total_mib: int, pairs: int, work: str) -> dict[str, Any]:
    """The checkpoint client's own path: ``Plan.copy_into`` of GPU tensors into a ``/dev/shm`` slot.

    A rank's state as the capture sees it (16 MiB weights, each with a 64 KiB bias), copied into a
    page-locked slot (``Slot.pin``) and into an identical slot left pageable, alternated. Every byte of
    both slots is compared with ``tensor.cpu()``; and a copy issued right behind queued work that
    rewrites a weight must see the rewritten values (the side stream waits for the default stream).
    """
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ckpt_service.capture import Box, Entry, Plan
    from ckpt_service.staging import Slot

    dev = torch.device("cuda", 0)
    tensors: list[torch.Tensor] = []
    while sum(t.numel() * 4 for t in tensors) < total_mib * MiB:
        tensors += [torch.randn(4 * MiB, device=dev), torch.randn(16 * 1024, device=dev)]
    plan = Plan([Entry(("model", f"p{i}"), [t.numel()], t.dtype, [Box([0], [t.numel()], src=t)])
                 for i, t in enumerate(tensors)], {}, "state_dict")
    nbytes = plan.layout()
    # A private folder (0700), as the client's own staging root is: the slot refuses a folder others can write.
    root = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else work, f"accelpact-gpu-check-{os.getuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)
    paths = [os.path.join(root, f"accelpact-gpu-check-{os.getpid()}.slot-{k}") for k in ("pinned", "plain")]
    pinned_slot, plain_slot = Slot(paths[0]), Slot(paths[1])
    try:
        for sl in (pinned_slot, plain_slot):
            sl.ensure(nbytes)
            sl.buf.fill_(0)  # pages touched once, as a reused slot's are
        pinned = pinned_slot.pin()
        for sl in (pinned_slot, plain_slot):
            plan.copy_into(sl.buf)  # warm-up
        rec: dict[str, list[float]] = {"pinned_s": [], "plain_s": []}
        for i in range(pairs):
            order = [("pinned_s", pinned_slot), ("plain_s", plain_slot)]
            if i % 2:
                order.reverse()
            for key, sl in order:
                torch.cuda.synchronize()
                t = time.perf_counter()
                plan.copy_into(sl.buf)  # returns with every byte in the slot
                rec[key].append(time.perf_counter() - t)
        mismatched = 0
        for sl in (pinned_slot, plain_slot):
            for _e, b, view in plan.regions(sl.buf):
                mismatched += int(not torch.equal(view, b.src.reshape(-1).cpu()))
        # Ordering: rewrite the first weight on the default stream (queued behind matmuls), then copy at once.
        a = torch.randn(4096, 4096, device=dev)
        for _ in range(20):
            a = torch.tanh(a @ a / 64.0)  # bounded: no inf/NaN to spoil the comparison
        tensors[0].copy_(a.reshape(-1)[: tensors[0].numel()])
        plan.copy_into(pinned_slot.buf)
        first = next(plan.regions(pinned_slot.buf))[2]
        ordered = bool(torch.equal(first, tensors[0].cpu()))
    finally:
        pinned_slot.unpin()
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
    gbps = {k: _spread([nbytes / t / 1e9 for t in v]) for k, v in rec.items()}
    out = {"bytes": nbytes, "tensors": len(tensors), "slot_dir": root, "pinned": pinned,
           "pinned_GBps": gbps["pinned_s"], "plain_GBps": gbps["plain_s"],
           "speedup": _spread([p_ / q for q, p_ in zip(rec["pinned_s"], rec["plain_s"])]),
           "mismatched_boxes": mismatched, "copy_sees_queued_writes": ordered}
    _log(f"slot staging {nbytes / MiB:.0f} MiB in {len(tensors)} tensors: page-locked "
         f"{gbps['pinned_s']['median']:.1f} GB/s, pageable {gbps['plain_s']['median']:.1f} GB/s; "
         f"mismatched boxes {mismatched}, copy sees queued writes: {ordered}")
    return out


# ------------------------------------------------------------------ 3. NCCL communicators


def _comm_worker(rank: int, world: int, port: int, reps: int, nbytes: int, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    res: dict[str, Any] = {"world": world}
    try:
        t = time.perf_counter()
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
        res["init_eager_s"] = time.perf_counter() - t
        x = torch.ones(nbytes // 4, device=dev)
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        rec: dict[str, list[float]] = {k: [] for k in (
            "allreduce_s", "new_group_eager_s", "first_allreduce_eager_s", "destroy_s",
            "abort_s", "split_s", "first_allreduce_split_s")}
        members = list(range(world))
        has_split = hasattr(dist, "split_group")
        res["split_group_available"] = has_split
        for _ in range(reps):
            rec["allreduce_s"].append(_timed(lambda: dist.all_reduce(x)))
            # eager: the communicator is created inside new_group (device_id bound on the default group)
            t = time.perf_counter()
            g = dist.new_group(members, use_local_synchronization=True)
            torch.cuda.synchronize()
            rec["new_group_eager_s"].append(time.perf_counter() - t)
            rec["first_allreduce_eager_s"].append(_timed(lambda g=g: dist.all_reduce(x, group=g)))
            t = time.perf_counter()
            dist.destroy_process_group(g)
            torch.cuda.synchronize()
            rec["destroy_s"].append(time.perf_counter() - t)
            if has_split:
                try:
                    t = time.perf_counter()
                    sg = dist.split_group(split_ranks=[members])
                    torch.cuda.synchronize()
                    rec["split_s"].append(time.perf_counter() - t)
                    rec["first_allreduce_split_s"].append(_timed(lambda sg=sg: dist.all_reduce(x, group=sg)))
                    dist.destroy_process_group(sg)
                except Exception as exc:  # noqa: BLE001
                    res["split_error"] = repr(exc)
                    has_split = False
        _dump(res, rec, rank, result_path)
        # abort instead of a clean destroy: what a repair does to a communicator that may be wedged.
        # Last, and the aborted groups are left for process exit: a destroy after abort may block.
        for _ in range(reps):
            g = dist.new_group(members, use_local_synchronization=True)
            dist.all_reduce(x, group=g)
            torch.cuda.synchronize()
            try:
                backend = g._get_backend(dev)
                t = time.perf_counter()
                backend.abort()
                rec["abort_s"].append(time.perf_counter() - t)
            except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                res["abort_error"] = repr(exc)
                break
        _dump(res, rec, rank, result_path)
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-2000:]
        if rank == 0:
            with open(result_path, "w", encoding="utf-8") as fh:
                json.dump(res, fh)
    os._exit(0)


def _dump(res: dict[str, Any], rec: dict[str, list[float]], rank: int, result_path: str) -> None:
    res.update({k: _spread(v) for k, v in rec.items() if v})
    res["ratios"] = {
        "eager_create_plus_first_vs_allreduce": _spread(
            [(c + f) / a for c, f, a in zip(rec["new_group_eager_s"], rec["first_allreduce_eager_s"],
                                            rec["allreduce_s"])]),
        "destroy_vs_allreduce": _spread([d / a for d, a in zip(rec["destroy_s"], rec["allreduce_s"])]),
    }
    if rec["abort_s"]:
        res["ratios"]["abort_vs_allreduce"] = _spread([d / a for d, a in zip(rec["abort_s"], rec["allreduce_s"])])
    if rec["split_s"]:
        res["ratios"]["split_plus_first_vs_allreduce"] = _spread(
            [(c + f) / a for c, f, a in zip(rec["split_s"], rec["first_allreduce_split_s"], rec["allreduce_s"])])
    if rank == 0:
        tmp = result_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(res, fh)
        os.replace(tmp, result_path)


def communicators(world: int, reps: int, nbytes: int, work: str, port: int, deadline_s: float) -> dict[str, Any]:
    path = os.path.join(work, f"comm-{world}.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_comm_worker, args=(r, world, port, reps, nbytes, path)) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    timed_out = any(p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            res = json.load(fh)
    else:
        res = {"world": world, "error": "no result (exit codes %s)" % [p.exitcode for p in procs]}
    if timed_out:
        res["error"] = (res.get("error", "") + f" timed out after {deadline_s:.0f} s").strip()
    return res


# ------------------------------------------------------------------ main


def rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    st = res.get("staging", {})
    for size, s in st.get("sizes", {}).items():
        out.append(_row(f"D2H staging of {size} MiB into a preallocated pinned buffer (side stream), GPU",
                        "`tensor.cpu()` (new pageable memory)", s["speedup_vs_cpu"],
                        note=f"pinned {s['pinned_GBps']['median']:.1f} GB/s, .cpu() {s['cpu_GBps']['median']:.1f} GB/s"))
        out.append(_row(f"D2H staging of {size} MiB into pinned memory, GPU",
                        "copy into a preallocated pageable buffer", s["speedup_vs_pageable"],
                        note=f"pageable {s['pageable_GBps']['median']:.1f} GB/s"))
    if "interference" in st:
        i = st["interference"]
        out.append(_row(f"100 bf16 8192^3 matmuls (CUDA events) with a {i['copy_mib']} MiB pinned D2H copy on a side stream",
                        "the same matmuls alone", i["slowdown"],
                        note=f"alone {i['compute_alone_s']['median'] * 1e3:.1f} ms, copy alone "
                             f"{i['copy_alone_s']['median'] * 1e3:.1f} ms"))
    sl = res.get("slot")
    if sl and not sl.get("error"):
        out.append(_row(f"checkpoint client `Plan.copy_into` of {sl['bytes'] // MiB} MiB in {sl['tensors']} GPU tensors "
                        f"into its page-locked {sl['slot_dir']} slot (`Slot.pin`), GPU",
                        "the same copy into an identical slot left pageable", sl["speedup"],
                        note=f"page-locked {sl['pinned_GBps']['median']:.1f} GB/s, pageable "
                             f"{sl['plain_GBps']['median']:.1f} GB/s; every byte equal to `tensor.cpu()`: "
                             f"{'yes' if sl['mismatched_boxes'] == 0 else 'NO'}; sees queued writes: "
                             f"{'yes' if sl['copy_sees_queued_writes'] else 'NO'}"))
    for key in ("comm_world1", "comm_world2"):
        c = res.get(key)
        if not c:
            continue
        w = c.get("world")
        if c.get("error"):
            out.append({"what": f"NCCL communicator, world size {w} on one GPU", "baseline": "—", "ratio": None,
                        "spread": None, "n": 0, "unit": "x", "note": f"not possible: {c['error'][:160]}"})
            continue
        ar_ms = c["allreduce_s"]["median"] * 1e3
        r = c["ratios"]
        out.append(_row(f"NCCL new_group (eager) + first all-reduce, world {w}", f"one all-reduce of "
                        f"{res['allreduce_bytes'] // MiB} MiB on the live communicator ({ar_ms:.3f} ms)",
                        r["eager_create_plus_first_vs_allreduce"],
                        note=f"create {c['new_group_eager_s']['median'] * 1e3:.1f} ms"))
        out.append(_row(f"NCCL destroy_process_group(new group), world {w}", "the same all-reduce",
                        r["destroy_vs_allreduce"], note=f"{c['destroy_s']['median'] * 1e3:.1f} ms"))
        if "abort_vs_allreduce" in r:
            out.append(_row(f"NCCL abort() of a group's backend, world {w}", "the same all-reduce",
                            r["abort_vs_allreduce"], note=f"{c['abort_s']['median'] * 1e3:.1f} ms"))
        if "split_plus_first_vs_allreduce" in r:
            out.append(_row(f"NCCL split_group + first all-reduce, world {w}", "the same all-reduce",
                            r["split_plus_first_vs_allreduce"], note=f"split {c['split_s']['median'] * 1e3:.1f} ms"))
    return out


def reading(res: dict[str, Any]) -> list[str]:
    """What the figures mean for the checkpoint service and the repair engine (from the numbers)."""
    out = []
    sizes = res.get("staging", {}).get("sizes", {})
    if sizes:
        big = sizes[max(sizes, key=int)]
        out.append(f"Staging a rank's shards from GPU memory: into pinned memory {big['pinned_GBps']['median']:.0f} GB/s, "
                   f"{big['speedup_vs_cpu']['median']:.0f}x `tensor.cpu()` and {big['speedup_vs_pageable']['median']:.1f}x a "
                   f"copy into preallocated pageable memory: a 4 GiB shard costs about "
                   f"{4 / big['pinned_GBps']['median'] * 1.074:.2f} s instead of {4 / big['cpu_GBps']['median'] * 1.074:.1f} s. "
                   f"Hence the checkpoint client page-locks its shared-memory slot (`cudaHostRegister` on the mapping, "
                   f"`Slot.pin`) and fills it with `copy_(non_blocking=True)` on a side stream.")
    inter = res.get("staging", {}).get("interference")
    if inter:
        out.append(f"That copy, running on a side stream while bf16 matrix products run, changed their time by "
                   f"{inter['slowdown']['median']:.2f}x (median; spread {inter['slowdown']['min']:.2f}–"
                   f"{inter['slowdown']['max']:.2f}x): the copy engine overlaps compute.")
    sl = res.get("slot") or {}
    if sl and not sl.get("error"):
        out.append(f"The client's own path (`Plan.copy_into`, {sl['tensors']} tensors, {sl['bytes'] / 2**30:.1f} GiB): "
                   f"{sl['pinned_GBps']['median']:.0f} GB/s into the page-locked slot against "
                   f"{sl['plain_GBps']['median']:.1f} GB/s into the same slot left pageable "
                   f"({sl['speedup']['median']:.1f}x); both slots equal `tensor.cpu()` byte for byte"
                   f"{'' if sl['mismatched_boxes'] == 0 else ' -- NOT: ' + str(sl['mismatched_boxes']) + ' boxes differ'}, "
                   f"and a copy issued behind queued writes {'saw them' if sl['copy_sees_queued_writes'] else 'DID NOT see them'}.")
    elif sl.get("error"):
        out.append(f"The client's slot check failed: {sl['error'][:200]}")
    c = res.get("comm_world1") or {}
    if c and not c.get("error"):
        out.append(f"Replacing a communicator with NCCL (one GPU, world size 1): a new group with the same members plus "
                   f"its first all-reduce {c['new_group_eager_s']['median'] * 1e3:.0f} ms, `split_group` "
                   f"{c['split_s']['median'] * 1e3:.0f} ms, but a clean `destroy_process_group` of the old one "
                   f"{c['destroy_s']['median'] * 1e3:.0f} ms and `abort()` {c['abort_s']['median'] * 1e3:.0f} ms: "
                   f"retiring the broken communicator, not building the new one, dominates an L1 repair on NCCL, "
                   f"so it belongs off the critical path (after the release).")
    c2 = res.get("comm_world2") or {}
    if c2.get("error"):
        out.append("Two processes on one GPU cannot form an NCCL communicator (`Duplicate GPU detected`), so "
                   "multi-rank NCCL repair needs a machine with several GPUs; the CPU tests use Gloo.")
    return out


def project_checks(parts: set[str], work: str, device: str) -> dict[str, Any]:
    """The project's own checks (``benchmarks/parts/gpu_project.py``) that ``parts`` names, each guarded."""
    res: dict[str, Any] = {}
    for name, fn in (("examples", lambda: gp.examples(work, device)), ("qualify", lambda: gp.qualify(work, device)),
                     ("floor", lambda: gp.floor(work, device)), ("multigpu", lambda: gp.multigpu(work))):
        if name not in parts:
            continue
        _log(f"project check: {name}")
        try:
            res[name] = fn()
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            _log(f"{name} failed: {exc}")
    return res


def _write(res: dict[str, Any], path: str, t_all: float) -> None:
    """Write what is measured so far (a later part that hangs past the deadline loses only itself)."""
    res["total_wall_s"] = time.monotonic() - t_all
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1, default=str)
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_json = (os.path.join(os.environ["OUT"], "gpu-check.json") if os.environ.get("OUT")
                    else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                      "runs", "gpu-check.json"))
    ap.add_argument("--json", default=default_json)
    ap.add_argument("--sizes-mib", default="256,1024,4096", help="staging sizes (MiB)")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--comm-reps", type=int, default=10)
    ap.add_argument("--allreduce-mib", type=int, default=64)
    ap.add_argument("--work", default="/tmp/accelpact-gpu-check")
    ap.add_argument("--slot-mib", type=int, default=1024, help="size of the client slot copy (MiB)")
    ap.add_argument("--parts", default="examples,qualify,floor,multigpu,staging,slot,comm",
                    help="comma-separated sections to run (default: %(default)s); the project's own checks "
                         "(examples, qualify, floor, multigpu) are in benchmarks/parts/gpu_project.py")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="device of the project's checks (cpu: a rehearsal of them on a machine without a GPU)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the sections of an existing --json file that this run does not redo")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    known = ("examples", "qualify", "floor", "multigpu", "staging", "slot", "comm")
    unknown = parts - set(known)
    if unknown:
        ap.error(f"--parts: unknown section(s) {sorted(unknown)}; choose from {', '.join(known)}")
    if args.device == "cpu":
        parts &= {"examples", "qualify", "floor"}
        os.makedirs(args.work, exist_ok=True)
        res = project_checks(parts, args.work, "cpu")
        res["rows"] = gp.rows(res)
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1, default=str)[:6000])
        for r in res["rows"]:
            print(f"- {r['what']} vs {r['baseline']}: {r['ratio']} ({r['spread']}) {r['note']}")
        return 0 if all(res[p].get("ok", True) for p in parts if isinstance(res.get(p), dict)) else 1
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible to torch; nothing to measure", file=sys.stderr)
        return 2
    os.makedirs(args.work, exist_ok=True)
    t_all = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    res: dict[str, Any] = {
        "part": "gpu-check", "date": _dt.date.today().isoformat(),
        "machine": {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None,
                    "platform": platform.platform()},
        "allreduce_bytes": args.allreduce_mib * MiB,
    }
    _log(f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if args.merge and os.path.exists(args.json):
        with open(args.json, encoding="utf-8") as fh:
            old = json.load(fh)
        res.update({k: v for k, v in old.items() if k in ("staging", "slot", "comm_world1", "comm_world2", "examples",
                                                         "qualify", "floor", "multigpu")})
    res.update(project_checks(parts, args.work, "cuda"))
    _write(res, args.json, t_all)
    for name, fn in (("staging", lambda: staging([int(s) for s in args.sizes_mib.split(",")], args.pairs)),
                     ("slot", lambda: slot_staging(args.slot_mib, args.pairs, args.work))):
        if name not in parts:
            continue
        try:
            res[name] = fn()
        except Exception as exc:  # noqa: BLE001
            res[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            _log(f"{name} failed: {exc}")
        torch.cuda.empty_cache()
        _write(res, args.json, t_all)
    for world, port in ((1, 29611), (2, 29621)) if "comm" in parts else ():
        _log(f"NCCL communicators, world size {world}")
        res[f"comm_world{world}"] = communicators(world, args.comm_reps, args.allreduce_mib * MiB, args.work,
                                                  port, deadline_s=90 if world == 1 else 60)
        _log(json.dumps({k: v for k, v in res[f"comm_world{world}"].items() if k != "traceback"})[:600])
    try:
        legacy = rows(res)
    except (KeyError, TypeError) as exc:  # a section that did not run or failed
        legacy = []
        _log(f"rows of the staging/comm sections incomplete: {exc!r}")
    res["rows"] = gp.rows(res) + legacy
    try:
        res["reading"] = reading(res)
    except (KeyError, TypeError):
        res["reading"] = []
    res["total_wall_s"] = time.monotonic() - t_all
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    for r in res["rows"]:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"- {r['what']} vs {r['baseline']}: {ratio} ({r['spread']}) {r['note']}")
    _log(f"wrote {args.json} in {res['total_wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
