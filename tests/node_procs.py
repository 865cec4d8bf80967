"""Every process of one (emulated) node, from a run's event log: what a test SIGKILLs to lose exactly one node.

Each process of a job writes one ``process`` event at its start (``accelpact_slurm/core/events.py``): its role
(``rank``, ``store``, ``store-standby``, ``daemon``, ``spare``; the launcher and its zygote sit on no node), pid and node index.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Iterable

from accelpact_slurm.core.events import read_events


def processes(events: Iterable[dict[str, Any]], restart: int | None = None) -> list[dict[str, Any]]:
    """The ``process`` events of start ``restart`` (default: the newest start that has any)."""
    procs = [e for e in events if e.get("event") == "process"]
    if restart is None and procs:
        restart = max(int(e.get("restart") or 0) for e in procs)
    return [e for e in procs if int(e.get("restart") or 0) == restart]


def node_pids(events: Iterable[dict[str, Any]], node: int, restart: int | None = None) -> dict[int, str]:
    """``{pid: role}`` of every process of node index ``node`` in start ``restart`` (default: the newest)."""
    return {int(e["pid"]): str(e["role"]) for e in processes(events, restart) if e.get("node") == node}


def kill_node(run_dir: str, node: int, restart: int | None = None, sig: int = signal.SIGKILL) -> dict[int, str]:
    """Send ``sig`` to every live process of node index ``node`` (found in ``run_dir``'s event log); returns the
    ``{pid: role}`` it found."""
    found = node_pids(read_events(os.path.join(run_dir, "events.jsonl")), node, restart)
    for pid in found:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
