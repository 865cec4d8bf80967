"""The environment record of a benchmark run: what it ran on (CPU model and count, memory, load, Python, torch, OS).

Standard library only at module level (``scripts/gpu_check.py`` imports it on a machine that has only torch).
"""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any


def machine() -> dict[str, Any]:
    """What the benchmark ran on: CPU model and count, memory, load, Python, torch, OS."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal"):
                    mem = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - the benchmarks run in the project's venv
        torch_version = None
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory_gib": mem, "python": platform.python_version(),
            "torch": torch_version, "platform": platform.platform(), "loadavg_start": list(os.getloadavg())}


def machine_line(m: dict[str, Any]) -> str:
    load = m.get("loadavg_start") or []
    load_s = ", ".join(f"{x:.1f}" for x in load) if load else "n/a"
    return (f"{m.get('cpus')} CPU cores ({m.get('cpu_model')}), {m.get('memory_gib')} GiB memory, "
            f"load average at start {load_s}; Python {m.get('python')}, torch {m.get('torch')}; {m.get('platform')}")


def fs_type(path: str) -> str:
    try:
        out = subprocess.run(["df", "-T", path], check=False, capture_output=True, text=True,
                             timeout=10).stdout.splitlines()
        f = out[-1].split()
        return f"{f[1]} ({f[0]}, mounted on {f[-1]})"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"
