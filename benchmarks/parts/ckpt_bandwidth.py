"""Checkpoint benchmark, part 2: the daemon's write bandwidth against ``dd conv=fsync`` (``benchmarks/parts/ckpt.py``).

One node's snapshot (the same model + AdamW, two ranks' shards) staged once as the client stages it, then, per
round, three writes in the six orders in turn: the daemon's write path (``staging.read_descriptor`` + ``map_slot`` x2 + ``dcp_write.write_snapshot``: boxes
as DCP chunks in ``sink.WRITE_THREADS`` files written in parallel, each hashed while written and fsynced,
manifest, rename); the ceiling of the same shape (:func:`_write_ceiling`: as many files, threads, write-back
windows and fsyncs, the slots' own bytes, nothing else); and ``dd if=/dev/zero bs=4M conv=fsync`` of the same
size on the same filesystem (one stream, for reference).  After both writes of a pair the daemon's verification
runs on the snapshot (untimed in the ratio).  The process's CPU seconds of the write and of the verification
give the daemon's CPU per GiB by activity, beside the file digests' own cost here (BLAKE3, written; SHA-256, measured beside it).
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h

#: The orders of a round's three writes, in turn (6 rounds: each write first, second and third twice, and before
#: and after each other one three times).
ORDERS = tuple(itertools.permutations(("ours", "ceiling", "dd")))


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


def node_descs(model_cfg: dict[str, Any], stage_root: str, step: int, ranks: int = 2,
               seed: int = 0) -> tuple[list[dict[str, Any]], list[Any], int]:
    """One node's staged state as the client stages it: ``ranks`` ranks, each holding an FSDP1-like 1-D
    range (cut inside rows) of every parameter and of both AdamW moments, copied into its slot, plus its
    descriptor.  Returns (descriptors, slots, bytes)."""
    import json

    import torch

    from accelpact_slurm.runtime.state import appstate
    from benchmarks.parts.workload import model_of
    from ckpt_service import staging
    from ckpt_service.capture import Box, Entry, Plan, range_boxes

    torch.manual_seed(seed)
    model = model_of(model_cfg, seed)
    full = {n: p.detach() for n, p in model.named_parameters()}
    moments = {"exp_avg": {n: torch.randn_like(p) * 1e-3 for n, p in full.items()},
               "exp_avg_sq": {n: torch.rand_like(p) * 1e-6 for n, p in full.items()}}
    # the extra state as the client gathers it (``SnapshotClient.snapshot``): the run's, every rank's
    rank_state = {"rng": appstate.rng_state(), "state": {}}
    doc = {"run": {"step": 10, "epoch": 0, "losses": [1.0] * 10}, "ranks": {str(r): rank_state for r in range(4)}}
    meta = {"job_id": "bench", "config_digest": "0" * 64, "config": {}, "world_size": 4, "layout": [2, 2],
            "extra_json": json.dumps(doc), "capture": None}
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


def _payload(paths: list[Any]) -> int:
    """The bytes of the state the node's descriptors stage (every box's tensor bytes: no slot gap, no file
    padding)."""
    import torch

    from ckpt_service import staging

    total = 0
    for p in paths:
        for e in staging.read_descriptor(p)["entries"]:
            item = torch.empty((), dtype=getattr(torch, e["dtype"])).element_size()
            total += sum(math.prod(sizes) * item for _o, sizes, _b in e["boxes"])
    return total


def _write_ours(ndir: Path, step: int, paths: list[Any], parts: dict[str, float]) -> dict[str, Any]:
    """What the daemon's writer thread does with one node's descriptors; also its CPU seconds (every thread of
    this process: serialisation, the writes into the page cache, the digest while writing, fsync)."""
    import gc

    from ckpt_service import dcp_write, staging

    parts.clear()
    cpu = time.process_time()
    t = time.monotonic()
    descs = []
    for p in paths:
        d = staging.read_descriptor(p)
        d["buf"] = staging.map_slot(d["slot"], d["slot_ino"], d["nbytes"])
        descs.append(d)
    t_map = time.monotonic() - t
    timings: dict[str, float] = {}
    from_slot: dict[str, int] = {}
    _path, size = dcp_write.write_snapshot(str(ndir), step, descs, node="bench", timings=timings, from_slot=from_slot)
    total = time.monotonic() - t
    cpu = time.process_time() - cpu
    del descs
    gc.collect()
    res = {"ours_s": total, "ours_bytes": size, "map_s": t_map, "cpu_write_s": cpu, **dict(parts),
           "ours_from_slot_bytes": sum(from_slot.values())}
    res["dcp_save_s"] = timings.get("dcp_save", 0.0)  # serialise + write + digest + fsync, per file in parallel
    res["manifest_commit_s"] = total - t_map - parts.get("build_state", 0) - res["dcp_save_s"]
    return res


def _verify_ours(path: Path) -> dict[str, Any]:
    """The daemon's verification of the snapshot just written (re-read from the disk: the writer dropped its
    pages; the digest of every file; coverage), timed with its CPU seconds."""
    from ckpt_service.verify import verify_snapshot

    cpu = time.process_time()
    t = time.monotonic()
    ok, why = verify_snapshot(str(path), None)
    return {"verify_s": time.monotonic() - t, "cpu_verify_s": time.process_time() - cpu, "verify_ok": ok,
            "verify_reason": why}


def digest_rates(nbytes: int = 256 << 20, samples: int = 5) -> dict[str, float]:
    """CPU seconds per GiB that each file digest alone takes here (over an in-memory buffer, 4 MiB updates as the
    writer makes them), the algorithms alternated sample by sample; medians, as ``<algorithm>_alone``."""
    from ckpt_service import digest

    buf = memoryview(os.urandom(1 << 20) * (nbytes >> 20))
    got: dict[str, list[float]] = {alg: [] for alg in digest.ALGORITHMS}
    for i in range(samples):
        for alg in digest.ALGORITHMS if i % 2 == 0 else reversed(digest.ALGORITHMS):
            cpu = time.process_time()
            h = digest.new(alg)
            for j in range(0, len(buf), 4 << 20):
                h.update(buf[j:j + (4 << 20)])
            got[alg].append((time.process_time() - cpu) / (len(buf) / 2**30))
    return {f"{alg}_alone": sorted(v)[len(v) // 2] for alg, v in got.items()}


def _write_dd(ndir: Path, size: int) -> dict[str, Any]:
    count = -(-size // (4 << 20))
    f = ndir / "dd.bin"
    t = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=4M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    res = {"dd_s": time.monotonic() - t, "dd_bytes": count * (4 << 20)}
    f.unlink()
    return res


def _write_ceiling(ndir: Path, slots: list[Any], sizes: list[int]) -> dict[str, Any]:
    """The ceiling of the same shape as the daemon's write: ``sink.WRITE_THREADS`` files written in parallel,
    one thread each, the staged slots' own bytes in 4 MiB pieces through the writer's own :class:`sink.Sink`
    (direct I/O from the slot, as the writer's large boxes, where the file system allows it, else the page cache with the
    write-back started every ``sink.WRITEBACK_WINDOW`` bytes), then fsync -- the writer's pattern, without
    the serialisation, the digest, the manifest and the rename."""
    from ckpt_service import sink as fastpath

    bufs = [memoryview(s.buf[:n].numpy()).cast("B") for s, n in zip(slots, sizes)]
    total = sum(len(b) for b in bufs)
    threads = fastpath.WRITE_THREADS
    # the bytes of every slot, cut into `threads` runs of about the same length (as the writer spreads its boxes),
    # each on a page (as the writer's large boxes are: its sink writes them from the slot, so does the ceiling's)
    runs: list[list[memoryview]] = [[] for _ in range(threads)]
    per, at, k = -(-total // threads // 4096) * 4096, 0, 0
    for b in bufs:
        off = 0
        while off < len(b):
            n = min(len(b) - off, per * (k + 1) - at)
            runs[k].append(b[off:off + n])
            off += n
            at += n
            if at >= per * (k + 1):
                k = min(k + 1, threads - 1)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        sink = fastpath.Sink(str(ndir / f"ceiling-{i}.bin"))  # the writer's own sink: direct I/O where it is
        try:
            for run in runs[i]:
                for j in range(0, len(run), 4 << 20):
                    sink.put(run[j:j + (4 << 20)])
            sink.finish()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        finally:
            sink.close()

    cpu = time.process_time()
    t = time.monotonic()
    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    res = {"ceiling_s": time.monotonic() - t, "ceiling_bytes": total, "ceiling_files": threads,
           "cpu_ceiling_s": time.process_time() - cpu}
    for i in range(threads):
        (ndir / f"ceiling-{i}.bin").unlink(missing_ok=True)
    if errors:
        raise errors[0]
    return res


def bench_bandwidth(model_cfg: dict[str, Any], work: Path, pairs: int) -> dict[str, Any]:
    """Paired, interleaved: the daemon's write of one node's snapshot vs dd conv=fsync of the same size."""
    import gc
    import warnings

    from ckpt_service import dcp_write, digest, sink as fastpath, staging

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    stage_root = tempfile.mkdtemp(prefix="accelpact-bench-stage-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ndir = work / "bw-node"
    ndir.mkdir(parents=True, exist_ok=True)
    parts: dict[str, float] = {}
    orig = dcp_write.build_state
    dcp_write.build_state = _timed(dcp_write.build_state, parts, "build_state")
    rows = []
    try:
        # staged once (as a rank stages it: the slots and descriptors stay valid), written once per pair
        paths, slots, staged = node_descs(model_cfg, stage_root, 0)
        payload = _payload(paths)
        sizes = [staging.read_descriptor(p)["nbytes"] for p in paths]
        for i in range(pairs):
            step = i + 1
            os.sync()
            res: dict[str, Any] = {"pair": i}
            # the three writes in the six orders in turn: every write before and after every other equally often
            order = list(ORDERS[i % len(ORDERS)])
            res["order"] = order
            for which in order:
                os.sync()  # every write starts with no dirty pages of another
                if which == "ours":
                    res.update(_write_ours(ndir, step, paths, parts))
                elif which == "ceiling":
                    res.update(_write_ceiling(ndir, slots, sizes))
                else:
                    res.update(_write_dd(ndir, res.get("ours_bytes") or staged))
            res.update(_verify_ours(ndir / f"step-{step:010d}"))  # after both: it reads while nothing writes
            shutil.rmtree(ndir / f"step-{step:010d}", ignore_errors=True)
            gc.collect()
            os.sync()
            # ours and the ceiling by the same bytes: the state's (each file's own padding is not throughput)
            res["state_bytes"] = payload
            res["ours_GBps"] = payload / res["ours_s"] / 1e9
            res["dd_GBps"] = res["dd_bytes"] / res["dd_s"] / 1e9
            res["ceiling_GBps"] = payload / res["ceiling_s"] / 1e9
            res["ratio_full"] = res["ours_GBps"] / res["dd_GBps"]
            res["ratio_ceiling"] = res["ours_GBps"] / res["ceiling_GBps"]
            res["ours_before_ceiling"] = order.index("ours") < order.index("ceiling")
            rows.append(res)
            print(f"[bench] bandwidth pair {i + 1}/{pairs} ({' > '.join(order)}): ours {res['ours_GBps']:.2f} GB/s, "
                  f"ceiling {res['ceiling_GBps']:.2f} GB/s, dd {res['dd_GBps']:.2f} GB/s", flush=True)
    finally:
        dcp_write.build_state = orig
        shutil.rmtree(stage_root, ignore_errors=True)
        shutil.rmtree(ndir, ignore_errors=True)
    out: dict[str, Any] = {"pairs": rows, "filesystem": h.fs_type(str(work)), "write_threads": fastpath.WRITE_THREADS}
    for key in ("ratio_full", "ratio_ceiling", "ours_GBps", "ceiling_GBps", "dd_GBps"):
        out[key] = h.spread([r[key] for r in rows])
    # the share of the state's bytes the writer's sink wrote from the slots as they lay (no copy)
    out["from_slot_share"] = h.spread([r.get("ours_from_slot_bytes", 0) / r["state_bytes"] for r in rows])
    # ours against the ceiling of its shape, apart by which of the two ran first
    out["ratio_ceiling_by_order"] = {
        "ours_first": h.spread([r["ratio_ceiling"] for r in rows if r["ours_before_ceiling"]]),
        "ceiling_first": h.spread([r["ratio_ceiling"] for r in rows if not r["ours_before_ceiling"]])}
    for key in ("map_s", "build_state", "dcp_save_s", "manifest_commit_s", "ours_s", "ceiling_s", "dd_s",
                "verify_s"):
        out.setdefault("parts_median_s", {})[key] = h.med([r.get(key, 0.0) for r in rows])
    # the daemon's CPU per GiB written, by activity (process CPU time, every thread)
    out["cpu_s_per_gib"] = {
        "write": h.med([r["cpu_write_s"] / (r["state_bytes"] / 2**30) for r in rows]),
        "verify": h.med([r["cpu_verify_s"] / (r["state_bytes"] / 2**30) for r in rows]),
        # the kernel's own cost of getting the bytes to the disk this way (copies into the page cache, write-back,
        # fsync): what any write path of this shape spends, with no serialisation and no digest
        "ceiling_write": h.med([r["cpu_ceiling_s"] / (r["state_bytes"] / 2**30) for r in rows
                                if r.get("cpu_ceiling_s") is not None]),
        **digest_rates(),
    }
    out["digest"] = digest.WRITE
    out["verified_all"] = all(r.get("verify_ok") for r in rows)
    return out
