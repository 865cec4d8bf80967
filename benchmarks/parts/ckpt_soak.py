"""Checkpoint benchmark, part 3: memory over many snapshots (``benchmarks/parts/ckpt.py --soak N``).

The reference job (the decoder example at its own size) on the embedded default, 2 x 2 ranks and the per-node
daemons, a snapshot every K updates until N snapshots are taken, then the job's own end snapshot.  The ranks and
daemons run as plain subprocesses (``ACCELPACT_ZYGOTE=0``: their command lines carry the run directory, so that
``ckpt_setup.process_rss_gib`` finds them); every second the ranks' and the daemons' RSS (summed by kind) and
this user's ``/dev/shm`` staging (``/dev/shm/accelpact-<uid>``: bytes of its files) are sampled with the number
of snapshots committed so far.  Growth is the median of the last fifth of the samples over the median of the
second fifth (the first holds the start-up and the slots' first touch).  After the job: what the staging root
still holds (nothing, when every slot and socket was removed).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.ckpt_setup import process_rss_gib


def staging_bytes(root: str) -> int:
    """Bytes of the regular files under ``root`` (0 when it does not exist); nothing is followed or opened."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += st.st_blocks * 512  # the pages a tmpfs file holds (a sparse slot counts what it touched)
    return total


def committed_so_far(events: Path, pos: list[int], seen: set[int]) -> int:
    """Snapshots committed on node 0 so far (the event log read on from ``pos[0]``)."""
    try:
        with open(events, "rb") as fh:
            fh.seek(pos[0])
            chunk = fh.read()
    except OSError:
        return len(seen)
    end = chunk.rfind(b"\n") + 1
    pos[0] += end
    for line in chunk[:end].splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "checkpoint" and ev.get("state") == "committed" and ev.get("node") in (0, None):
            seen.add(ev.get("step"))
    return len(seen)


def growth(values: list[float]) -> float | None:
    """Median of the last fifth over the median of the second fifth (None with too few samples or a zero)."""
    n = len(values)
    if n < 10:
        return None
    early, late = h.med(values[n // 5: 2 * n // 5]), h.med(values[4 * n // 5:])
    return None if not early else late / early


def soak(work: Path, snapshots: int, every: int, period_s: float = 1.0) -> dict[str, Any]:
    from benchmarks.parts.workload import write_job

    run_dir = work / "soak"
    config = work / "soak.yaml"
    steps = snapshots * every
    write_job(config, {"steps": steps, "log_every": 10_000, "checkpoint.every_steps": every,
                       "checkpoint.keep_last": 2, "checkpoint.milestone_every": 0})
    root = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"accelpact-{os.getuid()}")
    before = staging_bytes(root)
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    pos, seen = [0], set()

    def watch() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            rss = process_rss_gib(str(run_dir))
            samples.append({"t": round(time.monotonic() - t0, 1), **rss,
                            "shm_gib": round((staging_bytes(root) - before) / 2**30, 4),
                            "snapshots": committed_so_far(run_dir / "events.jsonl", pos, seen)})
            stop.wait(period_s)

    t = time.monotonic()
    thread = threading.Thread(target=watch, name="bench-soak", daemon=True)
    thread.start()
    try:
        code = h.launch_job(config, run_dir, extra_env={"ACCELPACT_ZYGOTE": "0"})
    finally:
        stop.set()
        thread.join(timeout=10)
    wall = time.monotonic() - t
    committed_so_far(run_dir / "events.jsonl", pos, seen)
    left = staging_bytes(root) - before
    events = [json.loads(ln) for ln in (run_dir / "events.jsonl").read_text().splitlines() if ln.strip()]
    skipped = [e for e in events if e.get("event") == "snapshot" and e.get("skipped")]
    running = [s for s in samples if s["ranks"] > 0]  # the samples while the ranks lived
    out: dict[str, Any] = {
        "snapshots_asked": snapshots, "every": every, "steps": steps, "exit_code": code, "wall_s": wall,
        "snapshots_committed_node0": len(seen), "snapshots_skipped": len({e.get("step") for e in skipped}),
        "staging_left_bytes": left, "samples": samples,
        "peak": {k: max((s[k] for s in running), default=None) for k in ("ranks", "daemons", "shm_gib")},
        "growth": {k: growth([s[k] for s in running]) for k in ("ranks", "daemons", "shm_gib")},
    }
    print(f"[bench] soak: {len(seen)} snapshots committed in {wall:.0f} s; RSS growth ranks "
          f"{out['growth']['ranks']}, daemons {out['growth']['daemons']}; /dev/shm left {left} bytes", flush=True)
    return out


def memory_goal(soak_res: dict[str, Any] | None) -> dict[str, Any] | None:
    """Bounded memory: no kind's RSS and not the staging grows beyond 5% over the soak; nothing left after it."""
    if not soak_res:
        return None
    g = soak_res["growth"]
    flat = all(v is not None and v <= 1.05 for v in (g["ranks"], g["daemons"])) and \
        (g["shm_gib"] is None or g["shm_gib"] <= 1.05)
    return {"goal": "RSS of the ranks and daemons and the /dev/shm staging flat over the soak (growth <= 1.05); "
                    "nothing left in /dev/shm after the job",
            "snapshots": soak_res["snapshots_committed_node0"], "growth": g,
            "staging_left_bytes": soak_res["staging_left_bytes"],
            "pass": flat and soak_res["staging_left_bytes"] == 0 and soak_res["exit_code"] == 0}


def soak_lines(soak_res: dict[str, Any] | None) -> list[str]:
    if not soak_res:
        return []
    g, pk = soak_res["growth"], soak_res["peak"]

    def f(v: float | None, spec: str = "{:.3f}") -> str:
        return "n/a" if v is None else spec.format(v)

    return ["", f"**Memory over {soak_res['snapshots_committed_node0']} snapshots** (`ckpt_soak.py`: the reference "
                f"job at its own size, 2 x 2 ranks, a snapshot every {soak_res['every']} updates for "
                f"{soak_res['steps']} updates, ranks and daemons as plain processes, sampled every second; "
                f"{len(soak_res['samples'])} samples, {soak_res['wall_s']:.0f} s): RSS growth (median of the last "
                f"fifth of the samples over the second fifth) ranks {f(g['ranks'])}, daemons {f(g['daemons'])}, "
                f"/dev/shm staging {f(g['shm_gib'])}; peaks ranks {f(pk['ranks'], '{:.2f}')} GiB, daemons "
                f"{f(pk['daemons'], '{:.2f}')} GiB, staging {f(pk['shm_gib'], '{:.3f}')} GiB (all four ranks, both "
                f"nodes); snapshots skipped {soak_res['snapshots_skipped']}; left in /dev/shm after the job: "
                f"{soak_res['staging_left_bytes']} bytes."]
