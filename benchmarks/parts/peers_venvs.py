"""Peers benchmark, the peers' own virtual environments under ``benchmarks/.venvs/`` (``benchmarks/parts/peers.py``).

Each peer has a list of candidate releases, newest first (``peers_runs.PEERS``).  The first that works on
this machine is used, in a venv of its own named after the peer and the release
(``benchmarks/.venvs/<distribution>-<version>``):

1. the package index is asked for the candidate's wheel (``pip download --no-deps --only-binary=:all:`` with
   the project's interpreter, which is the one the venv gets): no wheel for this interpreter and C library
   means the candidate cannot be installed here;
2. a venv is made and gets ``torch==2.13.0`` (the machine's CPU build) and PyYAML first, then the candidate
   with a constraints file that holds torch at that pin (a peer must never pull in another torch);
3. a check in the new venv imports the peer's modules and the entry points the benchmark uses (the
   features: torchft's ``Manager``/``ProcessGroupGloo`` and ``torchft_lighthouse``; nvidia-resiliency-ext's
   in-process ``Wrapper`` and its in-job restart, ``ft_launcher`` with the rank monitor client) and reports
   the versions of the peer and of torch.

Every candidate's outcome is an *attempt* ``{pin, status, reason}`` in the result; a failed attempt is
remembered in ``benchmarks/.venvs/attempts.json`` for this interpreter, C library and torch pin (so the
index is not asked again on every run; ``--recheck-peers`` forgets it), a working venv is reused while its
stamp file matches.  A peer none of whose candidates works is reported ``skipped`` with every reason.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.parts.peers_runs import PEERS, REPO, TORCH_PIN, VENVS, clean_env

ATTEMPTS = VENVS / "attempts.json"
STAMP = ".bench-peers-stamp.json"

#: Run in the peer's venv: the versions and which of the benchmark's entry points import.  Prints one JSON line.
CHECK = r"""
import importlib, importlib.metadata as md, json, os, sys
dist, module, features = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
import torch
out = {"torch": torch.__version__, "version": md.version(dist), "features": {}}
importlib.import_module(module)
for name, (mod, attrs, exe) in features.items():
    try:
        m = importlib.import_module(mod)
        for a in attrs:
            getattr(m, a)
        if exe and not os.path.exists(os.path.join(os.path.dirname(sys.executable), exe)):
            raise FileNotFoundError(f"no {exe} in the venv")
        out["features"][name] = {"ok": True}
    except Exception as exc:
        out["features"][name] = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
print(json.dumps(out))
"""


def fingerprint() -> dict[str, str]:
    """What decides whether a wheel installs: the interpreter, the C library, the machine, the torch pin."""
    libc, ver = platform.libc_ver()
    return {"python": f"cp{sys.version_info.major}{sys.version_info.minor}", "libc": f"{libc} {ver}".strip(),
            "machine": platform.machine(), "torch": TORCH_PIN}


def venv_dir(pin: str) -> Path:
    return VENVS / pin.replace("==", "-")


def pip_errors(path: Path, lines_back: int = 30) -> str:
    """pip's ERROR lines from the end of its log (its warnings about local indexes are noise here)."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()[-lines_back:]
    except OSError:
        return ""
    errs = [ln for ln in lines if "ERROR" in ln or "error:" in ln]
    return " | ".join(errs[-3:] or lines[-3:])[-600:]


def _load_attempts() -> dict[str, Any]:
    try:
        return json.loads(ATTEMPTS.read_text())
    except (OSError, ValueError):
        return {}


def _save_attempt(pin: str, entry: dict[str, Any]) -> None:
    cache = _load_attempts()
    cache[pin] = entry
    VENVS.mkdir(parents=True, exist_ok=True)
    tmp = ATTEMPTS.with_name(ATTEMPTS.name + ".tmp")
    tmp.write_text(json.dumps(cache, indent=1) + "\n")
    tmp.replace(ATTEMPTS)


def _run(cmd: list[str], fh: Any, timeout_s: float) -> int:
    fh.write(f"\n$ {' '.join(cmd)}\n".encode())
    fh.flush()
    try:
        return subprocess.run(cmd, check=False, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=timeout_s, env=clean_env()).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        fh.write(f"{exc}\n".encode())
        return -1


def _short(cmd: list[str]) -> str:
    return " ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))


def check_venv(py: Path, spec: dict[str, Any], dist: str) -> dict[str, Any]:
    """Run ``CHECK`` in the venv: ``{"ok", "torch", "version", "features"}`` or ``{"ok": False, "reason"}``."""
    cmd = [str(py), "-c", CHECK, dist, spec["module"], json.dumps(spec["features"])]
    try:
        chk = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=clean_env(),
                             cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"ok": False, "reason": f"import check failed: {exc}"}
    if chk.returncode != 0:
        return {"ok": False, "reason": f"`import {spec['module']}` failed: "
                                       f"{' | '.join(chk.stderr.strip().splitlines()[-2:])[-500:]}"}
    out = json.loads(chk.stdout.strip().splitlines()[-1])
    want = TORCH_PIN.split("==", 1)[1]
    if not out["torch"].startswith(want):
        return {"ok": False, "reason": f"the venv has torch {out['torch']}, not {want}"}
    if not any(f["ok"] for f in out["features"].values()):
        why = "; ".join(f"{k}: {f['reason']}" for k, f in out["features"].items())
        return {"ok": False, "reason": f"none of the entry points the benchmark uses imports ({why})"}
    return {"ok": True, **out}


def try_candidate(name: str, cand: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """One candidate release: ``{"pin", "status": "ok"|"no-wheel"|"install-failed"|"check-failed", ...}``."""
    spec = PEERS[name]
    pin = cand["pin"]
    d = venv_dir(pin)
    py = d / "bin" / "python"
    stamp = d / STAMP
    fp = fingerprint()
    base = {"pin": pin, "venv": str(d.relative_to(REPO))}
    try:
        st = json.loads(stamp.read_text())
    except (OSError, ValueError):
        st = None
    if py.exists() and st and st.get("fingerprint") == fp and st.get("pin") == pin:
        return {**base, **st["check"], "status": "ok", "created": False}
    VENVS.mkdir(parents=True, exist_ok=True)
    pip_log = VENVS / f"{d.name}-install.log"
    t0 = time.monotonic()
    with open(pip_log, "ab") as fh:
        # 1. is there a wheel for this interpreter and C library at all?
        with tempfile.TemporaryDirectory(prefix="peer-wheel-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--progress-bar", "off",
                   "--no-deps", "--only-binary=:all:", "-d", tmp, pin]
            rc = _run(cmd, fh, 300)
        if rc != 0:
            fh.flush()
            return {**base, "status": "no-wheel",
                    "reason": f"no wheel for {fp['python']} / {fp['libc']} / {fp['machine']} on the package index"
                              + (f": {cand['note']}" if cand.get("note") else ""),
                    "detail": f"`pip download --no-deps --only-binary=:all: {pin}`: {pip_errors(pip_log, 6)}"}
        log(f"installing {pin} into {base['venv']} (progress in {pip_log.relative_to(REPO)})")
        # 2. the venv: the pinned torch first, then the candidate held to it
        shutil.rmtree(d, ignore_errors=True)
        interp = getattr(sys, "_base_executable", None) or sys.executable
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
        cons = VENVS / "torch-constraints.txt"
        cons.write_text(TORCH_PIN + "\n")
        for cmd in ([interp, "-m", "venv", str(d)], pip + [TORCH_PIN, "pyyaml"], pip + ["-c", str(cons), pin]):
            rc = _run(cmd, fh, 1200)
            if rc != 0:
                fh.flush()
                shutil.rmtree(d, ignore_errors=True)
                return {**base, "status": "install-failed",
                        "reason": f"`{_short(cmd)}` failed (exit {rc}): {pip_errors(pip_log)}"}
    # 3. does it import, with which torch, and which of the entry points the benchmark uses?
    chk = check_venv(py, spec, cand["dist"])
    if not chk["ok"]:
        shutil.rmtree(d, ignore_errors=True)
        return {**base, "status": "check-failed", "reason": chk["reason"]}
    check = {k: chk[k] for k in ("torch", "version", "features")}
    stamp.write_text(json.dumps({"pin": pin, "fingerprint": fp, "check": check}, indent=1) + "\n")
    log(f"{pin} ready after {time.monotonic() - t0:.0f} s (torch {chk['torch']})")
    return {**base, **check, "status": "ok", "created": True, "install_s": time.monotonic() - t0}


def _link(name: str, target: str) -> None:
    """``benchmarks/.venvs/<peer>`` -> the chosen venv, for code that names the peer's venv by the peer alone
    (a directory left there by an earlier layout, one venv per peer, is replaced)."""
    link = VENVS / name
    if link.is_symlink():
        if str(link.readlink()) == target:
            return
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link)
    link.symlink_to(target)


def ensure_venv(name: str, log: Callable[[str], None], recheck: bool = False) -> dict[str, Any]:
    """The newest candidate of peer ``name`` that works here, in its venv; every candidate tried is an attempt.

    Returns the peer's entry of the result: ``status`` ``ok`` (with ``pin``, ``version``, ``torch``, ``venv``,
    ``python``, ``features``, ``title``) or ``skipped`` (with ``reason``), and ``attempts`` in both cases.
    When one works, ``benchmarks/.venvs/<peer>`` links to its venv and ``PEERS[name]["title"]`` names it.
    """
    spec = PEERS[name]
    fp = fingerprint()
    cache = _load_attempts()
    attempts: list[dict[str, Any]] = []
    for cand in spec["candidates"]:
        pin = cand["pin"]
        old = cache.get(pin)
        if not recheck and old and old.get("fingerprint") == fp and old.get("status") != "ok":
            attempts.append({"pin": pin, "status": old["status"], "reason": old["reason"],
                             "detail": old.get("detail", ""), "checked": old["checked"], "cached": True})
            continue
        r = try_candidate(name, cand, log)
        entry = {"pin": pin, "status": r["status"], "reason": r.get("reason", ""), "detail": r.get("detail", ""),
                 "checked": time.strftime("%Y-%m-%d"), "fingerprint": fp}
        if r["status"] != "ok":
            _save_attempt(pin, entry)
            log(f"{pin}: {r['status']}: {r['reason'][:300]}")
            attempts.append({k: entry[k] for k in ("pin", "status", "reason", "detail", "checked")})
            continue
        attempts.append({"pin": pin, "status": "ok", "reason": "", "checked": entry["checked"]})
        if old and old.get("status") != "ok":
            _save_attempt(pin, entry)
        fell_back = [a for a in attempts if a["status"] != "ok"]
        title = f"{cand.get('label', spec['name'])} {r['version']}"
        _link(name, Path(r["venv"]).name)
        spec["title"] = title
        return {**r, "title": title, "python": fp["python"], "about": cand.get("about", ""),
                "attempts": attempts, "fallback_from": [a["pin"] for a in fell_back]}
    return {"status": "skipped", "title": spec["name"], "pin": None, "attempts": attempts,
            "reason": "no candidate release works here: "
                      + "; ".join(f"{a['pin']}: {a['status']} ({a['reason'][:240]})" for a in attempts)}
