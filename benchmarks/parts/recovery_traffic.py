"""Recovery benchmark: the heartbeat path alone, at 4, 64 and 256 emulated ranks (``benchmarks/parts/recovery.py``).

No training: one process hosts the control plane's ``TCPStore`` (as rank 0 does), and this process runs N of the
library's own heartbeat publishers (``accelpact_slurm.runtime.detection.liveness.Publisher``, each with its own store
connection and thread, at ``timeouts.heartbeat_interval_s``) for ``seconds``.  Measured: the writes and bytes
that reach the store per second (the publishers' counters and record sizes), and the store host's CPU seconds
per second (``/proc/<pid>/stat``), per N; the figure is each per rank, which stays flat when the cost grows as N.
Nothing reads the records while a job trains, so this is the whole steady-state traffic.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

HOST = r"""
import sys, time
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(s.port, flush=True)
sys.stdin.read()
"""


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(n: int, seconds: float, interval_s: float) -> dict[str, Any]:
    """N publishers for ``seconds``: writes/s, bytes/s and the store host's CPU s/s, in all and per rank."""
    from datetime import timedelta

    import torch.distributed as dist

    from accelpact_slurm.runtime.detection import liveness as lv

    host = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        pubs = []
        for r in range(n):
            client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=60))
            state = lv.LocalState(update=1000 + r, phase="backward")
            state.done = {"replicate": 12345, "shard": 23456}
            pubs.append(lv.Publisher(client, r, state, interval_s))
        for p in pubs:
            p.start()
        time.sleep(interval_s * 2)  # past the first writes: the steady state
        n0, cpu0, t0 = sum(p.n for p in pubs), _cpu_s(host.pid), time.monotonic()
        time.sleep(seconds)
        n1, cpu1, t1 = sum(p.n for p in pubs), _cpu_s(host.pid), time.monotonic()
        size = len(lv.encode(10**6, 10**6, pubs[0].state)) + len(lv.record_key(n))
        for p in pubs:
            p.close()
        dt = t1 - t0
        writes = (n1 - n0) / dt
        return {"ranks": n, "seconds": dt, "interval_s": interval_s, "writes_per_s": writes,
                "bytes_per_s": writes * size, "host_cpu_s_per_s": (cpu1 - cpu0) / dt,
                "writes_per_s_per_rank": writes / n, "host_cpu_per_rank": (cpu1 - cpu0) / dt / n,
                "expected_writes_per_s": n / interval_s}
    finally:
        host.stdin.close()
        host.wait(timeout=10)


def scaling(sizes: tuple[int, ...] = (4, 64, 256), seconds: float = 6.0, interval_s: float = 0.5) -> list[dict[str, Any]]:
    return [measure(n, seconds, interval_s) for n in sizes]


if __name__ == "__main__":  # python benchmarks/parts/recovery_traffic.py: one line per size
    import json

    sys.path[:0] = [str(p) for p in (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),)]
    for row in scaling():
        print(json.dumps(row))
