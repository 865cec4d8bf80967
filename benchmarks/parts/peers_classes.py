"""Peers benchmark, the fault classes: every system on every fault class, its measured result, "not handled",
or "not measured" with the reason (pure; ``benchmarks/parts/peers.py``).

Two parts measure the systems side by side: this one (``peers``: one fault after update 15 of a 25-update run,
each system's own kind of fault) and ``recovery`` (``benchmarks/parts/recovery.py``: ours on every class, torchft
and NVRx's in-job restart on the classes they take, driving the same FSDP HSDP job on four ranks).  The table
takes each cell from whichever part measured it and says which; a cell neither part measured says why.  It is
built from the two results alone (``matrix(peers, recovery)``); without the recovery result (the part rendered
alone) its cells say that the recovery part measures them.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import common as h

#: The fault classes, in the recovery part's names, with the label of the table's rows.
CLASSES: tuple[tuple[str, str], ...] = (
    ("link-boundary", "replication link stalled at the update's boundary (a live peer withholds its part)"),
    ("link-backward", "replication link stalled in backward (the gradient all-reduce)"),
    ("kill", "a rank's process killed (SIGKILL)"),
    ("stop", "a rank hung (SIGSTOP)"),
    ("bug", "an exception in the training code"),
    ("daemon-kill", "the checkpoint daemon killed"),
)
#: The systems, in the table's columns: (key, label, the recovery part's name for it or None).
SYSTEMS: tuple[tuple[str, str, str | None], ...] = (
    ("ours", "ours", "ours"),
    ("torchft", "torchft", "torchft"),
    ("nvrx", "NVRx in-process Wrapper", None),
    ("nvrx_injob", "NVRx in-job restart", "nvrx"),
)
#: Why a cell has no run in either part (the class and the system as both parts run them today).
NOT_MEASURED: dict[tuple[str, str], str] = {
    ("torchft", "link-boundary"): "torchft has no boundary collective of its own to withhold; the recovery part "
                                  "stalls its gradient all-reduce (the row below)",
    ("nvrx", "link-boundary"): "the Wrapper runs in this part only, with a raised exception as its fault",
    ("nvrx", "link-backward"): "the Wrapper runs in this part only, with a raised exception as its fault",
    ("nvrx", "kill"): "the Wrapper runs in this part only, with a raised exception as its fault; a dead process "
                      "is the in-job restart's case",
    ("nvrx", "stop"): "the Wrapper runs in this part only, with a raised exception as its fault",
    ("nvrx_injob", "link-boundary"): "the in-job restart has no boundary collective of its own to withhold; the "
                                     "recovery part stalls its gradient all-reduce (the row below)",
}
NO_COMPONENT = "no such component (the peer has no checkpoint daemon)"


def _recovery_cell(recovery: dict[str, Any], system: str | None, cls: str) -> str | None:
    """The recovery part's figure for ``system`` on ``cls``, or None when it ran no trial of it."""
    if system is None:
        return None
    if system == "ours":
        c = (recovery.get("summary") or {}).get(cls)
        if not c or not (c.get("recover_s") or {}).get("n"):
            return None
        how = "L1 in process" if (c.get("repair_s") or {}).get("n") else (
            "to the job's exit, not requeued" if cls == "bug" else
            "training goes on" if cls == "daemon-kill" else "L2 restart")
        return f"{h.fmt_spread(c['recover_s'])} s ({how}; recovery part, n {c['recover_s']['n']})"
    trials = [t for t in (recovery.get("peers") or {}).get(system) or [] if t.get("cls") == cls]
    if not trials:
        return None
    if not any(t.get("handled") for t in trials):
        why = next((t.get("not_handled_because") for t in trials if t.get("not_handled_because")), "")
        return f"**not handled** ({len(trials)} of {len(trials)} trials; {str(why)[:160]}; recovery part)"
    st = h.spread(t.get("recover_s") for t in trials if t.get("handled"))
    miss = sum(1 for t in trials if not t.get("handled"))
    return (f"{h.fmt_spread(st)} s (recovery part, n {st['n']}"
            + (f"; {miss} trial(s) not handled" if miss else "") + ")")


def _peers_cells(peers: dict[str, Any]) -> dict[tuple[str, str], str]:
    """This part's own figures: fault → update 16 committed, at the main detection timeout."""
    rows = {r.get("key"): r for r in peers.get("rows") or []}
    T = (peers.get("params") or {}).get("main_timeout_s")
    ab = (peers.get("summary") or {}).get("abs") or {}
    out = {}
    for system, run, cls, key, how in (
            ("ours", "ours_T", "link-boundary", None, "L1 in process"),
            ("torchft", "torchft_T", "kill", "f2r_torchft_T", "the survivor goes on"),
            ("nvrx", "nvrx", "bug", "f2r_nvrx", "the training function restarted in process"),
            ("nvrx_injob", "nvrx_injob", "kill", "f2r_nvrx_injob", "both ranks restarted, replay from the checkpoint")):
        st = ab.get(run, {}).get("fault_to_resume_s")
        if not st or not st.get("n") or (key is not None and key not in rows):
            continue
        out[(system, cls)] = (f"{h.fmt_spread(st)} s ({how}; this part, timeout {T:g} s, n {st['n']})"
                              if T is not None else f"{h.fmt_spread(st)} s ({how}; this part)")
    return out


def matrix(peers: dict[str, Any], recovery: dict[str, Any] | None) -> list[str]:
    """The markdown table: a row per fault class, a column per system (pure)."""
    own = _peers_cells(peers)
    head = "| fault class | " + " | ".join(label for _k, label, _r in SYSTEMS) + " |"
    out = [head, "|---" * (len(SYSTEMS) + 1) + "|"]
    for cls, label in CLASSES:
        cells = []
        for key, _label, rec_name in SYSTEMS:
            found = [c for c in (own.get((key, cls)),
                                 _recovery_cell(recovery, rec_name, cls) if recovery else None) if c]
            if found:
                cells.append("; ".join(found))
            elif cls == "daemon-kill" and key != "ours":
                cells.append(NO_COMPONENT)
            elif recovery is None and rec_name is not None:
                cells.append("not measured in this part (the recovery part measures it; `make bench` renders its "
                             "figure here)")
            else:
                cells.append("not measured: " + NOT_MEASURED.get((key, cls), "no trial of it in this part or the "
                                                                            "recovery part"))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def section(peers: dict[str, Any], recovery: dict[str, Any] | None) -> list[str]:
    """The table with its heading and how to read it."""
    when = (f"the recovery part of {recovery.get('date', '?')} (`{recovery.get('json', 'its JSON')}`)"
            if recovery else "the recovery part (not given to this rendering)")
    return ["**Every system on every fault class.** Injection (or the fault) → training committing again, "
            f"median (min–max) s; each cell from this part ({peers.get('date', '?')}) or {when}, which say which; "
            "*not handled*: measured, and the system did not recover (the reason from the trial); *not "
            "measured*: neither part runs it, and why. Timeouts differ between the parts (each part's own section "
            "has them), so compare within a cell's part.", "", *matrix(peers, recovery), ""]
