"""The benchmark figures outside each part's own block: the README's bullet and the goals' lines of a part's raw
result (pure: results in, text out; ``benchmarks/harness/summary.py`` keeps them in the part's summary), which raw
result on this machine is each part's newest (``runs/bench/<date>/<part>.json``), and the comparison of a rendered
text with the file (``figure_diff``, for ``tests/test_bench_figures.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks.harness import common as h

README_MARK = "<!-- bench-figures -->"
GOALS_MARK = "<!-- bench-goals -->"
#: A figure in the text: a number, with its sign and decimals (dates and commits are figures too).
FIGURE = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


# ====================================================================== which result is each part's


def stored_results(results: Path) -> dict[str, tuple[dict[str, Any], str]]:
    """Each part's newest raw result under ``results`` (``<date>/<part>.json``, or a part in a merged
    ``<date>.json``) and the file it is in.

    Newest by the date in the file's path; for one date the part's own file wins over the merged one (the
    merged file keeps what the part gave at ``make bench`` time, the part's file what it gave last)."""
    found: dict[str, tuple[str, int, dict[str, Any], str]] = {}
    root = results.parent.parent

    def offer(part: str, date: str, rank: int, res: Any, path: Path) -> None:
        if not isinstance(res, dict) or res.get("error") or res.get("exit_code") not in (None, 0):
            return
        best = found.get(part)
        if best is None or (date, rank) > (best[0], best[1]):
            found[part] = (date, rank, res, str(path.relative_to(root)) if path.is_relative_to(root) else str(path))

    for path in sorted(results.glob("20??-??-??.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for part, res in (doc.get("parts") or {}).items():
            offer(part, path.stem, 0, res, path)
    for path in sorted(results.glob("20??-??-??/*.json")):
        if path.stem.endswith("-failed"):
            continue
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(res, dict) and (res.get("part") in (None, path.stem)):
            offer(path.stem, path.parent.name, 1, res, path)
    return {part: (res, rel) for part, (_d, _r, res, rel) in found.items()}


# ====================================================================== helpers


def _rows(res: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [r for r in (res or {}).get("rows") or [] if isinstance(r, dict)]


def _row(res: dict[str, Any] | None, *words: str) -> dict[str, Any] | None:
    """The first summary row whose ``what`` contains every one of ``words``."""
    return next((r for r in _rows(res) if all(w in (r.get("what") or "") for w in words)), None)


def _x(r: dict[str, Any] | None, f: str = "{:.2f}") -> str:
    """``1.03x (0.92–1.08)`` of a row; ``n/a`` without one."""
    if not r or r.get("ratio") is None:
        return "n/a"
    return f"{f.format(r['ratio'])}x" + (f" ({r['spread']})" if r.get("spread") and "–" in r["spread"] else "")


def _s(st: dict[str, Any] | None, f: str = "{:.2f}") -> str:
    return h.fmt_spread(st, f)


# ====================================================================== the README's figures


def _repair(res: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    m = res["main"]
    if m.get("method") is None:
        return ("- **The L1 repair itself** (`repair`): the figure against its floor awaits the next `make bench` "
                f"run. The stored run ({res['date']}) gave {_x(rows[0] if rows else None, '{:.1f}')} the floor of "
                f"building one Gloo group and its first all-reduce, {m['total_ms']['median']:.1f} ms against "
                f"{m['floor_ms']['median']:.1f} ms, but timed the lead rank only against one floor sample taken "
                "after a world barrier, which the ranks' skew dominates: not a floor (goal 1.5x: not decided).")
    st = m["total_vs_floor"]
    met = st.get("median") is not None and st["median"] <= 1.5
    below = m.get("below_floor") or []
    return ("- **The L1 repair itself** (`repair`, the slowest affected rank against the slowest member's floor, "
            f"the median of {m.get('floor_samples')} samples beside each repair): {_s(st, '{:.2f}')}x the floor of "
            f"building one Gloo group and its first all-reduce, {_s(m['repair_ms'], '{:.1f}')} ms against "
            f"{_s(m['floor_ms'], '{:.1f}')} ms; goal 1.5x {'met' if met else 'not met'}"
            + (f"; {len(below)} of {len(m['pairs'])} repairs below their floor, flagged and left out" if below
               else "") + ".")


def readme_lines(results: dict[str, tuple[dict[str, Any], str]], gpu: dict[str, Any] | None,
                 peer_rows: list[dict[str, Any]] | None = None) -> list[str]:
    """The README's benchmark figures: one bullet per part, every figure from the stored results.

    ``peer_rows``: the peers part's rows computed again from its runs (``peers_report.summary_rows``), for
    the added milliseconds its stored rows may lack."""
    R = {p: res for p, (res, _rel) in results.items()}
    out: list[str] = []
    dates = sorted({str(res.get("date") or "?") for res in R.values()})
    out.append("Each bullet names its part; the run each comes from is in its section of "
               "[docs/benchmarks.md](docs/benchmarks.md) (stored results of " + ", ".join(dates) + "):")
    out.append("")
    if "store" in R:
        res = R["store"]
        g, rt = _row(res, "guarded"), (res.get("round_trips") or {})
        how = ("its control plane on the job's store and on torch's `TCPStore` in turn inside one job, every rank "
               "timed" if g and "same job" in g["what"] else
               "ABBA pairs of the same job against the code before it, which used torch's `TCPStore`")
        out.append(f"- **The authenticated store** (`store`, {how}): a guarded update (its vote a control-plane round) "
                   f"{_x(g, '{:.3f}')}; goal ≤ 1.01x {'met' if g and g['ratio'] <= 1.01 else 'not met'}. One round "
                   f"trip costs {rt.get('ours_us', {}).get('median', 0):.0f} µs against `TCPStore`'s "
                   f"{rt.get('tcpstore_us', {}).get('median', 0):.0f} µs (a Python server, a MAC each way).")
        w = _row(res, "guarded", "thread of rank 0")
        if w:
            out[-1] += (f" Served by a thread of rank 0 instead of a process of its own, the same code's guarded "
                        f"update took {_x(w, '{:.3f}')} ({w.get('note', '')}).")
    if "nodeloss" in R:
        from benchmarks.parts.nodeloss import phases_of

        ps = phases_of(R["nodeloss"])
        each = "; ".join(f"{p['phase']}: {h.fmt_spread(p['heal_back'])} s against {h.fmt_spread(p['l2_back'])} s "
                         f"({h.fmt(p['speedup'].get('median'))}x), bitwise {p['heal_bitwise']}/{p['heal_runs']}, "
                         f"noticed after {h.fmt(p['noticed'].get('median'))} s, the heal itself "
                         f"{h.fmt(p['parts']['total'].get('median'))} s" for p in ps)
        out.append(f"- **Node loss, a spare's heal against L2** (`nodeloss`, one node's ranks killed in update K, "
                   f"{R['nodeloss'].get('trials')} trials per phase in ABBA pairs, the tiny decoder, heartbeat_s "
                   f"{R['nodeloss'].get('heartbeat')} s): from the loss to update K committed, {each}; the heal "
                   f"restarts nothing, L2 once. Most of the heal itself is the spare building its model after it "
                   f"was assigned.")
    if "launch" in R:
        from benchmarks.parts.launch import readme_bullet

        out.append(readme_bullet(R["launch"]))
    if "recovery" in R:
        res = R["recovery"]
        sm = res["summary"]

        def rec(cls: str) -> str:
            return _s(sm.get(cls, {}).get("recover_s"))

        def peer(name: str, cls: str) -> str:
            ts = [t for t in (res.get("peers") or {}).get(name) or [] if t.get("cls") == cls and t.get("handled")]
            return f"{h.med([t.get('recover_s') for t in ts]):.1f} s" if ts else "not handled"
        out.append(
            f"- **Recovery, from the fault to training again** (`recovery`, {res['plan']['trials']} trials per "
            "fault, the shipped default timeouts, the slowest rank's injection → next committed update): a "
            f"stalled replication link at the boundary {rec('link-boundary')} s and in backward "
            f"{rec('link-backward')} s, the redone update included, with `collective_s` "
            f"{res['timeouts']['collective_s']:g} s; a SIGKILLed rank named by every survivor after "
            f"{sm['kill']['detected_s']['median']:.2f} s, training again (L2, restart) after {rec('kill')} s; a "
            f"SIGSTOPped rank named after {sm['stop']['detected_s']['median']:.2f} s (`heartbeat_s` "
            f"{res['timeouts']['heartbeat_s']:g}), training again after {sm['stop']['recover_s']['median']:.2f} s; "
            f"a bug in the training code: every rank out after {sm['bug']['recover_s']['median']:.2f} s, one "
            f"start; a killed checkpoint daemon: the next update {sm['daemon-kill']['recover_s']['median']:.2f} s "
            "later. torchft driving the same FSDP HSDP job on the same four ranks: "
            f"{peer('torchft', 'link-backward')} for the stalled link, {peer('torchft', 'kill')} for the killed "
            f"rank, the stopped rank {peer('torchft', 'stop')}; NVRx's in-job restart: "
            f"{peer('nvrx', 'link-backward')}, {peer('nvrx', 'kill')} and {peer('nvrx', 'stop')}. "
            + (f"From the first rank's detection of the stalled link in backward to the slowest rank's commit of "
               f"the redone update, on that same job and fault: ours / torchft {_x(det)} ({det['note'].split(';')[0]}). "
               if (det := _row(res, "detection → next commit")) else "")
            + " ".join(f"{r['what'][0].upper()}{r['what'][1:]}: {_x(r)}." for r in _rows(res)
                       if "first snapshot" in r["what"] or "detector" in r["what"]))
    if "l1backward" in R:
        res = R["l1backward"]
        now, before, ft = _row(res, "share recovered in process now"), _row(res, "before backward"), \
            _row(res, "torchft")
        out.append(f"- **L1 for replication-link faults** (`l1backward`): a link failing at a uniformly random "
                   f"moment of an update is recovered in process {now['ratio']:.2f} of the time "
                   f"({now['spread']} over {now['n']} runs; before backward faults were repaired: "
                   f"{before['ratio']:.2f}; goal 0.95 {'met' if now['ratio'] >= 0.95 else 'not met'}). From "
                   f"detection to the next committed update torchft's discard-and-heal, on its own job of two "
                   f"single-process replica groups with a plain all-reduce, takes {_x(ft)} our time"
                   + (" (its update is the cheaper one: the like-for-like comparison is the recovery part's)."
                      if ft and ft["ratio"] < 1 else "."))
    if "repair" in R:
        res = R["repair"]
        out.append(_repair(res, _rows(res)))
    if "paper" in R:
        res = R["paper"]
        a, b = _row(R["paper"], "fault-to-frontier"), _row(R["paper"], "whole run")
        out.append(f"- **L1 against L2** (`paper`): the L2 cold restart takes {_x(a, '{:.1f}')} L1's "
                   f"fault-to-frontier time and {_x(b, '{:.1f}')} the whole run.")
    if "guard" in R:
        res = R["guard"]
        a, b = _row(res, "current code / earlier"), _row(res, "guarded / plain update, current code")
        out.append(f"- **The guard's per-update cost** (`guard`): {_x(a)} of the previous code's, whose vote "
                   f"came after `optimizer.step`, over {a['n'] if a else 0} paired jobs; the guarded update is "
                   f"{_x(b)} the plain one ({(b or {}).get('note', '')}).")
    if "peers" in R:
        res = R["peers"]
        rows = {r.get("key"): r for r in (peer_rows or _rows(res))}

        def cost(key: str, label: str) -> str:
            r = rows.get(key)
            if not r:
                return f"{label} n/a"
            ad = r.get("added")
            return (f"{label} {_x(r)}" + (f", {h.fmt_spread(ad, '{:+.1f}')} ms" if ad and ad.get("median")
                                           is not None else ""))
        f5, f1 = rows.get("f2r_torchft_T"), rows.get("f2r_torchft_S")
        nv, nj = rows.get("f2r_nvrx"), rows.get("f2r_nvrx_injob")
        p = res["params"]
        out.append(f"- **Peers** (`peers`, {', '.join(v.get('title') or k for k, v in res['peers'].items())}): at "
                   f"equal detection timeouts torchft's survivor resumes at {_x(f5)} our fault-to-resume time "
                   f"({p['main_timeout_s']:g} s) and {_x(f1)} ({p['short_timeout_s']:g} s); nvidia-resiliency-ext's "
                   f"in-process wrapper at {_x(nv)} and its in-job restart at {_x(nj)}, because their faults raise "
                   "where ours must wait out a silent peer's timeout. Per-update cost, as a ratio and as added "
                   "milliseconds per update (the updates differ: ours four FSDP ranks, the peers two plain ones): "
                   + "; ".join((cost("ovh_ours", "ours"), cost("ovh_torchft", "torchft"),
                                cost("ovh_nvrx", "the wrapper"))) + ".")
    if "ckpt" in R:
        res = R["ckpt"]
        gl = res.get("goals") or {}
        bw = gl.get("write_bandwidth_both_orders") or {}
        added, blocked = _row(res, "added time per snapshot"), _row(res, "training blocked per snapshot, ours")
        band, floor = _row(res, "write bandwidth"), _row(res, "memcpy floor")
        between = _row(res, "updates between snapshots")
        out.append(f"- **Snapshots** (`ckpt`, {res['param_count'] / 1e6:.0f}M parameters + AdamW, 2 x 2 ranks, a "
                   f"snapshot every {res['plan'].get('K', 3) if isinstance(res.get('plan'), dict) else 3} updates): "
                   f"{(added or {}).get('ratio', 0):.2f}x DCP's best asynchronous mode in added time per snapshot, "
                   f"training blocked {(blocked or {}).get('ratio', 0):.2f}x as long; the write path runs at "
                   + (f"{_x(band)} the ceiling of its shape, {bw.get('ceiling_first', 0):.2f}x with the ceiling "
                      f"written first and {bw.get('ceiling_second', 0):.2f}x with it second"
                      if "ceiling_first" in bw else
                      f"{_x(band)} `dd conv=fsync`, {bw.get('dd_first', 0):.2f}x with `dd` first and "
                      f"{bw.get('dd_second', 0):.2f}x with `dd` second")
                   + f". Training is blocked {_x(floor)} the memcpy "
                   f"floor of the rank's own bytes (goal 1.5x: {'met' if gl.get('blocking_vs_floor', {}).get('pass') else 'not met'}), "
                   f"and the updates between snapshots run at {_x(between)} the no-snapshot update (goal 1.1x: "
                   f"{'met' if gl.get('background', {}).get('pass') else 'not met'}).")
    if "scale" in R:
        from benchmarks.parts.scale import readme_bullet as scale_bullet

        bullet = scale_bullet(R["scale"])
        if bullet:
            out.append(bullet)
    if "shared" in R:
        out.append(f"- **Shared tier** (`shared`): uploading every snapshot costs the updates "
                   f"{_x(_rows(R['shared'])[0] if _rows(R['shared']) else None)}.")
    if "restore" in R:
        res = R["restore"]
        peer_r, shared_r = _row(res, "start to training again", "`peer`"), _row(res, "start to training again",
                                                                                   "`shared`")
        out.append("- **Node-loss restore** (`restore`): start to training again when the snapshot comes from a "
                   f"peer's copy through the shared tier {_x(peer_r)} of the same restart from the node's own "
                   f"copy, from the shared tier alone {_x(shared_r)}.")
    if "status" in R:
        res = R["status"]
        cmd = _row(res, "as a command")
        ms = re.search(r"(\d+) ms vs", (cmd or {}).get("note", ""))
        out.append(f"- **`accelpact-status`** (`status`): {ms.group(1) if ms else 'n/a'} ms as a command on 10,000 "
                   f"events and 100 snapshots, {_x(cmd, '{:.1f}')} a bare parse.")
    if "control" in R:
        res = R["control"]
        big, four = _row(res, "1024"), _row(res, "at 4 members")
        out.append(f"- **The control plane at scale** (`control`): one decision with 1,024 emulated members "
                   f"takes the code before it {_x(big, '{:.1f}')} as long (old / new); at 4 members new / old "
                   f"{_x(four)}.")
    if gpu:
        qual = _row(gpu, "L1 repair")
        out.append(f"- **GPU check** (`scripts/gpu-check.sh`, {gpu.get('date')}, not part of `make bench`): "
                   f"L1 repairs of backward faults on NCCL {_x(qual, '{:.1f}')} the floor of one communicator "
                   f"({(qual or {}).get('note', '').split(' (')[0]}); the rest in its section.")
    return [wrap(x) for x in out]


def wrap(line: str, width: int = 118) -> str:
    """A bullet wrapped as the README's prose is (continuation lines indented under the bullet's text)."""
    import textwrap

    if not line.startswith("- "):
        return "\n".join(textwrap.wrap(line, width, break_long_words=False, break_on_hyphens=False)) or line
    return "\n".join(textwrap.wrap(line, width, subsequent_indent="  ", break_long_words=False,
                                   break_on_hyphens=False))


# ====================================================================== goals


def companion(results_dir: Path, res: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """``<date>/<name>.json`` beside a part's result of that date (the control part's per-update run), or None."""
    if not res or not res.get("date"):
        return None
    path = results_dir / str(res["date"]) / f"{name}.json"
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        return None


def ckpt_goal_figure(key: str, g: dict[str, Any]) -> str:
    """The measured figure of one of the ``ckpt`` part's goals, as the goals table states it."""
    fig = g.get("median_ratio")
    if isinstance(fig, (int, float)):
        return f"{fig:.2f}x"
    if "ceiling_first" in g:
        return f"ceiling first {g['ceiling_first']:.2f}x, ceiling second {g['ceiling_second']:.2f}x"
    if "dd_first" in g:
        return f"dd first {g['dd_first']:.2f}x, dd second {g['dd_second']:.2f}x"
    if key == "daemon_cpu":
        return f"{g.get('cpu_s_per_gib') or 0:.2f} CPU-s per GiB"
    if key == "memory":
        gr = g.get("growth") or {}
        return (f"RSS growth ranks {gr.get('ranks') or 0:.3f}, daemons {gr.get('daemons') or 0:.3f} over "
                f"{g.get('snapshots')} snapshots; {g.get('staging_left_bytes')} bytes left in /dev/shm")
    if key == "commit_in_interval":
        return f"committed {g.get('committed_s') or 0:.1f} s after the call, the interval {g.get('interval_s') or 0:.1f} s"
    return (f"{g.get('ours_added_s', 0):.2f} s against {g.get('best_async_mode')} "
            f"{g.get('best_async_added_s', 0):.2f} s")


def goal_lines(results: dict[str, tuple[dict[str, Any], str]], results_dir: Path | None = None) -> list[str]:
    """One line per goal the stored results state: met or not, the measured figure, and the cause where the
    result names one; a goal whose result cannot decide it says what it awaits."""
    R = {p: res for p, (res, _rel) in results.items()}
    out = []

    def line(part: str, goal: str, verdict: str, why: str) -> None:
        out.append(f"| `{part}` | {goal} | {verdict} | {why} |")

    if "repair" in R:
        m = R["repair"]["main"]
        if m.get("method") is None:
            line("repair", "repair ≤ 1.5x its floor", "not decided",
                 f"the stored run timed one floor sample on the lead rank ({m['total_vs_floor']['median']:.2f}x): "
                 "not a floor; the slowest-rank figure awaits the next `make bench` run")
        else:
            st = m["total_vs_floor"]
            ph = m["phases"]
            top = sorted(ph, key=lambda x: -(ph[x]["vs_floor"].get("median") or 0))[:2]
            line("repair", "repair ≤ 1.5x its floor",
                 "n/a" if st.get("median") is None else ("met" if st["median"] <= 1.5 else "not met"),
                 f"{_s(st)}x; largest phases against the floor: "
                 + ", ".join(f"{x} {ph[x]['vs_floor']['median']:.2f}x" for x in top)
                 + (f"; the affected ranks start {m['start_skew_ms']['median']:.2f} ms apart after the vote"
                    + (f" (the floor's members {m['floor_start_skew_ms']['median']:.2f} ms after their barrier)"
                       if (m.get("floor_start_skew_ms") or {}).get("median") is not None else "")
                    if (m.get("start_skew_ms") or {}).get("median") is not None else "")
                 + (f"; the floor's ranks arrive at its barrier as at the vote; from the last arrival "
                    f"{_s(m['from_last_arrival_vs_floor'])}x"
                    if (m.get("from_last_arrival_vs_floor") or {}).get("median") is not None else ""))
    if "store" in R:
        g = _row(R["store"], "guarded")
        if g:
            line("store", "guarded update ≤ 1.01x " + ("with torch's TCPStore (in one job)" if "same job" in g["what"]
                                                       else "the code before it"),
                 "met" if g["ratio"] <= 1.01 else "not met",
                 f"{_x(g, '{:.3f}')}; {g.get('note', '')}")
    if "l1backward" in R:
        now = _row(R["l1backward"], "share recovered in process now")
        if now:
            line("l1backward", "≥ 0.95 of random-moment link faults recovered in process",
                 "met" if now["ratio"] >= 0.95 else "not met",
                 f"{now['ratio']:.3f} ({now['spread']}); the rest: the first snapshot's capture proof, a "
                 "cross-node collective outside the guard")
    if "ckpt" in R:
        for key, g in (R["ckpt"].get("goals") or {}).items():
            line("ckpt", g.get("goal", key), "met" if g.get("pass") else "not met",
                 ckpt_goal_figure(key, g) + ("" if g.get("pass") else "; the cause, measured: " + (
                     g.get("cause") or "the ckpt section's *Where `ours` blocks* and the daemons' CPU per GiB")))
    if "launch" in R:
        from benchmarks.parts.launch import goal_rows

        for goal, verdict, why in goal_rows(R["launch"]):
            line("launch", goal, verdict, why)
    if "scale" in R:
        from benchmarks.parts.scale import goal_rows as scale_goals

        for goal, verdict, why in scale_goals(R["scale"]):
            line("scale", goal, verdict, why)
    if "recovery" in R:
        for part, goal, verdict, why in recovery_goals(R["recovery"]):
            line(part, goal, verdict, why)
    upd = companion(results_dir, R.get("control"), "control-update") if results_dir else None
    if upd and (upd.get("cost") or {}).get("guarded_ms"):
        c = upd["cost"]["guarded_ms"]
        line("control", "a guarded update at 4 ranks costs no more than the code before the change",
             "met" if c["median"] <= 1.0 or c["min"] <= 1.0 <= c["max"] else "not met",
             f"{c['median']:.3f}x ({c['min']:.3f}–{c['max']:.3f}); the spread over pairs holds 1")
    if "status" in R:
        cmd = _row(R["status"], "as a command")
        ms = re.search(r"(\d+) ms vs", (cmd or {}).get("note", ""))
        if ms:
            line("status", "`accelpact-status` under 500 ms as a command",
                 "met" if int(ms.group(1)) < 500 else "not met", f"{ms.group(1)} ms")
    return out


def replace_block(text: str, mark: str, block: str) -> str:
    """``text`` with the lines between two ``mark`` lines (the marks included) replaced by ``block``."""
    if text.count(mark) < 2:
        raise ValueError(f"{mark} does not appear twice in the text: nowhere to write the block")
    a = text.index(mark)
    b = text.index(mark, a + len(mark)) + len(mark)
    return text[:a] + block.strip() + text[b:]


def block_of(text: str, mark: str) -> str | None:
    if text.count(mark) < 2:
        return None
    a = text.index(mark)
    return text[a:text.index(mark, a + len(mark)) + len(mark)]


def figure_diff(expected: str, actual: str) -> list[str]:
    """Where ``actual`` differs from ``expected``, line by line: each differing line with the figures it has
    and the ones the results give (empty when the texts are the same)."""
    import difflib

    out = []
    exp, act = expected.splitlines(), actual.splitlines()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=exp, b=act, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        want = [f for ln in exp[i1:i2] for f in FIGURE.findall(ln)]
        got = [f for ln in act[j1:j2] for f in FIGURE.findall(ln)]
        changed = [f"{g} (results: {w})" for w, g in zip(want, got) if w != g]
        where = act[j1][:120] if j1 < len(act) else (exp[i1][:120] if i1 < len(exp) else "")
        out.append(f"line {j1 + 1}: {where!r}: "
                   + (", ".join(changed[:6]) if changed else f"{tag}: {i2 - i1} line(s) generated, "
                                                               f"{j2 - j1} in the file"))
    return out


def recovery_goals(res: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The recovery part's goals, each decided from its summary (the slowest rank's seconds per class, the
    first detection, the first snapshot's and the detector's ratios)."""
    sm, t = res["summary"], res["timeouts"]
    out = []

    def med(cls: str, key: str = "recover_s") -> float | None:
        return ((sm.get(cls) or {}).get(key) or {}).get("median")

    for cls, goal, value, limit in (
            ("link-boundary", "link fault at the boundary: training again ≤ 1.0 s plus the redone update",
             med("link-boundary"), 1.0),
            ("link-backward", "link fault in backward: training again ≤ 1.0 s plus the redone update",
             med("link-backward"), 1.0),
            ("kill", "SIGKILL of a rank: named ≤ 0.5 s", med("kill", "detected_s"), 0.5),
            ("kill", "SIGKILL of a rank: training again ≤ 5 s (L2)", med("kill"), 5.0),
            ("stop", f"SIGSTOP of a rank: fail-stop ≤ heartbeat_s + 1 s ({t['heartbeat_s'] + 1:g} s)",
             med("stop", "detected_s"), t["heartbeat_s"] + 1),
            ("bug", "a training-code exception: every rank out ≤ 1 s, one start", med("bug"), 1.0)):
        if value is None:
            out.append(("recovery", goal, "not decided", "no trial of it in the stored result"))
        else:
            out.append(("recovery", goal, "met" if value <= limit else "not met",
                        f"{value:.2f} s (median, slowest rank)" + ("" if value <= limit else
                                                                   f"; over the {limit:g} s limit")))
    d = (sm.get("daemon-kill") or {}).get("recover_s") or {}
    out.append(("recovery", "a killed checkpoint daemon: training goes on",
                "met" if d.get("n") else "not decided",
                f"the next update {d['median']:.2f} s later" if d.get("n") else "no trial"))
    for r in _rows(res):
        m = re.search(r"goal ≤ ([\d.]+)x", r.get("note") or "")
        if m and r.get("ratio") is not None:
            out.append(("recovery", f"{r['what']}: ≤ {m.group(1)}x",
                        "met" if r["ratio"] <= float(m.group(1)) else "not met", _x(r)))
    return out
