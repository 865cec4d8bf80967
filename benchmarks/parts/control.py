#!/usr/bin/env python3
"""The control plane at scale: what one decision (a vote round) costs with 4 to 1,024 members.

Every member is emulated by a thread of this process holding a job-store client of its own
(``accelpact_slurm.runtime.transport.store.JobStore``: the handshake under the run's key, a MAC on every frame) and a
``ControlPlane`` over it; no data plane, no liveness thread.  The store is served by one other process (as rank 0
serves every other rank).  Two codes, side by side in the same run, each with its own server in that process:

- **old**: the earlier code (default ``37e64d0``, loaded from git: its ``runtime/control.py`` and
  ``runtime/store_server.py``): every member reads every member's key in every round (O(N^2) keys a round), and
  every write looks at every parked wait of the store;
- **new**: the current code: from ``ControlPlane.LEAD_FROM`` members on, the round's lead reads the N values and
  posts one combined result, every other member reads that one key (O(N) keys a round); below, every member reads
  every value as before; a write wakes only the waits on its key.

Measured:

1. **Per decision**: for each member count (4, 64, 256, 1,024), several samples of each code, interleaved (old,
   new, new, old, ...); a sample is a few rounds back to back, every member taking the vote as its code's guard
   does (old: ``all_gather("vote", VOTE)``, every member gets the N votes; new: ``all_reduce("vote", VOTE,
   summarize_votes)``, the lead reduces them once and every member gets the summary); its figure is the wall time from the members' common start to the last member's
   return, over the rounds.  Every member runs on this machine's two cores (their client work and the store's
   serve one another, under one interpreter lock), so the figure is the whole job's work for one decision, not
   one rank's latency on a cluster.
2. **Per decision at 4 members, ABBA**: blocks of rounds of the old and the new code at 4 members, in the order old,
   new, new, old, ...; a pair's figure is new / old.

Output: ``--json`` (default ``runs/bench/<date>/control.json``) and the block between
``<!-- control-bench -->`` markers of ``--markdown`` (default ``''``: none; ``make bench`` renders the docs from the parts' summaries).

Usage: .venv/bin/python benchmarks/parts/control.py [--members 4,64,256,1024] [--samples 5] [--commit 37e64d0]
       .venv/bin/python benchmarks/parts/control.py --render runs/bench/<date>/control.json

About 3 minutes here with the defaults.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import secrets
import subprocess
import sys
import threading
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import common as h  # noqa: E402

h.add_paths()

PART = "control"
MARK = "<!-- control-bench -->"
#: The code before the round went through its lead (every member reading every member's key, every write
#: looking at every parked wait of the store).
BEFORE = "37e64d0"
DEFAULT_BUDGET_S = 300.0
MEMBERS = (4, 64, 256, 1024)
#: From this many members on the new code's rounds go through their lead.
LEAD_FROM = __import__("accelpact_slurm.runtime.transport.control", fromlist=["ControlPlane"]).ControlPlane.LEAD_FROM
#: The scale the estimate is for.
TARGET = 16384
#: A vote as the guard sends it (runtime/job/guard.py) on an update without a replay fingerprint, about 110 bytes.
VOTE = {"F": 1234, "g": 0, "fault": None, "error": None, "loss": 2.3456789, "stop": False, "redo": True}

# The store host: the old code's server and the new one, in one process (as rank 0's is for every other rank).
_HOST = """
import importlib.util, sys, types
from accelpact_slurm.runtime.transport.store import binding, port_candidates
from accelpact_slurm.runtime.transport.store_server import StoreServer, listen
key = bytes.fromhex(sys.stdin.readline().strip())
old_src = sys.stdin.readline()
mod = types.ModuleType("_old_store_server")
exec(compile(bytes.fromhex(old_src.strip()).decode(), "old/store_server.py", "exec"), mod.__dict__)
servers = {}
for name, cls in (("old", mod.StoreServer), ("new", StoreServer)):
    sock, _ = listen("127.0.0.1", port_candidates(key, "bench-" + name))
    servers[name] = cls(sock, key, binding("bench-" + name, 0), pending_cap=4096).start()
print(servers["old"].port, servers["new"].port, flush=True)
sys.stdin.readline()  # until the benchmark is done
"""


def git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(h.REPO), "show", f"{rev}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def _today(source: str) -> str:
    """An earlier commit's source with its imports of the flat ``runtime`` package pointed at today's modules."""
    for old, new in (("runtime import store_wire", "runtime.transport import store_wire"),
                     ("runtime.collectives", "runtime.detection.collectives")):
        source = source.replace(old, new)
    return source


def load_module(name: str, source: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), mod.__dict__)
    return mod


class Members:
    """``n`` emulated members of one code: a store client and a control plane each, one thread each."""

    def __init__(self, cls: type, port: int, key: bytes, bind_to: str, n: int, host_pid: int) -> None:
        from accelpact_slurm.runtime.transport.store import JobStore

        self.clients = [JobStore("127.0.0.1", [port], key, bind_to, r, timedelta(seconds=120)) for r in range(n)]
        self.cls, self.n, self.gen, self.host_pid = cls, n, 0, host_pid
        self.store_cpu_ms: list[float] = []

    def sample(self, rounds: int, timeout_s: float = 600.0) -> float:
        """Milliseconds per decision: ``rounds`` vote rounds on every member, from their common start (the store
        host's CPU time per decision goes to ``store_cpu_ms``)."""
        self.gen += 1  # a fresh key space per sample (as a new generation is)
        planes = [self.cls(c, rank=r, world_size=self.n, timeout_s=timeout_s, generation=self.gen)
                  for r, c in enumerate(self.clients)]
        barrier = threading.Barrier(self.n + 1, timeout=timeout_s)
        ends: list[float] = [0.0] * self.n
        errors: list[BaseException] = []

        def member(r: int) -> None:
            try:
                barrier.wait()
                p = planes[r]
                if hasattr(p, "all_reduce"):  # the vote as the guard takes it now: reduced once, on the lead
                    from accelpact_slurm.runtime.job.guard import summarize_votes

                    for _ in range(rounds):
                        p.all_reduce("vote", VOTE, summarize_votes)
                else:  # the earlier guard: every member gets every vote
                    for _ in range(rounds):
                        p.all_gather("vote", VOTE)
                ends[r] = time.perf_counter()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        cpu0 = cpu_s(self.host_pid)
        barrier.wait()
        t0 = time.perf_counter()
        end = time.monotonic() + timeout_s  # one deadline for all of them (a join's own would add up per member)
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        if errors or any(t.is_alive() for t in threads):
            raise RuntimeError(f"{self.n} members: {errors[:1] or 'a member did not finish'}")
        self.store_cpu_ms.append((cpu_s(self.host_pid) - cpu0) / rounds * 1e3)
        return (max(ends) - t0) / rounds * 1e3

    def close(self) -> None:
        # A member still blocked in a request (a stuck size, SIGTERM) holds its client's lock, and its close would
        # wait out the request's own timeout: every close runs in a daemon thread, waited for 5 s in all (a client
        # still stuck then is the process's exit's to end).
        closers = [threading.Thread(target=c.close, daemon=True) for c in self.clients]
        for t in closers:
            t.start()
        end = time.monotonic() + 5.0
        for t in closers:
            t.join(max(0.0, end - time.monotonic()))


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system), in seconds."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: The most the samples of one size may take together (1,024 members: 13-43 s a sample of the earlier code, 8
#: samples with the warm-ups; ~60 s in all here alone).
SIZE_DEADLINE_S = 200.0


def rounds_for(n: int) -> int:
    """Rounds per sample: enough for a sample of a few tens of milliseconds at small sizes."""
    return max(1, min(50, 800 // n))


def fit(points: list[tuple[int, float]]) -> dict[str, Any]:
    """The measured curve's local exponent (the log-log slope between the two largest sizes) and the estimate for
    :data:`TARGET` members it gives (a power law through the largest point)."""
    pts = sorted((n, t) for n, t in points if t)
    if len(pts) < 2:
        return {}
    (n1, t1), (n2, t2) = pts[-2], pts[-1]
    k = math.log(t2 / t1) / math.log(n2 / n1)
    return {"exponent": k, "from": [n1, n2], "estimate_ms": t2 * (TARGET / n2) ** k,
            "linear_ms": t2 * TARGET / n2, "quadratic_ms": t2 * (TARGET / n2) ** 2}


def measure(commit: str, members: list[int], samples: int, abba_pairs: int, log: Any,
            budget: h.Budget) -> dict[str, Any]:
    from accelpact_slurm.runtime.transport.control import ControlPlane
    from accelpact_slurm.runtime.transport.store import binding

    old_cp = load_module("_old_control", _today(git_show(commit, "accelpact_slurm/runtime/control.py"))).ControlPlane
    key = secrets.token_bytes(32)
    host = subprocess.Popen([sys.executable, "-c", _HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=str(h.REPO))
    out: dict[str, Any] = {"curve": {}, "abba4": None}
    try:
        assert host.stdin is not None and host.stdout is not None
        host.stdin.write(key.hex() + "\n")
        host.stdin.write(_today(git_show(commit, "accelpact_slurm/runtime/store_server.py")).encode().hex() + "\n")
        host.stdin.flush()
        ports = dict(zip(("old", "new"), (int(x) for x in host.stdout.readline().split())))
        codes = {"old": old_cp, "new": ControlPlane}

        def group(code: str, n: int) -> Members:
            return Members(codes[code], ports[code], key, binding(f"bench-{code}", 0), n, host.pid)

        # 2. at 4 members, ABBA blocks
        g = {c: group(c, 4) for c in codes}
        try:
            for c in codes:
                g[c].sample(5)  # warm-up
            per: dict[str, list[float]] = {"old": [], "new": []}
            ratios = []
            for i in range(abba_pairs):
                got = {}
                for c in h.abba(i, "old", "new"):
                    got[c] = g[c].sample(40)
                    per[c].append(got[c])
                ratios.append(got["new"] / got["old"])
            out["abba4"] = {"pairs": abba_pairs, "rounds": 40, "ratio": h.spread(ratios),
                            "old_ms": h.spread(per["old"]), "new_ms": h.spread(per["new"])}
            log(f"4 members, ABBA: new/old {out['abba4']['ratio']['median']:.3f} "
                f"({per['new'] and h.med(per['new']):.3f} vs {h.med(per['old']):.3f} ms)")
        finally:
            for c in codes:
                g[c].close()
        # 1. the curve
        for n in members:
            if not budget.fits():
                log(f"{n} members: skipped, out of time")
                out["curve"][str(n)] = {"skipped": "out of time"}
                continue
            t = time.monotonic()
            log(f"{n} members: connecting {2 * n} clients")
            g = {c: group(c, n) for c in codes}
            # this size's samples share one deadline: a sample that hangs (seen twice at 1,024 members in full runs:
            # no output for minutes) costs this size, not the parts after this one
            deadline_s = max(30.0, min(SIZE_DEADLINE_S, budget.budget_s - budget.elapsed()))
            end = time.monotonic() + deadline_s

            def left() -> float:
                return max(1.0, end - time.monotonic())

            try:
                rounds = rounds_for(n)
                for c in codes:
                    g[c].sample(1, timeout_s=left())  # warm-up
                log(f"{n} members: connected and warmed up after {time.monotonic() - t:.0f} s")
                per = {"old": [], "new": []}
                k = samples if n < 1024 else max(3, samples - 2)
                for i in range(k):
                    for c in h.abba(i, "old", "new"):
                        per[c].append(g[c].sample(rounds, timeout_s=left()))
                row = {"members": n, "rounds": rounds, "old_ms": h.spread(per["old"]),
                       "new_ms": h.spread(per["new"]),
                       "speedup": h.spread([a / b for a, b in zip(per["old"], per["new"])]),
                       "old_store_cpu_ms": h.spread(g["old"].store_cpu_ms[1:]),
                       "new_store_cpu_ms": h.spread(g["new"].store_cpu_ms[1:])}
                out["curve"][str(n)] = row
                log(f"{n} members: old {row['old_ms']['median']:.2f} ms, new {row['new_ms']['median']:.2f} ms "
                    f"per decision ({k} samples of {rounds} rounds); store CPU old "
                    f"{row['old_store_cpu_ms']['median']:.1f} ms, new {row['new_store_cpu_ms']['median']:.1f} ms")
            except RuntimeError as exc:  # a sample past its deadline, or a member's error: this size only
                out["curve"][str(n)] = {"skipped": f"a sample failed or passed the size's {deadline_s:.0f} s deadline: "
                                                   f"{str(exc)[:200]}"}
                log(f"{n} members: {out['curve'][str(n)]['skipped']}")
            finally:
                for c in codes:
                    g[c].close()
            budget.record(time.monotonic() - t)
    finally:
        try:
            host.kill()
            host.wait(10)
        except Exception:  # noqa: BLE001
            pass
    for code in ("old", "new"):
        for what, field in (("", f"{code}_ms"), ("store_", f"{code}_store_cpu_ms")):
            pts = [(int(n), (r.get(field) or {}).get("median")) for n, r in out["curve"].items()]
            out[f"fit_{what}{code}"] = fit(pts)
    return out


#: The summary a member reads of a quiet vote (runtime/job/guard.py summarize_votes), bytes.
SUMMARY_BYTES = len(json.dumps({"n": TARGET, "votes": [[0, VOTE]], "stop": False, "redo": True, "mean": 2.3456789,
                                "agreed": [{"F": 1234, "g": 0}, None], "fps": None}))


def markdown(res: dict[str, Any]) -> str:
    m = res.get("measured") or {}
    label = res.get("commit_label", BEFORE)
    lines = [MARK, "## The control plane at scale: one decision with 4 to 1,024 members", "",
             f"Run {res.get('date', '?')} ({h.machine_line(res.get('machine', {}))}); the current code "
             f"(new: from {LEAD_FROM} members on, the round's lead reads the N votes and posts their summary, "
             f"every other member reads that one key; below, every member reads every vote) against `{label}` (old, commit `{res.get('commit', '?')}`: every member reads every "
             f"member's key; its store server too). Every member is a thread of one process with a job-store "
             f"client of its own (handshake, MAC), no data plane; the store is served by one other process. "
             f"*ms per decision* is the wall time of one vote round of every member, i.e. the whole job's work "
             f"for one decision on this machine's 2 cores (not one rank's latency on a cluster); *store CPU* is "
             f"the serving process's CPU time per decision: the part that stays serial on a cluster.", "",
             "| members | old: ms per decision | new: ms per decision | old / new | store CPU old (ms) | "
             "store CPU new (ms) | samples x rounds |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n, r in sorted((m.get("curve") or {}).items(), key=lambda kv: int(kv[0])):
        if r.get("skipped"):
            lines.append(f"| {n} | not measured: {r['skipped']} | | | | | |")
            continue
        lines.append(f"| {n} | {h.fmt_spread(r['old_ms'], '{:.2f}')} | {h.fmt_spread(r['new_ms'], '{:.2f}')} | "
                     f"{h.fmt_spread(r['speedup'], '{:.1f}')} | "
                     f"{h.fmt((r.get('old_store_cpu_ms') or {}).get('median'), '{:.1f}')} | "
                     f"{h.fmt((r.get('new_store_cpu_ms') or {}).get('median'), '{:.1f}')} | "
                     f"{r['old_ms']['n']} x {r['rounds']} |")
    a = m.get("abba4") or {}
    if a:
        lines += ["", f"**At 4 members, ABBA** ({a['pairs']} pairs of {a['rounds']} rounds, old, new, new, old, "
                  f"...): new / old {h.fmt_spread(a['ratio'], '{:.3f}')} ({h.fmt(a['new_ms']['median'], '{:.3f}')} "
                  f"ms against {h.fmt(a['old_ms']['median'], '{:.3f}')} ms per decision): at 4 members every "
                  f"member still reads every vote (below `ControlPlane.LEAD_FROM` = {LEAD_FROM}, where the lead's "
                  f"two extra hops through the store cost more than the keys they save); what differs is the "
                  f"store's wake-up of parked waits and the summary each member computes."]
    fo, fn = m.get("fit_old") or {}, m.get("fit_new") or {}
    so, sn = m.get("fit_store_old") or {}, m.get("fit_store_new") or {}
    if fo and fn:
        vote = len(json.dumps(VOTE))
        est = (f"**Estimate for {TARGET:,} ranks (on paper).** Extrapolated as a power law through the two largest "
               f"sizes measured ({fn['from'][0]} and {fn['from'][1]} members: their log-log slope, carried on to "
               f"{TARGET:,}, which assumes the trend between them holds that far). Total work per decision: new "
               f"N^{fn['exponent']:.2f}, {fn['estimate_ms'] / 1e3:,.1f} s; old N^{fo['exponent']:.2f}, "
               f"{fo['estimate_ms'] / 1e3:,.0f} s.")
        if so.get("exponent") is not None and sn.get("exponent") is not None:
            est += (f" The store's serial CPU per decision: new N^{sn['exponent']:.2f}, "
                    f"{sn['estimate_ms'] / 1e3:,.1f} s; old N^{so['exponent']:.2f}, {so['estimate_ms'] / 1e3:,.0f} s.")
        est += (f" On a cluster the members' own work runs on their own nodes and what stays serial is the store: "
                f"its requests, key lookups and bytes are O(N) a decision now: N votes in (about {vote} bytes "
                f"each), one summary of about {SUMMARY_BYTES} bytes out to each of N members, whatever N, "
                f"against old's N reads of N keys each ({TARGET * TARGET * vote / 1e9:.0f} GB through the store a "
                f"decision at {TARGET:,}) and every write looking at every parked wait.")
        lines += ["", est]
    lines += ["", MARK]
    return "\n".join(lines)


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    m, rows = res.get("measured") or {}, []
    big = max((int(n) for n, r in (m.get("curve") or {}).items() if not r.get("skipped")), default=None)
    if big is not None:
        r = m["curve"][str(big)]
        rows.append(h.row(f"control-plane decision (vote round), {big} emulated members: old / new",
                          f"the same rounds with `{res.get('commit_label', BEFORE)}`'s control plane and store",
                          r["speedup"], note=f"old {h.fmt(r['old_ms']['median'])} ms, new "
                                             f"{h.fmt(r['new_ms']['median'])} ms per decision"))
    a = m.get("abba4") or {}
    if a:
        rows.append(h.row("control-plane decision at 4 members: new / old",
                          f"`{res.get('commit_label', BEFORE)}`, ABBA blocks", a["ratio"],
                          note=f"{h.fmt(a['new_ms']['median'], '{:.3f}')} vs "
                               f"{h.fmt(a['old_ms']['median'], '{:.3f}')} ms"))
    return rows


def build_parser() -> argparse.ArgumentParser:
    head, _, rest = (__doc__ or "").partition("\n\n")
    ap = argparse.ArgumentParser(prog="bench_control.py", description=head, epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", default=",".join(map(str, MEMBERS)), help="member counts (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=5, help="samples per code and size (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=8, help="ABBA pairs at 4 members (default: %(default)s)")
    ap.add_argument("--commit", default=BEFORE, help="the earlier code's git revision (default: %(default)s)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time budget (default: %(default)s)")
    h.output_args(ap, f"runs/bench/{h.today()}/control.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = h.logger(PART)
    if args.render:
        res = h.read_result(args.render)
        if h.write_markdown(args.markdown, MARK, markdown(res)) is None:
            print(markdown(res))
        return 0
    members = [int(x) for x in args.members.split(",") if x]
    if args.samples < 1 or args.pairs < 1 or not members:
        raise SystemExit("--samples and --pairs must be >= 1, --members not empty")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * max(members) + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    budget = h.Budget(h.outer_deadline(args.budget_s, margin_s=10.0, floor_s=30.0))
    h.stop_on_signals(PART)
    commit = subprocess.run(["git", "-C", str(h.REPO), "rev-parse", "--short", args.commit], check=True,
                            capture_output=True, text=True).stdout.strip()
    res = h.new_result(PART, json=h.json_field(args.json), commit=commit, commit_label=args.commit)
    res["measured"] = measure(args.commit, members, args.samples, args.pairs, log, budget)
    res["total_wall_s"] = budget.elapsed()
    h.finish(res)
    if not any(not r.get("skipped") for r in res["measured"]["curve"].values()):
        res["error"] = "no size measured"
        out = h.write_result(res, args.json, failed=True)
        log(f"FAILED: {res['error']} (written to {out})")
        return 1
    res["rows"] = summary_rows(res)
    out = h.write_result(res, args.json)
    h.write_markdown(args.markdown, MARK, markdown(res))
    log(f"result written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
