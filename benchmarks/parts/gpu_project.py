"""The project's own checks on a GPU (parts ``examples``, ``qualify``, ``floor`` and ``multigpu`` of
``scripts/gpu_check.py``).  Each runs the project's real entry points as subprocesses (``accelpact-run``,
``accelpact-qualify``, ``pytest``) with ``topology.device`` set, so the same code rehearses on the CPU
(``--device cpu``) before a GPU run.

- ``examples``: both examples on one rank (1 node x 1 rank, FSDP2: FSDP1 refuses HYBRID_SHARD with one
  rank per node): an uninterrupted run, then a run with a fault in forward after update 15 (``forward:15:0``
  is always L2): the job fails stop, the embedded launcher relaunches it, the restart loads the newest
  verified snapshot (taken from GPU memory through the page-locked slot) and replays; its final digest
  must equal the uninterrupted run's, and the replay check must confirm the snapshot.
- ``qualify``: ``accelpact-qualify --phase backward`` of the decoder at 1 x 1: a reference run and three
  trials, each with a real backward fault (the rank withholds its replication all-reduce), repaired in
  process: the update is discarded, both groups replaced by new NCCL communicators, every reference
  rebound (the invariant scan), validated, the retired communicators aborted in the background; the
  trial passes when the final digest equals the reference.  The repairs' per-phase timings come from
  the trials' ``repair`` events.
- ``floor``: creating one communicator with the same members (``torch_compat.build_group``, eager, bound to
  the GPU) plus its first all-reduce, the floor a repair is compared with; and its abort in the background.
- ``multigpu``: ``pytest -m multigpu`` (L1 on NCCL with a real fault between two GPUs; skipped with its
  reason on one GPU).
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (example, steps, the fault's update, the snapshot cadence)
EXAMPLES = (("decoder", 25, 15, 10), ("vision", 24, 15, 8))


def _log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def job_file(example: str, work: str, device: str, *, steps: int | None = None, every: int | None = None) -> str:
    """The example's own job file at 1 node x 1 rank on ``device``, FSDP2, its entry made absolute."""
    import yaml

    src = os.path.join(REPO, "examples", example, "job.yaml")
    with open(src, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    module, _, fn = cfg["entry"].partition(":")
    cfg["entry"] = f"{os.path.join(REPO, 'examples', example, module)}.py:{fn}"
    cfg["topology"].update(nodes=1, ranks_per_node=1, device=device)
    cfg["params"]["fsdp"] = "fsdp2"
    cfg["params"].pop("mesh", None) if cfg["params"].get("mesh") == "group_pair" else None
    if steps is not None:
        cfg["steps"] = steps
    if every is not None:
        cfg["checkpoint"]["every_steps"] = every
    cfg["checkpoint"]["local_dir"] = os.path.join(work, f"{example}-{device}-nvme")
    path = os.path.join(work, f"{example}-{device}.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg, fh, sort_keys=False)
    return path


def _run(cmd: list[str], log_path: str, timeout_s: float, env: dict[str, str] | None = None) -> tuple[int | None, float]:
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env or dict(os.environ),
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
            rc = None
    return rc, time.monotonic() - t0


def _events(run_dir: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(os.path.join(run_dir, "events.jsonl"), encoding="utf-8") as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def _summary(run_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-n:])
    except OSError:
        return ""


def examples(work: str, device: str, timeout_s: float = 240) -> dict[str, Any]:
    """Part 1: each example uninterrupted, and with an L2 restart from a snapshot of GPU memory (see module doc)."""
    res: dict[str, Any] = {}
    for example, steps, fault_step, every in EXAMPLES:
        cfg = job_file(example, work, device, steps=steps, every=every)
        rec: dict[str, Any] = {"steps": steps, "fault": f"forward:{fault_step}:0", "snapshot_every": every}
        for name, extra in (("plain", []), ("l2", ["--inject-fault", f"forward:{fault_step}:0"])):
            run_dir = os.path.join(work, f"{example}-{device}-{name}")
            log_path = run_dir + ".log"
            rc, wall = _run([sys.executable, "-m", "accelpact_slurm.cli.run", cfg, "--run-dir", run_dir, *extra],
                            log_path, timeout_s)
            ev = _events(run_dir)
            summ = _summary(run_dir)
            start = next((e for e in ev if e["event"] == "job_start"), {})
            snaps = [e for e in ev if e["event"] == "snapshot" and not e.get("skipped")]
            rec[name] = {
                "rc": rc, "wall_s": round(wall, 2), "digest": summ.get("final_state_digest"),
                "final_step": summ.get("final_step"), "device": start.get("device"), "backend": start.get("backend"),
                "versions": start.get("versions"), "restarts": summ.get("restart_count"),
                "snapshots": len(snaps),
                "snapshot_blocking_s": statistics.median([e["blocking_s"] for e in snaps]) if snaps else None,
                "verified": sorted({e.get("step") for e in ev if e["event"] == "checkpoint" and e.get("verified")}),
                "restart_load": [{k: e.get(k) for k in ("step", "reason", "load_s")} for e in ev
                                 if e["event"] == "restart_load"],
                "replay_check": [{k: e.get(k) for k in ("snapshot", "verdict", "reason")} for e in ev
                                 if e["event"] == "replay_check"],
                "fail_stop": [e.get("reason") for e in ev if e["event"] == "fail_stop"][:2],
            }
            if rc != 0:
                rec[name]["tail"] = _tail(log_path)
            _log(f"{example} {name}: rc {rc} in {wall:.1f} s, device {start.get('device')}, final step "
                 f"{summ.get('final_step')}, digest {str(summ.get('final_state_digest'))[:16]}")
        plain, l2 = rec["plain"], rec["l2"]
        loads = [r for r in l2["restart_load"] if r.get("step") is not None]
        verdicts = [r["verdict"] for r in l2["replay_check"]]
        rec["ok"] = bool(plain["rc"] == 0 and l2["rc"] == 0 and plain["digest"] and plain["digest"] == l2["digest"]
                         and loads and "match" in verdicts)
        rec["why"] = ("digest equal to the uninterrupted run's after an L2 restart from snapshot "
                      f"{loads[-1]['step'] if loads else '?'}, replay check {verdicts}" if rec["ok"] else
                      f"plain rc {plain['rc']}, l2 rc {l2['rc']}, digests {str(plain['digest'])[:12]} / "
                      f"{str(l2['digest'])[:12]}, loads {loads}, replay {verdicts}")
        _log(f"{example}: {'OK' if rec['ok'] else 'FAILED'}: {rec['why']}")
        res[example] = rec
    return res


_PHASE_RE = re.compile(r"trial (\d+)/(\d+) (\S+): (ok|FAILED)")


def qualify(work: str, device: str, timeout_s: float = 300, steps: int = 10) -> dict[str, Any]:
    """Part 2: ``accelpact-qualify --phase backward`` of the decoder at 1 x 1; the repairs' per-phase timings."""
    cfg = job_file("decoder", work, device, steps=steps, every=0)
    env_file = os.path.join(work, f"envelope-{device}.yaml")
    qdir = os.path.join(work, f"qualify-{device}")
    os.makedirs(qdir, exist_ok=True)
    log_path = os.path.join(work, f"qualify-{device}.log")
    rc, wall = _run([sys.executable, "-m", "accelpact_slurm.cli.qualify", cfg, "--phase", "backward", "--steps",
                     str(steps), "--envelope", env_file, "--work-dir", qdir], log_path, timeout_s)
    text = _tail(log_path, 40)
    repairs = []
    for run_dir in sorted(glob.glob(os.path.join(qdir, "*", "trial-*"))):
        for e in _events(run_dir):
            if e["event"] == "repair":
                repairs.append({k: e.get(k) for k in ("phases", "total_s", "fault_to_resume_s", "rebound",
                                                      "rebound_by_kind", "scope", "key")})
    phases: dict[str, list[float]] = {}
    for r in repairs:
        for k, v in (r.get("phases") or {}).items():
            phases.setdefault(k, []).append(v)
    res = {"rc": rc, "wall_s": round(wall, 1), "trials": _PHASE_RE.findall(text), "repairs": repairs,
           "phase_median_s": {k: statistics.median(v) for k, v in phases.items()},
           "total_median_s": statistics.median([r["total_s"] for r in repairs]) if repairs else None,
           "log_tail": text[-3000:]}
    try:
        with open(env_file, encoding="utf-8") as fh:
            res["envelope"] = fh.read()
    except OSError:
        res["envelope"] = None
    # The keys this machine's own torch qualified (or failed), as a user's envelope would hold them.
    from accelpact_slurm.runtime.job import envelope as env_mod

    res["keys"] = [{"key": str(e.key), "actions": list(e.actions), "torch": e.evidence.get("torch")}
                   for e in env_mod.load_file(env_file).entries]
    res["ok"] = rc == 0 and len(repairs) >= 3
    _log(f"qualify: rc {rc} in {wall:.0f} s, {len(repairs)} repairs, phases {res['phase_median_s']}")
    return res


def _floor_worker(device: str, reps: int, out_path: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, REPO)
    from accelpact_slurm.repair import torch_compat as tc

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=__import__("datetime").timedelta(seconds=60))
    dist.init_process_group("cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo",
                            store=dist.PrefixStore("data", store), rank=0, world_size=1)
    build, first, retire_call, abort = [], [], [], []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        pg = tc.build_group([0], dist.PrefixStore(f"floor/{i}", store), f"floor-{i}", 30.0, dev)
        t1 = time.perf_counter()
        x = torch.ones(1, device=dev)
        dist.all_reduce(x, group=pg)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        thread = tc.retire_group(pg)
        t3 = time.perf_counter()
        if thread is not None:
            thread.join(60)
        t4 = time.perf_counter()
        if i:  # the first build pays one-time set-up
            build.append(t1 - t0)
            first.append(t2 - t1)
            retire_call.append(t3 - t2)
            abort.append(t4 - t3)
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump({"build_s": build, "first_allreduce_s": first, "retire_call_s": retire_call,
                   "background_abort_s": abort}, fh)
    dist.destroy_process_group()


def floor(work: str, device: str, reps: int = 5, timeout_s: float = 120) -> dict[str, Any]:
    """Part 2's floor: one communicator built (members only, eager) + its first all-reduce; its retirement."""
    out_path = os.path.join(work, f"floor-{device}.json")
    code = (f"import sys; sys.path.insert(0, {REPO!r}); "
            f"from benchmarks.parts.gpu_project import _floor_worker; _floor_worker({device!r}, {reps}, {out_path!r}, 29651)")
    log_path = os.path.join(work, f"floor-{device}.log")
    rc, wall = _run([sys.executable, "-c", code], log_path, timeout_s)
    try:
        with open(out_path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return {"rc": rc, "error": "no result", "tail": _tail(log_path)}
    med = {k: statistics.median(v) for k, v in raw.items() if v}
    _log(f"floor: {json.dumps({k: round(v * 1000, 2) for k, v in med.items()})} (ms)")
    return {"rc": rc, "raw": raw, "median_s": med, "floor_s": med["build_s"] + med["first_allreduce_s"]}


def multigpu(work: str, timeout_s: float = 300) -> dict[str, Any]:
    """Part 3: ``pytest -m multigpu``; its outcome line (passed, or skipped with the reason)."""
    log_path = os.path.join(work, "multigpu.log")
    rc, wall = _run([sys.executable, "-m", "pytest", "-m", "multigpu", "-rs", "-q", "-p", "no:cacheprovider",
                     "tests/gpu"], log_path, timeout_s)
    text = _tail(log_path, 30)
    _log(f"multigpu: rc {rc} in {wall:.0f} s: {text.strip().splitlines()[-1] if text.strip() else ''}")
    return {"rc": rc, "wall_s": round(wall, 1), "tail": text}


def rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Summary rows (what / baseline / ratio / spread / n / note) of the project's GPU checks."""
    out = []
    for example, rec in (res.get("examples") or {}).items():
        if not isinstance(rec, dict) or "l2" not in rec:
            continue
        out.append({"what": f"{example} example on one GPU, L2 restart from a GPU snapshot ({rec['fault']})",
                    "baseline": "the uninterrupted GPU run", "ratio": 1.0 if rec["ok"] else None,
                    "spread": "bitwise" if rec["ok"] else "differs", "n": 1,
                    "note": ("final_state_digest equal; " if rec["ok"] else "FAILED: ") + rec["why"]})
    q, fl = res.get("qualify") or {}, res.get("floor") or {}
    if q.get("total_median_s") is not None and fl.get("floor_s"):
        phases = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in q["phase_median_s"].items())
        out.append({"what": "L1 repair of a backward fault on NCCL, 1 x 1 (accelpact-qualify trials)",
                    "baseline": "one NCCL communicator built + first all-reduce",
                    "ratio": q["total_median_s"] / fl["floor_s"],
                    "spread": "–".join(f"{min(t) / fl['floor_s']:.2f}" if i == 0 else f"{max(t) / fl['floor_s']:.2f}"
                                       for i, t in enumerate([[r["total_s"] for r in q["repairs"]]] * 2)),
                    "n": len(q["repairs"]),
                    "note": f"total {q['total_median_s'] * 1000:.1f} ms ({phases}); floor "
                            f"{fl['floor_s'] * 1000:.1f} ms; retired communicator aborted in the background in "
                            f"{fl['median_s'].get('background_abort_s', 0) * 1000:.0f} ms; qualify rc {q['rc']}"})
    mg = res.get("multigpu") or {}
    if mg.get("tail"):
        line = [x for x in mg["tail"].strip().splitlines() if x.strip()][-1]
        reason = next((x.split(": ", 1)[-1] for x in mg["tail"].splitlines() if x.startswith("SKIPPED")), "")
        out.append({"what": "pytest -m multigpu: L1 on NCCL with a real fault between two GPUs, digest equality",
                    "baseline": "the uninterrupted two-GPU run", "ratio": None, "spread": "", "n": 0,
                    "note": f"{line}" + (f": {reason}" if reason else "")})
    return out
