"""Peers benchmark, the peers' own virtual environments under ``benchmarks/.venvs/`` (``scripts/bench_peers.py``).

Each peer gets ``torch==2.13.0`` and PyYAML first, then its pinned release; a venv is reused while its
stamp file matches.  A peer that cannot be installed is reported ``skipped`` with the reason.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.peers_runs import PEERS, REPO, TORCH_PIN, VENVS, clean_env


def pip_errors(path: Path) -> str:
    """pip's ERROR lines from the end of its log (its warnings about local indexes are noise here)."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()[-30:]
    except OSError:
        return ""
    errs = [ln for ln in lines if "ERROR" in ln or "error:" in ln]
    return " | ".join(errs[-3:] or lines[-3:])[-600:]


def ensure_venv(name: str, log: Callable[[str], None]) -> dict[str, Any]:
    """The peer's venv under benchmarks/.venvs/NAME, created when its stamp is missing or stale."""
    spec = PEERS[name]
    d = VENVS / name
    py = d / "bin" / "python"
    stamp = d / ".bench-peers-stamp"
    want = f"{TORCH_PIN} pyyaml {spec['pin']}\n"
    info: dict[str, Any] = {"pin": spec["pin"], "venv": str(d.relative_to(REPO)), "status": "ok"}
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        info["created"] = False
        return info
    VENVS.mkdir(parents=True, exist_ok=True)
    pip_log = VENVS / f"{name}-install.log"
    log(f"installing {spec['pin']} into {info['venv']} (first run only; progress in {pip_log.relative_to(REPO)})")
    t0 = time.monotonic()
    base = getattr(sys, "_base_executable", None) or sys.executable
    steps = [] if py.exists() else [[base, "-m", "venv", str(d)]]
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    steps += [pip + [TORCH_PIN, "pyyaml"], pip + [spec["pin"]]]
    with open(pip_log, "ab") as fh:
        for cmd in steps:
            fh.write(f"\n$ {' '.join(cmd)}\n".encode())
            fh.flush()
            try:
                rc = subprocess.run(cmd, check=False, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=1200, env=clean_env()).returncode
            except (OSError, subprocess.TimeoutExpired) as exc:
                fh.write(f"{exc}\n".encode())
                rc = -1
            if rc != 0:
                return {**info, "status": "skipped",
                        "reason": f"`{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}` "
                                  f"failed (exit {rc}): {pip_errors(pip_log)}"}
    try:
        chk = subprocess.run([str(py), "-c", f"import {spec['module']}, torch; print(torch.__version__)"],
                             check=False, capture_output=True, text=True, timeout=300, env=clean_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {**info, "status": "skipped", "reason": f"import check failed: {exc}"}
    if chk.returncode != 0:
        return {**info, "status": "skipped", "reason": f"`import {spec['module']}` failed: "
                                                       f"{chk.stderr.strip().splitlines()[-1:]}"}
    stamp.write_text(want)
    info.update(created=True, install_s=time.monotonic() - t0)
    log(f"{spec['pin']} ready after {info['install_s']:.0f} s (torch {chk.stdout.strip()})")
    return info
