"""``accelpact-status``: what a job is doing, from a login node, without torch.

Usage::

    accelpact-status                      # your recent jobs under $ACCELPACT_RUNS_ROOT (else ./runs)
    accelpact-status 123456 runs/demo     # job ids (RUNS_ROOT/<jobid>) or run directories, in detail
    accelpact-status 123456 --json        # the stable schema of docs/operator-tools.md
    accelpact-status 123456 --watch 5     # refresh every 5 s until Ctrl-C

Exit status: 0, or 1 when a named job has neither a run directory nor a Slurm record.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Sequence

from accelpact_slurm.core import settings
from accelpact_slurm.core.events import finite, printable_tree
from accelpact_slurm.ops import status as st
from accelpact_slurm.ops.cadence import format_duration

log = logging.getLogger(__name__)
_SNAPSHOTS_SHOWN = 5
_L2_SHOWN = 10
_SKIPS_SHOWN = 3  # snapshots a restart skipped, named in its line (every one is in --json)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="accelpact-status",
        description="Show AccelPact jobs: state, frontier, repairs, restarts, snapshots per node.",
        epilog="documentation: docs/operator-tools.md#accelpact-status",
    )
    p.add_argument("targets", nargs="*", metavar="RUN_DIR_OR_JOBID",
                   help="run directories or job ids (resolved to RUNS_ROOT/<jobid>); none: your recent jobs")
    p.add_argument("--json", action="store_true", help="print the accelpact-status/1 JSON document")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until interrupted")
    p.add_argument("--iterations", type=int, metavar="N", help="with --watch: stop after N refreshes")
    p.add_argument("--runs-root", metavar="DIR",
                   help=f"where run directories live (default: ${st.RUNS_ROOT_ENV}, else ./runs)")
    p.add_argument("--limit", type=int, default=10, help="jobs listed without arguments (default 10)")
    p.add_argument("--all-users", action="store_true", help="list every user's run directories")
    p.add_argument("--no-slurm", action="store_true", help="do not ask squeue/sacct; use the run directory only")
    p.add_argument("--stale-after", type=float, metavar="SECONDS",
                   help=f"stale when unchanged this long (default: max({st.STALE_MIN_S:.0f} s, 20 step times))")
    return p


def gather(args: argparse.Namespace, now: float) -> tuple[dict[str, Any], bool]:
    """The JSON document for one refresh, and whether every named target was found."""
    root = args.runs_root or st.runs_root()
    if args.targets:
        pairs = [st.resolve_target(t, root) for t in args.targets]
    else:
        pairs = [(d, None) for d in st.list_run_dirs(root, args.limit, args.all_users)]
    # The run directory first: its events name the Slurm job id even when the directory has another name.
    jobs = [st.collect(run_dir, now=now, job_id=job, stale_after_s=args.stale_after) for run_dir, job in pairs]
    slurm = {} if args.no_slurm else st.query_slurm(j["job_id"] for j in jobs)
    found = True
    for info in jobs:
        st.apply_slurm(info, slurm.get(info["job_id"]))
        if not os.path.isdir(info["run_dir"]) and info["job_id"] not in slurm:
            found = False
    return {"schema": st.SCHEMA, "generated_ts": now, "runs_root": os.path.abspath(root), "jobs": jobs}, found


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=settings.log_level(), format="%(name)s: %(message)s")
    if args.watch is not None and args.watch <= 0:
        print("accelpact-status: --watch SECONDS must be positive", file=sys.stderr)
        return 2
    iteration, ok = 0, True
    try:
        while True:
            doc, ok = gather(args, time.time())
            if args.json:
                print(to_json(doc))
            else:
                if args.watch is not None and sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")
                # Event text is escaped: a reason holding ESC[2J must not clear the operator's screen.
                print(render(printable_tree(doc), detailed=bool(args.targets)))
            sys.stdout.flush()
            iteration += 1
            if args.watch is None or (args.iterations is not None and iteration >= args.iterations):
                break
            time.sleep(args.watch)
    except KeyboardInterrupt:
        pass
    return 0 if ok else 1


def to_json(doc: dict[str, Any]) -> str:
    """The document as strict JSON: a non-finite number (a diverged loss read back as NaN) becomes null."""
    return json.dumps(_finite(doc), sort_keys=True, default=str, allow_nan=False)


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None; Python's json would write them as invalid JSON."""
    return finite(obj)


# --------------------------------------------------------------------------- rendering


def render(doc: dict[str, Any], detailed: bool) -> str:
    if not doc["jobs"]:
        return f"no run directories under {doc['runs_root']} (set ${st.RUNS_ROOT_ENV} or pass RUN_DIR_OR_JOBID)"
    if not detailed:
        return render_list(doc["jobs"])
    return "\n\n".join(render_job(j) for j in doc["jobs"])


def render_list(jobs: list[dict[str, Any]]) -> str:
    head = ("JOB", "STATE", "RESTARTS", "FRONTIER", "AGE", "STEP/S", "L1", "VERIFIED", "RESTART", "LAST STOP",
            "WARNINGS")
    rows = []
    for j in jobs:
        fr = j["frontier"]
        best = j["snapshots"]["newest_verified"]
        rate = j["step_rate"]["steps_per_s"]
        rs = j["snapshots"]["restart"]
        rows.append((
            j["job_id"], j["state"], str(j["restarts"]),
            "-" if fr is None else str(fr["step"]), "-" if fr is None else _ago(fr["age_s"]),
            "-" if rate is None else f"{rate:.3g}", str(j["l1"]["count"]),
            "-" if best is None else f"{best['step']}@{best['node']}",
            "-" if rs["step"] is None else f"{rs['step']}@{_where(rs['source'])}",
            (j.get("last_stop") or {}).get("cause") or "-",
            "; ".join(j["warnings"]) or "-",
        ))
    return _table(head, rows)


def render_job(j: dict[str, Any]) -> str:
    out = [f"job {j['job_id']}  {j['state']} ({j['state_source']})  {j['run_dir']}"]

    def line(label: str, text: str) -> None:
        out.append(f"  {label:<14}{text}")

    line("restarts", str(j["restarts"]))
    if j.get("last_stop"):
        line("last stop", j["last_stop"]["line"])
    fr, rate = j["frontier"], j["step_rate"]
    if fr is None:
        line("frontier", "no step committed yet")
    else:
        speed = "" if rate["steps_per_s"] is None else f"; {rate['steps_per_s']:.3g} steps/s"
        per = "" if rate["step_s"] is None else f", {rate['step_s']:.3g} s/step"
        line("frontier", f"step {fr['step']} ({fr['source']}), {_ago(fr['age_s'])} ago{speed}{per}")
    if j["checkpoint_every_steps"] is not None:
        line("cadence", f"snapshot every {j['checkpoint_every_steps']} steps (job_start config)")
    env = j["envelope"]
    if env is None:
        line("envelope", "no decision taken yet")
    else:
        key = f"  key {env['key']}" if env.get("key") else ""
        line("envelope", f"{env['decision'] or '?'} (from {env['event']}, phase {env.get('phase') or '-'}){key}")
    l1 = j["l1"]
    if l1["count"] == 0:
        line("L1 repairs", f"none ({l1['faults']} fault event(s))")
    else:
        last = l1["last"]
        when = "" if last["age_s"] is None else f", last {_ago(last['age_s'])} ago"
        total = "" if last["total_s"] is None else f" in {last['total_s']:.3g} s"
        line("L1 repairs", f"{l1['count']}{when}: generation {_v(last['generation'])}, frontier {_v(last['frontier'])}{total}")
        for name, p in l1["phases"].items():
            line("", f"  {name:<18} last {p['last']:.3g} s  median {p['median']:.3g} s  max {p['max']:.3g} s")
    if j.get("spares"):
        line("spare pool", pool_line(j["spares"]))
        for h in j["spares"].get("heals", [])[-_L2_SHOWN:]:
            line("heal", heal_line(h))
        for r in j["spares"].get("refused", [])[-_L2_SHOWN:]:
            line("no heal", f"start {r['restart']}: {r['reason']}")
    l2 = j["l2"]
    line("L2 restarts", str(l2["count"]))
    if l2.get("excluded"):
        line("excluded", f"{', '.join(l2['excluded'])} (lost whole; the requeue keeps the job off them)")
    for text in _l2_lines(l2)[-_L2_SHOWN:]:
        line("", "  " + text)
    snaps = j["snapshots"]
    best = snaps["newest_verified"]
    if best is None:
        line("snapshots", f"no verified snapshot: {snaps['newest_verified_reason']}")
    else:
        line("snapshots", f"newest verified: step {best['step']} on {best['node']} "
                          f"({_size(best['size_bytes'])}, {_ago(best['age_s'])} old)")
    rs, common, shared = snaps["restart"], snaps["newest_common"], snaps["shared"]
    line("restart loads", f"nothing: {rs['reason']}" if rs["step"] is None
         else f"step {rs['step']} from {rs['source']}: {rs['reason']}")
    line("common step", f"none: {common['reason']}" if common["step"] is None else f"step {common['step']}: "
                                                                                  f"{common['reason']}")
    rows = []
    for n in snaps["nodes"]:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(n["counts"].items()))
        shown = min(_SNAPSHOTS_SHOWN, len(n["snapshots"]))
        line("", f"  {n['node']}: {counts or 'no snapshots'}; index updated {_ago(n['age_s'])} ago"
                 + (f" (newest {shown} of {len(n['snapshots'])} below)" if shown < len(n["snapshots"]) else ""))
        rows += _snapshot_rows(n["snapshots"])
    counts = ", ".join(f"{k} {v}" for k, v in sorted(shared["counts"].items()))
    line("", f"  {st.SHARED_SOURCE}: {counts or 'no snapshots'} in {shared['dir']}")
    rows += _snapshot_rows(shared["snapshots"])
    if rows:
        out.extend("    " + r for r in _table(("NODE", "STEP", "STATE", "SIZE", "AGE", "MILESTONE", "REASON"),
                                              rows).splitlines())
    if j["final"] is not None:
        f = j["final"]
        loss = f.get("final_loss")
        loss = f"{loss:.6g}" if isinstance(loss, float) else _v(loss)
        line("final", f"step {_v(f.get('final_step'))}, loss {loss}, exit {_v(f.get('exit_code'))}, "
                      f"wall {_seconds(f.get('wall_s'))}")
    for w in j["warnings"]:
        line("WARNING", w)
    for b in j["bad_lines"][:10]:
        line("skipped", b)
    if len(j["bad_lines"]) > 10:
        line("skipped", f"... and {len(j['bad_lines']) - 10} more")
    return "\n".join(out)


def heal_line(h: dict[str, Any]) -> str:
    """One heal in one line (pure): ``node 1 -> spare node 2 at update 3 (start 0, generation 1): certified, 1.64 s``."""
    verdict = {True: "certified", False: "certificate FAILED", None: "not certified"}[h.get("certified")]
    return (f"node {_v(h.get('dead_node'))} -> spare node {_v(h.get('spare_node'))} at update {_v(h.get('frontier'))} "
            f"(start {_v(h.get('restart'))}, generation {_v(h.get('generation'))}): {verdict}, "
            f"{float(h.get('seconds') or 0):.2f} s")


def pool_line(pool: dict[str, Any]) -> str:
    """The spare pool in one line (pure): ``1 spare node(s) x 2: free 1, used 0 (start 0: node index 2 free)``."""
    nodes = pool.get("nodes") or {}
    count = pool.get("configured") or len(nodes)
    per = f" x {pool['per_node']}" if pool.get("per_node") else ""
    counts = ", ".join(f"{k} {pool.get(k, 0)}" for k in ("free", "used", "starting", "ended")
                       if k in ("free", "used") or pool.get(k))
    each = ", ".join(f"node index {n} {state}" for n, state in nodes.items()) or "none reported yet"
    return f"{count} spare node(s){per}: {counts} (start {_v(pool.get('restart'))}: {each})"


def _snapshot_rows(snapshots: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The newest snapshots of one node (or of the shared tier) as table rows."""
    return [(s["node"], str(s["step"]), str(s["state"]), _size(s["size_bytes"]), _ago(s["age_s"]),
             "yes" if s["milestone"] else "", s["reason"] or "") for s in snapshots[-_SNAPSHOTS_SHOWN:]]


def _where(source: str | None) -> str:
    """A restart source in one word, for the job list (``shared`` for the shared tier)."""
    return "shared" if source == st.SHARED_SOURCE else str(source)


def _l2_lines(l2: dict[str, Any]) -> list[str]:
    """One line per run that ended: why it stopped, how it was requeued, what the next run loaded."""
    runs: dict[int, list[str]] = {}
    for fs in l2["fail_stops"]:
        cause = f" ({fs['cause']})" if fs.get("cause") else ""
        others = "".join(f"; also{' (' + o['cause'] + ')' if o.get('cause') else ''} '{o['reason']}'"
                         for o in fs.get("others") or ())
        runs.setdefault(fs["restart"], []).append(
            f"fail-stop{cause} '{_v(fs['reason'])}' (exit {_v(fs['exit_code'])}, phase {fs['phase'] or '-'}, "
            f"{frontier_words(fs)}){others}")
    for rq in l2["requeues"]:
        runs.setdefault(rq["restart"], []).append(f"requeue '{_v(rq['reason'])}' by {rq['by'] or '-'}")
    for rl in l2["restart_loads"]:
        if isinstance(rl["restart"], int) and rl["restart"] > 0:
            step = rl["step"]
            text = f"run {rl['restart']} loaded step {step}" if isinstance(step, int) and not isinstance(step, bool) \
                else f"run {rl['restart']} loaded no snapshot: {rl.get('reason') or 'no reason given'}"
            skipped = [s for s in rl.get("skipped") or () if isinstance(s, dict)]
            text += "".join(f", skipped step {s.get('step')}: {s.get('reason')}" for s in skipped[:_SKIPS_SHOWN])
            if len(skipped) > _SKIPS_SHOWN:
                text += f", and {len(skipped) - _SKIPS_SHOWN} more skipped"
            runs.setdefault(rl["restart"] - 1, []).append(text)
    return [f"run {r}: " + "; ".join(parts) for r, parts in sorted(runs.items())]


def _v(value: Any) -> str:
    """A field for people: ``-`` where the log holds none (a line never says ``None``)."""
    return "-" if value is None else str(value)


def frontier_words(stop: dict[str, Any]) -> str:
    """Where a stop left the job: its own frontier, else the newest update the log committed before it, else
    that none was committed (never ``None``)."""
    at = stop.get("frontier")
    if not isinstance(at, int) or isinstance(at, bool):
        return "before any committed update"
    if stop.get("frontier_source") == "log":
        return f"frontier {at}: the log's newest committed update before it"
    return f"frontier {at}"


def _seconds(value: Any) -> str:
    """A time in seconds for people (``20.6 s``, ``3.2 min``); ``-`` for none or a non-number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return "-"
    return format_duration(max(0.0, float(value)))


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else format_duration(max(0.0, seconds))


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in (head, *rows))


if __name__ == "__main__":
    sys.exit(main())
