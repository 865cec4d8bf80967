#!/usr/bin/env python3
"""A fault campaign: the decoder job on the embedded default, ONE fault per run, every run checked.

Each run starts ``accelpact-run`` on a tiny decoder job (``examples/decoder/job.yaml`` with few updates, snapshots
every few updates, a narrow model: 2 emulated nodes x 2 ranks) and injects one fault of a kind drawn from
:data:`campaign_kinds.KINDS` at a random update and phase (``scripts/campaign_kinds.py`` says how each is made).
A run passes when all of these hold:

- the job ends with the uninterrupted run's ``final_state_digest`` (one uninterrupted run per job shape, cached
  in ``--out``), or with a stop the kind documents (:data:`campaign_kinds.NAMED_STOPS`);
- no temporary directory is left: no ``.tmp-*``/``.del-*`` in the node directories or the shared tier, no
  ``/dev/shm`` staging of the run's nodes, no process of the run;
- no verified snapshot is lost: every snapshot any node's index listed as verified while the job ran is still
  there (its directory and manifest) at the end, unless that node's index then lists ``keep_last`` newer verified
  ones (retention's deletions);
- a straggler is waited for: no repair, no restart;
- a killed daemon's node still has its last snapshot: the job's final update verified in that node's index (the
  launcher started a new daemon);
- the run ends within its deadline (``--deadline-s``).

Per run: kind, update, phase, result (``bitwise`` / ``stop: NAME`` / ``FAIL: reason``), the time back to training
(from the fault to the next committed update in ``events.jsonl``) and the restarts.  ``--json`` gets every run;
``--markdown`` a table per kind (runs, bitwise, median time back to training) that can go into ``docs/``.

Usage::

    python scripts/campaign.py --runs 20 --seed 7 --out /tmp/campaign --json campaign.json
    python scripts/campaign.py --runs 4 --kinds kill_rank,link_backward
    make campaign CAMPAIGN_ARGS="--runs 10"

Exit status: 0 when every run passed, 1 otherwise, 2 on bad arguments.  The disk-full kind mounts a tmpfs (root
only; it is skipped with a note otherwise).  As a ``make bench`` part (``--json X --markdown ''``) it writes the
harness's result shape (``rows``, ``summary``).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import campaign_kinds as ck  # noqa: E402
from ckpt_service.layout import DEL_PREFIX, TMP_PREFIX, staging_root  # noqa: E402

__all__ = ["summary_rows", "markdown", "main"]

JOB = REPO / "examples" / "decoder" / "job.yaml"
#: The tiny job: ~15-25 s a run on 2 loaded cores.  ``every_steps`` 3 puts snapshots at 3, 6, 9 (12 is the final).
SHAPE = {"steps": 12, "every_steps": 3, "nodes": 2, "ranks_per_node": 2, "layers": 2, "width": 16, "keep_last": 2}
#: Shorter than the example's (5 / 30 / 10 s): a dead rank's L2 and a hang's verdict come sooner; same digest.
TIMEOUTS = {"collective_s": 3, "control_s": 12, "shutdown_s": 5}
POLL_S = 0.05  # the monitor's tick: how often it reads new events
LEFTOVER_GRACE_S = 10.0
MARK = "<!-- campaign-bench -->"


def log(msg: str) -> None:
    print(f"[campaign {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ====================================================================== the job


def job_text(shape: dict[str, int], local_dir: str | None = None) -> str:
    """The decoder example's job file, made tiny (``shape``), its entry absolute; ``local_dir``: the node-local
    directory's parent (``checkpoint.local_dir``)."""
    text = JOB.read_text()
    entry = JOB.parent
    text = re.sub(r"^entry: (\w+):(\w+)", lambda m: f"entry: {entry / m.group(1)}.py:{m.group(2)}", text,
                  count=1, flags=re.M)
    subs = {r"^steps: \d+": f"steps: {shape['steps']}", r"^log_every: \d+": "log_every: 1",
            r"^(\s+)every_steps: \d+": rf"\g<1>every_steps: {shape['every_steps']}",
            r"^(\s+)keep_last: \d+": rf"\g<1>keep_last: {shape['keep_last']}",
            r"^(\s+)layers: \d+": rf"\g<1>layers: {shape['layers']}",
            r"^(\s+)width: \d+": rf"\g<1>width: {shape['width']}",
            r"^(\s+)nodes: \d+": rf"\g<1>nodes: {shape['nodes']}",
            r"^(\s+)ranks_per_node: \d+": rf"\g<1>ranks_per_node: {shape['ranks_per_node']}"}
    subs.update({rf"^(\s+){k}: [0-9.]+": rf"\g<1>{k}: {v}" for k, v in TIMEOUTS.items()})
    for pat, rep in subs.items():
        text, n = re.subn(pat, rep, text, count=1, flags=re.M)
        if n != 1:
            raise SystemExit(f"campaign: {JOB} has no line matching {pat!r}: update SHAPE's substitutions")
    if local_dir:
        text = re.sub(r"^(\s+)keep_last:", rf"\g<1>local_dir: {local_dir}\n\g<1>keep_last:", text, count=1, flags=re.M)
    return text


def shape_key(shape: dict[str, int]) -> str:
    return hashlib.sha256(job_text(shape).encode()).hexdigest()[:16]


def read_events(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
    except FileNotFoundError:
        pass
    return out


def launch(job: str, run_dir: str, job_id: str, env_extra: dict[str, str], args: list[str],
           log_path: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), ACCELPACT_LOCAL_JOB_ID=job_id, PYTHONUNBUFFERED="1", **env_extra)
    env.setdefault("XDG_CONFIG_HOME", tempfile.mkdtemp(prefix="accelpact-campaign-config-"))  # no user envelope
    out = open(log_path, "w")  # noqa: SIM115 - the child holds it; closed below
    try:
        return subprocess.Popen([sys.executable, "-m", "accelpact_slurm.cli.run", job, "--run-dir", run_dir, *args],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    finally:
        out.close()


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (the run's launcher started its own session)."""
    pids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.split("/")[2]))
    return pids


# ====================================================================== the reference


def reference(out: Path, shape: dict[str, int], deadline_s: float) -> str:
    """The uninterrupted run's ``final_state_digest`` for ``shape``, cached in ``out/reference.json``."""
    cache = out / "reference.json"
    known = json.loads(cache.read_text()) if cache.exists() else {}
    key = shape_key(shape)
    if key in known:
        return known[key]
    run_dir = out / f"reference-{key}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    job = out / f"job-{key}.yaml"
    job.write_text(job_text(shape))
    log(f"uninterrupted reference run ({key})")
    proc = launch(str(job), str(run_dir), f"campaign-ref-{key}", {}, [], str(out / f"reference-{key}.log"))
    try:
        code = proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"campaign: the uninterrupted run passed its deadline ({deadline_s:.0f} s)") from None
    ends = [e for e in read_events(str(run_dir / "events.jsonl")) if e.get("event") == "job_end"]
    if code != 0 or not ends:
        raise SystemExit(f"campaign: the uninterrupted run failed (exit {code}); see {out}/reference-{key}.log")
    known[key] = ends[-1]["final_state_digest"]
    cache.write_text(json.dumps(known, indent=1))
    return known[key]


# ====================================================================== one run


class Verified:
    """Every snapshot each node's index lists as verified at any poll: ``{node: {step: path}}``."""

    def __init__(self, run_dir: str):
        self.dir = os.path.join(run_dir, "ckpt-index")
        self.seen: dict[str, dict[int, str]] = {}

    def poll(self) -> None:
        for path in glob.glob(os.path.join(self.dir, "node*.json")):
            if path.endswith(".committed.json") or ".daemon-failed" in path:
                continue
            try:
                with open(path) as fh:
                    idx = json.load(fh)
            except (OSError, ValueError):
                continue
            for s in idx.get("snapshots") or []:
                if s.get("state") == "verified":
                    self.seen.setdefault(idx.get("node") or os.path.basename(path)[:-5], {})[s["step"]] = s["path"]

    def lost(self, keep_last: int) -> list[str]:
        """Snapshots seen verified that are gone at the end without ``keep_last`` newer verified ones."""
        self.poll()
        lost = []
        for node, steps in self.seen.items():
            try:
                with open(os.path.join(self.dir, f"{node}.json")) as fh:
                    final = {s["step"]: s for s in json.load(fh).get("snapshots") or []}
            except (OSError, ValueError):
                final = {}
            for step, path in sorted(steps.items()):
                if step in final:  # still listed: its files must be there (and it must still be verified)
                    if not os.path.isfile(os.path.join(path, "manifest.json")):
                        lost.append(f"{node} step {step} (in the index, files gone)")
                    elif final[step].get("state") != "verified":
                        lost.append(f"{node} step {step} (verified, then {final[step].get('state')})")
                    continue
                newer = [s for s, r in final.items() if s > step and r.get("state") == "verified"]
                if len(newer) < keep_last:  # else retention's deletion: keep_last newer verified ones stand in
                    lost.append(f"{node} step {step} (gone)")
        return lost


def last_snapshot(run_dir: str, node: str, step: int) -> str | None:
    """Why ``node``'s index does not list the job's last update ``step`` as verified; None when it does.  A node
    whose daemon was killed mid-job gets a new one from the launcher: its final snapshot is written all the same."""
    try:
        with open(os.path.join(run_dir, "ckpt-index", f"{node}.json")) as fh:
            snaps = {s.get("step"): s.get("state") for s in json.load(fh).get("snapshots") or []}
    except (OSError, ValueError) as exc:
        return f"{node} has no readable index ({exc.__class__.__name__})"
    if snaps.get(step) != "verified":
        return (f"{node}'s last snapshot (update {step}) is {snaps.get(step) or 'not in its index'} "
                f"(verified: {sorted(k for k, v in snaps.items() if v == 'verified')})")
    return None


def leftovers(run_dir: str, local_parent: str) -> list[str]:
    """Temporary directories and staging the run left."""
    left = []
    for d in glob.glob(os.path.join(local_parent, "node*")) + [os.path.join(run_dir, "shared-ckpt")]:
        for name in (os.listdir(d) if os.path.isdir(d) else []):
            if name.startswith((TMP_PREFIX, DEL_PREFIX)):
                left.append(os.path.join(d, name))
        stage = staging_root(d)
        if os.path.isdir(stage):
            left.append(stage)
    return left


def time_back(events: list[dict[str, Any]], fault_ts: float | None) -> float | None:
    """Seconds from the fault to the next committed update of the recovery: the first update of a later start when
    the fault's start was restarted, else the first after an L1 repair that followed the fault, else rank 0's next
    ``step`` event (a fault that never stopped training: a straggler, a daemon's)."""
    if fault_ts is None:
        return None
    steps = [e for e in events if e.get("event") == "step"]
    started = [e.get("restart") or 0 for e in events if e["ts"] <= fault_ts and e.get("restart") is not None]
    at = max(started, default=0)
    later = [e["ts"] for e in steps if (e.get("restart") or 0) > at]
    if not later:
        repairs = [e["ts"] for e in events if e.get("event") == "repair" and e["ts"] > fault_ts]
        since = min(repairs) if repairs else fault_ts
        later = [e["ts"] for e in steps if e["ts"] > since]
    return round(min(later) - fault_ts, 3) if later else None


def one_run(i: int, fault: ck.Fault, out: Path, ref: str, deadline_s: float, seed: int,
            env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the job once with ``fault``; return its record (``result``: bitwise / stop: NAME / FAIL: reason)."""
    name = f"run-{i:03d}-{fault.kind}"
    run_dir = out / name
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    local = str(run_dir / "nvme") if fault.kind == "disk_full" else None
    job = run_dir.parent / f"{name}.yaml"
    job.write_text(job_text(fault.shape, local))
    job_id = f"campaign-{seed}-{i}"
    rec: dict[str, Any] = {"run": i, **fault.describe(), "run_dir": str(run_dir)}
    problems: list[str] = []
    t0 = time.monotonic()
    proc, code = None, None
    verified = Verified(str(run_dir))
    events: list[dict[str, Any]] = []
    try:
        fault.prepare(str(run_dir), job_id, local)
        proc = launch(str(job), str(run_dir), job_id, {**fault.env(), **(env_extra or {})}, fault.args(),
                      str(out / f"{name}.log"))
        while proc.poll() is None:
            if time.monotonic() - t0 > deadline_s:
                problems.append(f"deadline {deadline_s:.0f} s passed")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                break
            events = read_events(str(run_dir / "events.jsonl"))
            fault.poll(str(run_dir), events, local)
            verified.poll()
            time.sleep(POLL_S)  # the monitor's tick, not a synchronisation
        code = proc.returncode
        left_procs = group_pids(proc.pid)
        end = time.monotonic() + LEFTOVER_GRACE_S
        while left_procs and time.monotonic() < end:  # the launcher's children end with it
            time.sleep(0.2)
            left_procs = group_pids(proc.pid)
        if left_procs:
            problems.append(f"processes of the run left: {left_procs}")
            os.killpg(proc.pid, signal.SIGKILL)
        lost = verified.lost(fault.shape["keep_last"])  # before the fault's clean-up (disk_full's unmount)
        if lost:
            problems.append(f"verified snapshot(s) lost: {', '.join(lost)}")
        if fault.kind == "kill_daemon" and code == 0:  # the killed daemon's node snapshots to the end
            why = last_snapshot(str(run_dir), f"node{fault.node + 1}", fault.shape["steps"])
            if why:
                problems.append(why)
        left = leftovers(str(run_dir), local or str(run_dir / "node-local"))
        if left:
            problems.append(f"temporary directories left: {', '.join(left)}")
    except (OSError, subprocess.SubprocessError) as exc:  # the fault could not be set up (a mount, a port)
        problems.append(f"the run could not be set up or watched: {exc}")
    finally:
        problems += fault.cleanup()
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    events = read_events(str(run_dir / "events.jsonl"))
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    rec["exit_code"] = code
    rec["restarts"] = max((e.get("restart") or 0 for e in events), default=0)
    rec["time_back_s"] = time_back(events, fault.fault_ts(events))
    rec["notes"] = fault.notes
    if fault.injected_ts is None and fault.fault_ts(events) is None and fault.kind != "squat_ports":
        problems.append("the fault was never injected (its moment did not come)")
    if fault.kind == "squat_ports":  # the start found its store past the squatted ports, at a derived one
        ports, wrong = fault.store_ports(events)
        rec["store_ports"] = {str(k): v for k, v in ports.items()}
        problems += wrong
    if fault.kind == "straggler":
        repaired = [e["event"] for e in events if e.get("event") in ("repair", "repair_rank", "fault", "fail_stop")]
        if repaired:
            problems.append(f"the straggler was not waited for: {sorted(set(repaired))}")
    ends = [e for e in events if e.get("event") == "job_end"]
    stops = [e for e in events if e.get("event") == "fail_stop"]
    digest = ends[-1].get("final_state_digest") if ends else None
    if code == 0 and digest == ref:
        outcome = "bitwise"
    elif code == 0:
        outcome = None
        problems.append(f"final_state_digest {str(digest)[:12]} differs from the uninterrupted run's {ref[:12]}")
    else:
        why = (stops[-1].get("reason") or "") if stops else ""
        named = [nm for text, nm in ck.NAMED_STOPS.get(fault.kind, []) if text in why]
        outcome = f"stop: {named[0]}" if named else None
        if not named:
            problems.append(f"exit {code}: {why[:300] or 'no fail_stop event'}")
    rec["result"] = outcome if not problems and outcome else "FAIL: " + "; ".join(problems)
    rec["passed"] = not rec["result"].startswith("FAIL")
    return rec


# ====================================================================== the campaign


def plan(runs: int, seed: int, kinds: list[str], shape: dict[str, int]) -> list[ck.Fault]:
    """``runs`` faults: the kinds in turn (each kind equally often), phase/update/rank drawn from ``seed``."""
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(runs)]
    return [ck.draw(kind, rng, shape) for kind in order]


def kind_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per kind: runs, passed, bitwise, median time back to training (of the passed runs)."""
    rows = []
    for kind in [k for k in ck.KINDS if any(r["kind"] == k for r in res.get("runs", []))]:
        rs = [r for r in res["runs"] if r["kind"] == kind]
        back = [r["time_back_s"] for r in rs if r.get("time_back_s") is not None and r["passed"]]
        rows.append({"kind": kind, "runs": len(rs), "passed": sum(r["passed"] for r in rs),
                     "bitwise": sum(r["result"] == "bitwise" for r in rs),
                     "median_time_back_s": round(statistics.median(back), 2) if back else None,
                     "phases": sorted({r["phase"] for r in rs})})
    return rows


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark overview's rows (``benchmarks/harness/``'s shape): one per kind, no ratio."""
    return [{"what": f"fault campaign: {r['kind']}", "baseline": "the uninterrupted run's final_state_digest",
             "ratio": None, "spread": None, "n": r["runs"],
             "note": f"{r['passed']}/{r['runs']} passed ({r['bitwise']} bitwise); median back to training "
                     + ("-" if r["median_time_back_s"] is None else f"{r['median_time_back_s']:.2f} s")}
            for r in kind_rows(res)]


def shape_text(shape: dict[str, int] | None) -> str:
    if not shape:
        return "shape unknown"
    return (f"{shape['steps']} updates, a snapshot every {shape['every_steps']}, {shape['nodes']} nodes x "
            f"{shape['ranks_per_node']} ranks, {shape['layers']} layers of width {shape['width']}")


def markdown(res: dict[str, Any]) -> str:
    rows = kind_rows(res)
    runs = res.get("runs", [])
    lines = [MARK, "## Fault campaign: one fault per run, every run checked", "",
             f"{len(runs)} runs of the tiny decoder job (seed {res.get('seed')}; {shape_text(res.get('shape'))}); "
             f"{sum(r['passed'] for r in runs)} passed: the uninterrupted run's digest, no temporary directory "
             f"left, no verified snapshot lost (`scripts/campaign.py`).", "",
             "| fault kind | phases | runs | bitwise | named stop | median time back to training |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        back = "-" if r["median_time_back_s"] is None else f"{r['median_time_back_s']:.2f} s"
        lines.append(f"| {r['kind']} | {', '.join(r['phases'])} | {r['runs']} | {r['bitwise']} | "
                     f"{r['passed'] - r['bitwise']} | {back} |")
    fails = [r for r in runs if not r["passed"]]
    if fails:
        lines += ["", "Failed runs:", ""]
        lines += [f"- run {r['run']} {r['kind']} ({r['phase']}, update {r['update']}, rank {r['rank']}): "
                  f"{r['result'][6:][:300]}" for r in fails]
    lines.append(MARK)
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    kinds = "; ".join(f"{k} ({', '.join(ph)})" for k, ph in ck.KINDS.items())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=f"kinds (phases): {kinds}")
    p.add_argument("--runs", type=int, default=len(ck.KINDS), help="faults to inject, one per run (default: one "
                   "per kind)")
    p.add_argument("--seed", type=int, default=1, help="draws each fault's phase, update and rank (default 1)")
    p.add_argument("--kinds", default=",".join(ck.KINDS), help="comma-separated fault kinds, taken in turn, each "
                   "KIND or KIND:PHASE (default: all, the phase drawn)")
    p.add_argument("--out", default=None, help="where the runs' directories and logs go (default: a new "
                   "temporary directory); the uninterrupted run's digest is cached there")
    p.add_argument("--json", default=None, help="write every run's record here")
    p.add_argument("--markdown", default=None, help="write the summary table here ('' for none; default: "
                   "printed)")
    p.add_argument("--deadline-s", type=float, default=180.0, help="each run's deadline (default 180 s)")
    p.add_argument("--render", metavar="JSON", help="only print (or write to --markdown) the table of an earlier "
                   "--json result")
    p.add_argument("--keep", action="store_true", help="keep the run directories of passed runs")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an extra environment variable for every run's job (e.g. a negative control's switch)")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [why for why in map(ck.check_kind, kinds) if why]
    if bad or not kinds:
        p.error(f"--kinds {args.kinds!r}: {'; '.join(bad) or 'no kind'}")
    if args.runs < 1:
        p.error(f"--runs {args.runs}: must be 1 or more")
    if args.deadline_s <= 0:
        p.error(f"--deadline-s {args.deadline_s}: must be positive")
    if any("=" not in e for e in args.env):
        p.error(f"--env {args.env}: each must be NAME=VALUE")
    if any(k.startswith("disk_full") for k in kinds) and os.geteuid() != 0:
        log("disk_full needs root (it mounts a tmpfs): left out")
        kinds = [k for k in kinds if not k.startswith("disk_full")]
        if not kinds:
            p.error("--kinds: disk_full only, and not root")
    args.kind_list = kinds
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.render:
        md = markdown(json.loads(Path(args.render).read_text()))
        if args.markdown:
            Path(args.markdown).write_text(md)
        else:
            print(md)
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="accelpact-campaign-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env_extra = dict(e.split("=", 1) for e in args.env)
    shape = dict(SHAPE)
    deadline = float(os.environ.get("ACCELPACT_BENCH_DEADLINE_S") or 0) or None
    t0 = time.monotonic()
    ref = reference(out, shape, args.deadline_s)
    log(f"reference final_state_digest {ref[:16]}; {args.runs} run(s) into {out}")
    runs: list[dict[str, Any]] = []
    for i, fault in enumerate(plan(args.runs, args.seed, args.kind_list, shape), 1):
        if deadline and time.monotonic() - t0 > deadline - args.deadline_s:
            log(f"the part's deadline is near: {args.runs - i + 1} run(s) left out")
            break
        log(f"run {i}/{args.runs}: {fault.kind} ({fault.phase}, update {fault.update}, rank {fault.rank})")
        rec = one_run(i, fault, out, ref, args.deadline_s, args.seed, env_extra)
        runs.append(rec)
        back = "-" if rec["time_back_s"] is None else f"{rec['time_back_s']:.2f} s"
        log(f"run {i}/{args.runs}: {rec['result'][:400]} (back to training {back}, restarts {rec['restarts']}, "
            f"{rec['wall_s']:.0f} s)")
        if rec["passed"] and not args.keep:
            subprocess.run(["rm", "-rf", rec["run_dir"]], check=False)
    res = {"part": "campaign", "seed": args.seed, "shape": shape, "reference_digest": ref, "runs": runs,
           "total_wall_s": round(time.monotonic() - t0, 1), "out": str(out)}
    res["rows"] = summary_rows(res)
    res["summary"] = {"runs": len(runs), "passed": sum(r["passed"] for r in runs),
                      "bitwise": sum(r["result"] == "bitwise" for r in runs)}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    if args.markdown:
        Path(args.markdown).write_text(md)
    elif args.markdown is None:
        print(md)
    s = res["summary"]
    log(f"{s['passed']}/{s['runs']} passed ({s['bitwise']} bitwise) in {res['total_wall_s']:.0f} s")
    return 0 if runs and s["passed"] == s["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
