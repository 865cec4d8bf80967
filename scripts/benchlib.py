"""Helpers shared by the benchmark scripts (``scripts/bench_*.py``) and ``scripts/bench_all.py``.

Contract of a benchmark part (so ``make bench`` can run it and regenerate ``docs/benchmarks.md``):

- ``main(argv)`` accepts ``--json PATH`` (write the result there) and ``--markdown FILE`` (``''`` = do not
  touch any markdown);
- ``markdown(res) -> str`` renders the part's block *including* its two ``MARK`` lines from the JSON alone;
- ``res`` carries ``"part"``, ``"date"``, ``"machine"`` (``machine()``) and ``"rows"``: a list of
  ``{"what", "baseline", "ratio", "spread", "n", ...}`` summary rows (median ratio, "min–max" spread) that
  the overview table of ``docs/benchmarks.md`` shows.

Every figure is a ratio against a baseline measured in the same run (this machine is shared and noisy);
absolute times are printed beside them and never compared across runs.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


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


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs: list[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "n"}`` of the values (None values dropped)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt(x: float | None, f: str = "{:.2f}") -> str:
    return "n/a" if x is None else f.format(x)


def fmt_spread(d: dict[str, Any] | None, f: str = "{:.2f}") -> str:
    """``median (min–max)``."""
    if not d or d.get("median") is None:
        return "n/a"
    return f"{f.format(d['median'])} ({f.format(d['min'])}–{f.format(d['max'])})"


def row(what: str, baseline: str, ratio: dict[str, Any], unit: str = "x", note: str = "") -> dict[str, Any]:
    """One overview row: ``ratio`` is a ``spread()`` of paired ratios (or of one-run ratios)."""
    return {"what": what, "baseline": baseline, "ratio": ratio.get("median"),
            "spread": None if ratio.get("median") is None else f"{fmt(ratio.get('min'))}–{fmt(ratio.get('max'))}",
            "n": ratio.get("n", 0), "unit": unit, "note": note}


def write_block(path: Path, mark: str, block: str) -> None:
    """Replace the text between the two ``mark`` lines of ``path`` with ``block`` (append when absent)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if text.count(mark) >= 2:
        a = text.index(mark)
        b = text.index(mark, a + len(mark)) + len(mark)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
