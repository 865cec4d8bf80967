"""Out of memory: whether the kernel's OOM killer ended a rank, and how much memory it held.

A rank killed by the OOM killer dies of SIGKILL like any other crash; a restart runs into the same limit at the
same place.  So the witness of a death (a node peer's liveness thread, :mod:`.liveness`) asks the kernel:

- every rank's heartbeat record carries its memory (:func:`own_memory`): its memory cgroup's directory, that
  cgroup's OOM-kill count as the rank last read it, and its peak RSS (``ru_maxrss``);
- at its death, the witness reads the count again (cgroup v2 ``memory.events``, v1 ``memory.oom_control``: the
  line ``oom_kill N``).  A count that rose since the rank's last record is the OOM killer's doing
  (:func:`after_death`); the kernel's own record (``Killed process PID ... anon-rss``, read from ``/dev/kmsg``
  where this user may) adds the RSS the rank held when it was killed.

Who calls: :class:`accelpact_slurm.runtime.detection.liveness.Publisher` (the record, the death); :func:`describe` words
it for the ``dead`` verdict, so the ``fail_stop`` event, ``accelpact-status`` and the console name it.
"""

from __future__ import annotations

import os
import re
import resource
import time
from typing import Any

#: Where the cgroup hierarchies are mounted: the unified one (v2, or the hybrid's ``unified``), and v1's memory.
V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
V1_MEMORY_ROOT = "/sys/fs/cgroup/memory"
#: How long the witness waits for the kernel's record of a kill whose count it saw (written just after the signal).
KERNEL_RECORD_WAIT_S = 0.2

_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\).*?anon-rss:(\d+)kB, file-rss:(\d+)kB, shmem-rss:(\d+)kB")


def memory_cgroup(pid: int | str = "self") -> str | None:
    """The directory of the memory cgroup ``pid`` is charged to (v2, else v1), or None where none can be read."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:  # v1: "4:memory:/path" (a memory controller bound there wins)
        _h, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            d = V1_MEMORY_ROOT + path.rstrip("/")
            return d if os.path.exists(os.path.join(d, "memory.oom_control")) else None
    for line in lines:  # v2: "0::/path"
        h, ctrls, path = line.split(":", 2)
        if h == "0" and not ctrls:
            for root in V2_ROOTS:
                d = root + path.rstrip("/")
                if os.path.exists(os.path.join(d, "memory.events")):
                    return d
    return None


def oom_kills(cgroup: str) -> int | None:
    """The cgroup's OOM-kill count (``oom_kill N`` of v2 ``memory.events.local``, else ``memory.events``, or of v1
    ``memory.oom_control``; the latter two count the cgroups below it too)."""
    for name in ("memory.events.local", "memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(cgroup, name), encoding="utf-8") as fh:
                for line in fh:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def read_int(cgroup: str, *names: str) -> int | None:
    for name in names:
        try:
            with open(os.path.join(cgroup, name), encoding="utf-8") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        return None if text == "max" or not text.isdigit() else int(text)
    return None


def own_memory() -> dict[str, Any]:
    """What this rank's record says of its memory: ``{"cg": its memory cgroup, "ooms": that cgroup's OOM kills,
    "rss": peak RSS in KiB}`` (a field it cannot read is left out)."""
    out: dict[str, Any] = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    cg = memory_cgroup()
    if cg is not None:
        out["cg"] = cg
        count = oom_kills(cg)
        if count is not None:
            out["ooms"] = count
    return out


def kernel_record(pid: int, wait_s: float = KERNEL_RECORD_WAIT_S) -> dict[str, int] | None:
    """The kernel's record of the OOM kill of ``pid`` (its RSS in KiB then); ``{}`` when the kernel's log holds
    none; None when ``/dev/kmsg`` is not this user's to read."""
    end = time.monotonic() + wait_s
    while True:
        found = None
        try:
            fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            while True:
                try:
                    rec = os.read(fd, 8192).decode("utf-8", "replace")
                except BlockingIOError:
                    break
                except OSError:  # EPIPE: a record was overwritten while reading; read on
                    continue
                if not rec:
                    break
                m = _KILLED.search(rec)
                if m and int(m.group(1)) == pid:
                    found = {"anon_rss_kib": int(m.group(3)), "file_rss_kib": int(m.group(4)),
                             "shmem_rss_kib": int(m.group(5))}
        finally:
            os.close(fd)
        if found is not None or time.monotonic() >= end:
            return found or {}
        time.sleep(0.02)  # the kernel writes its record just after the signal: a bounded retry, not a sync


def after_death(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """Whether the rank whose last heartbeat record is ``record`` was ended by the OOM killer: the details
    (cgroup, its count before and now, its limit and peak, the rank's peak RSS, the kernel's record), or None."""
    mem = (record or {}).get("mem")
    if not isinstance(mem, dict) or not isinstance(mem.get("cg"), str) or not isinstance(mem.get("ooms"), int):
        return None
    now = oom_kills(mem["cg"])
    if now is None or now <= mem["ooms"]:
        return None
    info: dict[str, Any] = {"cgroup": mem["cg"], "oom_kill": [mem["ooms"], now],
                            "update": record.get("u"), "phase": record.get("ph"),  # its last record's
                            "peak_rss_kib": mem.get("rss"),
                            "limit_bytes": read_int(mem["cg"], "memory.max", "memory.limit_in_bytes"),
                            "cgroup_peak_bytes": read_int(mem["cg"], "memory.peak", "memory.max_usage_in_bytes")}
    pid = (record or {}).get("pid")
    if isinstance(pid, int):
        info["kernel"] = kernel_record(pid)
        if info["kernel"] == {}:  # the kernel's log is readable and names another process: not this rank's kill
            return None
    return info


def _mib(n: int | None, unit: int = 1) -> str:
    return "?" if not isinstance(n, int) else f"{n * unit / 2**20:.0f} MiB"


def describe(info: dict[str, Any]) -> str:
    """``killed by the kernel's OOM killer: out of memory (...)``: one line for a ``dead`` verdict."""
    before, now = info["oom_kill"]
    parts = [f"memory cgroup {info['cgroup']} oom_kill {before} -> {now}"]
    if info.get("limit_bytes") is not None:
        parts.append(f"limit {_mib(info['limit_bytes'])}")
    if info.get("cgroup_peak_bytes") is not None:
        parts.append(f"cgroup peak {_mib(info['cgroup_peak_bytes'])}")
    parts.append(f"the rank's peak RSS {_mib(info.get('peak_rss_kib'), 1024)} at its last heartbeat")
    kernel = info.get("kernel")
    if kernel:
        parts.append(f"kernel: anon-rss {_mib(kernel['anon_rss_kib'], 1024)} when killed")
    parts.append(f"its last heartbeat: update {info.get('update')}, {info.get('phase')}")
    return f"killed by the kernel's OOM killer: out of memory ({', '.join(parts)})"
