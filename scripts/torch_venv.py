#!/usr/bin/env python3
"""A virtual environment with one torch release and the project's dependencies, built once and cached.

    python3 scripts/torch_venv.py 2.15.0        # prints the venv's python on the last line of stdout

``make test`` runs the torch-internals tests on every release of the supported range with it
(``make test-releases``).  The venv is installed from the package index as a user's would be: torch at
exactly the release asked for, with the project's own requirement lines (``install_requires`` and the
``train`` and ``test`` extras of ``setup.cfg``, the torch range among them) in the same pip command, so a
release outside the range in ``setup.cfg`` fails here, naming it, instead of being swapped for another.
The project itself is not installed: the tests run it from the checkout (``PYTHONPATH``).

Cache: ``$ACCELPACT_VENV_CACHE``, else ``$XDG_CACHE_HOME/accelpact-slurm/venvs`` (``~/.cache/...``).  A venv is
named after the release and a hash of the requirement lines, so editing them builds a fresh one; it is
built under a temporary name and renamed when complete (an interrupted build is never used).  A pip
configuration's constraint file (some machines cap torch at an older release) is lifted for these
commands (``PIP_CONSTRAINT=/dev/null``): the release under test is the one asked for.
"""

from __future__ import annotations

import argparse
import configparser
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRAS = ("train", "test")
RELEASE = re.compile(r"\d+\.\d+\.\d+")


def requirements(setup_cfg: str = os.path.join(REPO, "setup.cfg"), extras=EXTRAS) -> list[str]:
    """The requirement lines of ``install_requires`` and ``extras``, comments dropped, in file order."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg, encoding="utf-8")
    blocks = [cfg.get("options", "install_requires", fallback="")]
    blocks += [cfg.get("options.extras_require", extra, fallback="") for extra in extras]
    lines = []
    for block in blocks:
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                lines.append(line)
    return lines


def cache_dir(environ=os.environ) -> str:
    if environ.get("ACCELPACT_VENV_CACHE"):
        return environ["ACCELPACT_VENV_CACHE"]
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "accelpact-slurm", "venvs")


def venv_path(release: str, reqs: list[str], cache: str) -> str:
    digest = hashlib.sha256("\n".join([sys.version.split()[0], *reqs]).encode()).hexdigest()[:12]
    return os.path.join(cache, f"torch-{release}-py{sys.version_info[0]}.{sys.version_info[1]}-{digest}")


def _pip(python: str, args: list[str]) -> None:
    env = dict(os.environ, PIP_CONSTRAINT="/dev/null", PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [python, "-m", "pip", "install", "--quiet", *args]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(f"torch_venv: error: `{' '.join(cmd)}` exited {proc.returncode} (its output is above)")


def ensure(release: str, cache: str | None = None) -> str:
    """The python of the cached venv for ``release``, built first if it is not there."""
    if not RELEASE.fullmatch(release):
        raise SystemExit(f"torch_venv: error: release {release!r} is not MAJOR.MINOR.PATCH (e.g. 2.15.0)")
    reqs = requirements()
    cache = cache or cache_dir()
    final = venv_path(release, reqs, cache)
    python = os.path.join(final, "bin", "python")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two builds of one cache (two test runs) take turns
        if os.path.exists(os.path.join(final, ".complete")):
            print(f"[torch_venv] torch {release}: cached venv {final}", file=sys.stderr, flush=True)
            return python
        tmp = f"{final}.building-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        print(f"[torch_venv] torch {release}: building {final} from the package index (a CUDA build of torch "
              f"is several GB; about 1-2 min where the index is near)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", tmp], check=True)
        _pip(os.path.join(tmp, "bin", "python"), [f"torch=={release}", *reqs])
        open(os.path.join(tmp, ".complete"), "w").close()
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        # A venv's scripts name its folder: the renamed one is used through its python only (python -m ...).
        print(f"[torch_venv] torch {release}: ready in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        return python


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]).replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("release", help="torch release, MAJOR.MINOR.PATCH (e.g. 2.14.1)")
    p.add_argument("--cache", help="cache folder (default: $ACCELPACT_VENV_CACHE, else "
                                   "$XDG_CACHE_HOME/accelpact-slurm/venvs)")
    args = p.parse_args(argv)
    print(ensure(args.release, args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
