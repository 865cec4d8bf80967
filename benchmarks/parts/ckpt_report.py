"""Checkpoint benchmark, the report: the markdown block and its plain-language reading (``benchmarks/parts/ckpt.py``).

Rendered from the result JSON alone (``bench_all.py`` re-renders earlier results with it).
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import common as h
from benchmarks.parts.ckpt_soak import soak_lines
from benchmarks.parts.ckpt_analysis import mean_parts
from benchmarks.parts.ckpt_setup import ASYNC_DCP, MARK, MODE_TEXT, MODES

_f = h.fmt
_rng = h.fmt_spread
_med = h.med


def markdown(res: dict[str, Any]) -> str:
    m, p, st, bw, g = res["machine"], res["params"], res["steps"], res["bandwidth"], res["goals"]
    lines = [
        MARK,
        "## Checkpoint service: snapshot cost and write bandwidth",
        "",
        f"Written by `benchmarks/parts/ckpt.py` on {res['date']} (raw data: `{res['json']}`).",
        "",
        f"**Machine.** {m['cpus']} CPU cores ({m['cpu_model']}), {m['memory_gib']} GiB memory, shared and noisy "
        f"(load average at start {', '.join(f'{x:.1f}' for x in m['loadavg_start'])}); Python {m['python']}, torch "
        f"{m['torch']}; snapshots written to {bw.get('filesystem', 'unknown')}.",
        "",
        f"**What ran.** One job on the embedded default: 2 emulated nodes x 2 ranks, FSDP1 `HYBRID_SHARD` on the "
        f"2-D device mesh over Gloo, `CausalDecoder` with {p['layers']} layers, width {p['width']}, vocab "
        f"{p['vocab']}, seq_len {p['seq_len']} (**{res['param_count'] / 1e6:.1f}M parameters**; model + AdamW "
        f"= {res['state_bytes'] / 2**30:.2f} GiB per node copy), batch {res['batch']} per rank. The ranks run the "
        f"real `accelpact-run` rank path (the public API: `job.protect`, `run.update()`) and the per-node daemons; "
        f"the benchmark's entry point picks the mode. {res['plan']['warmup']} warm-up updates, then {res['plan']['rounds']} round(s); each round "
        f"runs every mode for {res['plan']['every'] * res['plan']['windows']} updates, a snapshot in the first of "
        f"every K={res['plan']['every']} (order rotated per round), then drains outside the timed updates "
        f"(async writes, the daemons' write + verification). Between segments, untimed: DefaultStagers "
        f"are closed (a live one keeps its last staged copy), freed heap is returned (`malloc_trim`), DCP's "
        f"checkpoint process is started before and stopped after each `dcp_process` segment (start-up reported "
        f"below) — without these, 4 ranks + 2 daemons exceeded the 24 GiB here (OOM kills in two attempts); lowest "
        f"MemAvailable in this run {_f((res.get('machine_during_steps') or {}).get('min_mem_available_gib'))} GiB. "
        f"DefaultStager's copy runs while training goes on, so the next `optimizer.step` waits for it (counted; "
        f"it never had to wait more than "
        f"{max([r.get('staging_wait_s', 0.0) for r in res.get('raw', {}).get('records', [])] or [0.0]):.2f} s). "
        f"Whole benchmark: {_f((res.get('total_wall_s') or 0) / 60, '{:.1f}')} min. Ratios are "
        f"paired with the two `none` segments of the same round; figures are the median over rounds (min–max).",
        "",
        "- *step-time ratio* = mean update time over the mode's windows (a snapshot update and the K−1 updates "
        "that run while it is written) / mean `none` update time of the same round; *others* = the same for "
        "the updates without a snapshot only (background interference);",
        "- *added per snapshot* = mean time of the updates that took a snapshot (blocking part included; for "
        "DefaultStager plus the wait for staging before the next `optimizer.step`) − "
        + ("the mean of the round's `none` updates at the same places in their segments (a segment's first update "
           "is slower anyway);" if any("baseline_at_snapshot_places_s" in r for m in st.values()
                                       for r in m.get("rounds", [])) else "the round's mean `none` update time;"),
        "- *blocking* = time the training loop spent inside the checkpoint call (plus that staging wait), measured "
        "directly — less noisy than the difference of update times;",
        "- *left over* = background work still running after the window's K updates (the drain), seconds.",
        "",
        "| mode | step-time ratio vs none | others | added per snapshot (s) | blocking (s) | left over (s) "
        "| mean update (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        s = st.get(mode)
        if not s:
            continue
        if mode == "none":
            lines.append(f"| none — {MODE_TEXT[mode]} | 1 | 1 | — | — | — | {_rng(s['mean_step_s'])} |")
            continue
        lines.append(f"| {mode} — {MODE_TEXT[mode]} | {_rng(s['ratio'])} | {_rng(s['others_ratio'])} "
                     f"| {_rng(s['added_per_snapshot_s'])} | {_rng(s['blocking_s'])} | {_rng(s['drain_s'], '{:.1f}')} "
                     f"| {_rng(s['mean_step_s'])} |")
    ours = st.get("ours", {})
    parts = mean_parts([r["parts"] for r in ours.get("rounds", [])])
    if parts:
        cpu = parts.pop("copy_cpu", None)  # the copy's own CPU time: inside *copy*, not beside it
        rest = (ours.get("blocking_s", {}).get("median") or 0.0) - sum(v for k, v in parts.items() if "." not in k)
        lines += ["", "Where `ours` blocks (mean per snapshot, s): " + ", ".join(
            f"{k} {v:.2f}" + (f" (on a core {cpu:.2f})" if k == "copy" and cpu is not None else "")
            for k, v in parts.items()) + f", rest {max(rest, 0.0):.2f}. *wait_slot*: asking the "
            "daemon whether the slot to reuse is free (backpressure); *extra*: the exchange of every rank's extra "
            "state (frontier, RNG, data loader, scheduler) over the control plane; *proof*: the staged bytes "
            "against the live state dict, only until one snapshot proved the capture (the first of each start); "
            "*plan*: reading FSDP's flat-parameter shard info; *copy*: the memcpy into the shared-memory slot; "
            "*hand_over*: starting the thread that writes the descriptor and tells the daemon (both run beside the "
            "next update; the next snapshot, a wait and a fail-stop join it). DCP writes one deduplicated copy per job; ours "
            "writes one complete copy per node (two here) and verifies each (checksums + coverage) in the "
            "background."]
    if ours.get("others_by_pos"):
        lines += ["Updates without a snapshot, `ours` / `none` at the same place in the window (median over rounds): "
                  + ", ".join(f"update {k} of {res['plan']['every']} {_rng(v)}" for k, v in ours["others_by_pos"].items())
                  + " (the first update after a snapshot also fingerprints the rank's state for the replay check)."]
    if ours.get("memcpy_floor_before_s", {}).get("median"):
        below = sum(len(r.get("below_floor") or []) for r in ours.get("rounds", []))
        lines += [f"Memcpy floor (a plain copy of the rank's same tensors' bytes into a touched buffer of their size, "
                  f"as the snapshot copies them into its slot; same ranks, same run), right before each timed "
                  f"snapshot (left out of the update's time) {_rng(ours['memcpy_floor_before_s'], '{:.3f}')} s and "
                  f"right after it {_rng(ours['memcpy_floor_after_s'], '{:.3f}')} s; blocking / floor (the mean of "
                  f"the two) {_rng(ours['blocking_over_floor'])} (median over rounds); snapshots that blocked less "
                  f"than their floor (flagged, in the JSON's `below_floor`): {below}."]
    elif ours.get("memcpy_floor_s", {}).get("median"):
        lines += [f"Memcpy floor (a plain copy of the same tensors' bytes into preallocated, touched memory, right "
                  f"after each timed snapshot, same ranks, same run): {_rng(ours['memcpy_floor_s'], '{:.3f}')} s per "
                  f"snapshot; blocking / floor {_rng(ours['blocking_over_floor'])} (median over rounds)."]
    dl = res.get("daemon_latency") or {}
    if dl.get("committed", {}).get("n"):
        wp = dl.get("writer_parts_s") or {}
        lines += [f"Daemon latency from the snapshot call (both nodes): committed after {_rng(dl['committed'], '{:.1f}')} s, "
                  f"verified (checksums + coverage) after {_rng(dl['verified'], '{:.1f}')} s. "
                  "Inside the writer (medians): " + ", ".join(f"{k} {v:.2f}" for k, v in wp.items() if v is not None)
                  + "."]
    first = res.get("ours_first_snapshot")
    if first:
        lines += [f"The first `ours` snapshot of a start (taken untimed at the end of the warm-up, then waited for: "
                  f"{first.get('state')}) blocked {_f(first.get('total'))} s: it creates the shared-memory slot "
                  f"(first touch of its pages; copy {_f(first.get('copy'))} s) and proves the capture: the staged bytes "
                  f"against the live state dict ({_f(first.get('proof'))} s, a `get_state_dict` collective). A job pays "
                  f"this once per start."]
    fc = res.get("dcp_process_start") or []
    if fc:
        lines += [f"DCP process executor start (a tiny first save, untimed, before each `dcp_process` segment; the "
                  f"process is stopped after the segment for lack of memory): call "
                  f"{_med([f['call_s'] for f in fc]):.2f} s, done after {_med([f['done_s'] for f in fc]):.2f} s "
                  f"(medians of {len(fc)})."]
    lines += [] if not bw.get("pairs") else write_path_lines(bw) if bw.get("ratio_ceiling") else [
        "",
        f"**Write bandwidth** (one node's snapshot, {bw['pairs'][0]['ours_bytes'] / 2**30:.2f} "
        f"GiB; {len(bw['pairs'])} pairs, order alternated): the daemon's write path (map the two ranks' "
        "shared-memory slots, build the DCP state from their boxes, DCP save of every box as a chunk into "
        f"{bw.get('write_threads', 1)} file(s) written in parallel, each hashed ({_digest(bw)}) as it is written, its "
        "write-back started while it is written, fsynced and dropped from the page cache; manifest, rename) vs "
        "`dd if=/dev/zero bs=4M conv=fsync` of the same size on the same filesystem. The verification (re-read "
        f"from the disk, {_digest(bw)}, coverage) runs after both writes of a pair, untimed in the ratio.",
        "",
        "| | median (min–max) |",
        "|---|---|",
        f"| ours / dd, whole write path | {_rng(bw['ratio_full'])} |",
        f"| ours, GB/s (absolute, this run only) | {_rng(bw['ours_GBps'])} |",
        f"| dd, GB/s (absolute, this run only) | {_rng(bw['dd_GBps'])} |",
        *([f"| share of the state's bytes written from the slots (no copy) | {_rng(bw['from_slot_share'])} |"]
          if bw.get("from_slot_share") else []),
        "",
        _write_parts_line(bw),
        *order_effect_lines(bw),
    ]
    lines += [
        *cpu_lines(bw),
        *soak_lines(res.get("soak")),
        "",
        "**Goals.**",
        "",
    ]
    g1, g2 = g["snapshot_cost"], g["write_bandwidth"]
    verdict = {True: "**PASS**", False: "**FAIL**", None: "**n/a**"}
    lines.append(f"1. Added time per snapshot ≤ half of DCP's best async mode: {verdict[g1['pass']]} — ours "
                 f"{_f(g1['ours_added_s'])} s vs best async `{g1['best_async_mode']}` {_f(g1['best_async_added_s'])} s "
                 f"(limit {_f(g1['limit_s'])} s). By directly measured blocking time: ours "
                 f"{_f(g1['blocking_check']['ours_blocking_s'])} s vs `{g1['blocking_check']['best_async_mode']}` "
                 f"{_f(g1['blocking_check']['best_async_blocking_s'], '{:.3f}')} s: "
                 f"{verdict[g1['blocking_check']['pass']]}.")
    if bw.get("ratio_ceiling"):
        lines.append(f"2. Daemon write bandwidth ≥ 90% of the ceiling of its shape: {verdict[g2['pass']]} — median "
                     f"ratio {_f(g2['median_ratio'])} (against dd's one stream: {_f(g2.get('dd_median_ratio'))}).")
    else:
        lines.append(f"2. Daemon write bandwidth ≥ 90% of dd's: {verdict[g2['pass']]} — median ratio "
                     f"{_f(g2['median_ratio'])}.")
    g3, g4, g5 = g.get("write_bandwidth_both_orders"), g.get("blocking_vs_floor"), g.get("background")
    if g3 and "ceiling_first" in g3:
        lines.append(f"3. The same in both orders: {verdict[g3['pass']]} — median ratio with the ceiling run first "
                     f"{_f(g3['ceiling_first'])}, with it run second {_f(g3['ceiling_second'])}.")
    elif g3:
        lines.append(f"3. The same in both orders: {verdict[g3['pass']]} — median ratio with dd run first "
                     f"{_f(g3['dd_first'])}, with dd run second {_f(g3['dd_second'])}.")
    if g4:
        lines.append(f"4. Training blocked per snapshot ≤ 1.5x the memcpy floor of the rank's own bytes: "
                     f"{verdict[g4['pass']]} — median {_f(g4['median_ratio'])}"
                     f"{'x' if g4['median_ratio'] is not None else ' (no floor measured)'}."
                     + (f" Measured cause: {g4['cause']}." if g4.get("cause") else ""))
    if g5:
        lines.append(f"5. Updates between snapshots ≤ 1.1x the no-snapshot update: {verdict[g5['pass']]} — median "
                     f"{_f(g5['median_ratio'])}x.")
    g7 = g.get("daemon_cpu")
    if g7 and g7.get("ceiling_write") is not None:
        rest = None if g7["cpu_s_per_gib"] is None else (g7["cpu_s_per_gib"] - g7["ceiling_write"]
                                                          - 2 * (g7["digest_alone"] or 0))
        lines.append(f"7. Daemon CPU ≤ 0.7 s per GiB written and verified: {verdict[g7['pass']]} — "
                     f"{_f(g7['cpu_s_per_gib'])} s (write {_f(g7['write'])}, verification {_f(g7['verify'])}). "
                     f"Measured cause: the kernel's own cost of writing the bytes this way (the ceiling's CPU, no "
                     f"serialisation, no digest) is {_f(g7['ceiling_write'])} s per GiB, the digest alone "
                     f"{_f(g7['digest_alone'])} s per GiB once in each, the rest (DCP's serialisation, the re-read "
                     f"from the disk, coverage) {_f(rest)} s.")
    g6 = g.get("memory")
    if g6:
        lines.append(f"6. Memory flat over {g6['snapshots']} snapshots and nothing left in /dev/shm: "
                     f"{verdict[g6['pass']]} — growth ranks {_f(g6['growth']['ranks'], '{:.3f}')}, daemons "
                     f"{_f(g6['growth']['daemons'], '{:.3f}')}; {g6['staging_left_bytes']} bytes left.")
    if res.get("analysis"):
        lines += ["", *res["analysis"]]
    lines += ["", MARK]
    return "\n".join(lines)


def _write_parts_line(bw: dict[str, Any]) -> str:
    return "Median seconds per write: " + ", ".join(f"{k} {v:.2f}" for k, v in bw["parts_median_s"].items()
                                                    if v is not None) + "."


def write_path_lines(bw: dict[str, Any]) -> list[str]:
    """The write bandwidth section of a result with the ceiling of the write path's shape."""
    by = bw.get("ratio_ceiling_by_order") or {}
    return [
        "",
        f"**Write bandwidth** (one node's snapshot, "
        f"{(bw['pairs'][0].get('state_bytes') or bw['pairs'][0]['ours_bytes']) / 2**30:.2f} GiB; "
        f"{len(bw['pairs'])} rounds of three writes, the six orders in turn): the daemon's write path "
        "(map the two ranks' shared-memory slots, build the DCP state from their boxes, DCP save of every box as a "
        f"chunk into {bw.get('write_threads', 1)} file(s) written in parallel, each hashed ({_digest(bw)}) as it is "
        "written, through the writer's `Sink` (direct I/O where the file system allows it: each box of 1 MiB or "
        "more from the slot itself, on a page of the file, the rest through two page-aligned 8 MiB buffers, one "
        "filled while the other is written; else the page cache, write-back started every 32 MiB), fsynced; "
        "manifest, rename) against the **ceiling of the same shape** (`ckpt_bandwidth._write_ceiling`: "
        "the same slots' bytes into as many files on as many threads, in 4 MiB pieces through the same `Sink`, "
        "from the slots as they lie, fsync; no serialisation, digest, manifest or rename), both in GB/s of the "
        "state's bytes (a file's padding is not throughput), and `dd if=/dev/zero bs=4M conv=fsync` of the same size (one stream, for "
        f"reference). The verification (re-read from the disk, {_digest(bw)}, coverage) runs after the three writes "
        "of a round, untimed in the ratios.",
        "",
        "| | median (min–max) |",
        "|---|---|",
        f"| ours / ceiling of the same shape | {_rng(bw['ratio_ceiling'])} |",
        f"| ours / ceiling, ours written first | {_rng(by.get('ours_first') or {})} |",
        f"| ours / ceiling, the ceiling written first | {_rng(by.get('ceiling_first') or {})} |",
        f"| ours / dd (one stream) | {_rng(bw['ratio_full'])} |",
        f"| ours, GB/s (absolute, this run only) | {_rng(bw['ours_GBps'])} |",
        f"| ceiling, GB/s (absolute, this run only) | {_rng(bw['ceiling_GBps'])} |",
        f"| dd, GB/s (absolute, this run only) | {_rng(bw['dd_GBps'])} |",
        *([f"| share of the state's bytes written from the slots (no copy) | {_rng(bw['from_slot_share'])} |"]
          if bw.get("from_slot_share") else []),
        "",
        _write_parts_line(bw),
    ]


def order_effect_lines(bw: dict[str, Any]) -> list[str]:
    """dd's rate by position in the pair (even pairs: ours first, so dd runs right after our write)."""
    after = [p for p in bw.get("pairs", []) if p["pair"] % 2 == 0]
    first = [p for p in bw.get("pairs", []) if p["pair"] % 2 == 1]
    if not after or not first:
        return []
    return ["", f"dd ran at {_f(_med([p['dd_GBps'] for p in first]))} GB/s (median) when it went first and "
                f"{_f(_med([p['dd_GBps'] for p in after]))} GB/s right after our write; against dd run second ours is at {_f(_med([p['ratio_full'] for p in after]))}, "
                f"against dd run first at {_f(_med([p['ratio_full'] for p in first]))}."]


def cpu_lines(bw: dict[str, Any]) -> list[str]:
    """The daemon's CPU seconds per GiB written, by activity."""
    c = bw.get("cpu_s_per_gib")
    if not c:
        return []
    alg = _digest(bw)
    alone = f"{alg} alone costs {_f(c.get(alg.lower().replace('-', '') + '_alone'))} s per GiB here"
    if alg != "SHA-256" and c.get("sha256_alone") is not None:
        alone += f" (SHA-256 {_f(c['sha256_alone'])} s, measured beside it)"
    return ["", f"The daemon's CPU per GiB written (process CPU time, all threads, medians): write path "
                f"{_f(c.get('write'))} s (serialisation, the copy into the sink's buffers, the writes, {alg} while "
                f"writing, fsync), "
                f"verification {_f(c.get('verify'))} s (re-read from the disk, {alg}, coverage); {alone}, once in "
                f"each."]


def _digest(bw: dict[str, Any]) -> str:
    """The file digest the measured write path used (results before it was recorded: SHA-256)."""
    return {"blake3": "BLAKE3", "sha256": "SHA-256"}.get(bw.get("digest", "sha256"), str(bw.get("digest")))


def analysis_lines(res: dict[str, Any]) -> list[str]:
    """Plain-language reasons, from the measured numbers."""
    out = []
    st, g, bw = res["steps"], res["goals"], res["bandwidth"]
    ours = st.get("ours", {})
    parts = mean_parts([r["parts"] for r in ours.get("rounds", [])])
    dcp_sd = _med([v for m in ASYNC_DCP for r in st.get(m, {}).get("rounds", [])
                   for k, v in r["parts"].items() if k == "state_dict"])
    if parts:
        verdict = "passes" if g["snapshot_cost"]["pass"] else "fails"
        out.append(
            f"Goal 1 {verdict}: `SnapshotClient.snapshot()` calls no `get_state_dict` on FSDP1 once the capture "
            f"is proven (DCP's modes "
            f"pay {_f(dcp_sd)} s for it per snapshot: FSDP1 all-gathers every parameter's AdamW state and "
            f"re-shards it). It reads FSDP's flat-parameter shard info ({parts.get('plan', 0.0):.2f} s), copies the "
            f"rank's slice of weights and both moments into a preallocated shared-memory slot "
            f"({parts.get('copy', 0.0):.2f} s) and hands a descriptor to the daemon; the capture proof against the "
            f"live state dict (a `get_state_dict`, {parts.get('proof', 0.0):.2f} s on average here) runs only until "
            f"one snapshot proved the capture (the untimed first one of the start).")
    if ours.get("others_ratio", {}).get("median"):
        dl = res.get("daemon_latency", {})
        window = res["plan"]["every"] * (st.get("none", {}).get("mean_step_s", {}).get("median") or 0)
        verified = dl.get("verified", {}).get("median")
        committed = dl.get("committed", {}).get("median")
        behind = (f"longer than a K={res['plan']['every']} window (~{window:.0f} s): at this cadence the "
                  f"daemons would fall behind, and the ranks' backpressure would skip snapshots rather than stall"
                  if committed is not None and committed > window else
                  f"within a K={res['plan']['every']} window (~{window:.0f} s), so the slot is free again before "
                  f"the next snapshot")
        out.append(
            f"Background cost: the updates after an `ours` snapshot ran at {_f(ours['others_ratio']['median'])}x "
            f"the baseline (DCP async: {', '.join(_f(st[m]['others_ratio']['median']) for m in ASYNC_DCP if m in st)}): "
            f"each node's daemon writes and hashes a full copy and later verifies it (checksums + coverage), on "
            f"the same 2 cores as the 4 ranks; the update after a snapshot also fingerprints the model for the "
            f"replay check of a later reload. Committed after "
            f"{_f(committed, '{:.1f}')} s, verified after {_f(verified, '{:.1f}')} s: {behind}.")
    pm = bw["parts_median_s"]
    if not bw.get("pairs"):  # the bandwidth part was left out (--bw-pairs 0): nothing to say of the write path
        return out
    if "dcp_save_s" not in pm:  # a result from before the write path hashed while writing
        out.append(
            f"Write path {'meets' if g['write_bandwidth']['pass'] else 'misses'} goal 2: per write, mapping the "
            f"slots takes {pm.get('map_s', 0):.2f} s, building the state {pm.get('build_state', 0):.2f} s, DCP's "
            f"serialisation + writes {pm.get('ours_write_only_s', 0):.2f} s and fsync "
            f"overlapped with SHA-256 {pm.get('fsync_and_hash', 0):.2f} s; dd took {pm.get('dd_s', 0):.2f} s.")
        return out
    if bw.get("ratio_ceiling"):
        out.append(
            f"Write path {'meets' if g['write_bandwidth']['pass'] else 'misses'} goal 2: per write, mapping the "
            f"slots takes {pm.get('map_s') or 0:.2f} s, building the state from the boxes "
            f"{pm.get('build_state') or 0:.2f} s (no copy), DCP's save (serialisation, writes, {_digest(bw)} while "
            f"writing, fsync) {pm.get('dcp_save_s') or 0:.2f} s, manifest and commit "
            f"{pm.get('manifest_commit_s') or 0:.2f} s; the ceiling of its shape took {pm.get('ceiling_s') or 0:.2f} s "
            f"and dd {pm.get('dd_s') or 0:.2f} s (the disk: the ceiling ran at "
            f"{_f(bw['ceiling_GBps']['min'])}–{_f(bw['ceiling_GBps']['max'])} GB/s).")
        return out
    out.append(
        f"Write path {'meets' if g['write_bandwidth']['pass'] else 'misses'} goal 2: per write, mapping the slots "
        f"takes {pm.get('map_s') or 0:.2f} s, building the state from the boxes {pm.get('build_state') or 0:.2f} s "
        f"(no copy), DCP's save (serialisation, writes, {_digest(bw)} while writing, fsync) {pm.get('dcp_save_s') or 0:.2f} s, "
        f"manifest and commit {pm.get('manifest_commit_s') or 0:.2f} s; dd took {pm.get('dd_s') or 0:.2f} s "
        f"(a noisy disk: dd ran at {_f(bw['dd_GBps']['min'])}–{_f(bw['dd_GBps']['max'])} GB/s).")
    return out
