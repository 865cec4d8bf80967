"""Shared fixtures."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(args, *, env=None, timeout=600, cwd=REPO):
    """Run a project command as a user would (a fresh interpreter), with a deadline."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONPATH", REPO)
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd)


DECODER_JOB = os.path.join(REPO, "examples", "decoder", "job.yaml")
VISION_JOB = os.path.join(REPO, "examples", "vision", "job.yaml")


def job_text(path: str = DECODER_JOB) -> str:
    """An example's job file with its entry made absolute, so that a copy elsewhere still finds it."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    return re.sub(r"^entry: (\w+):(\w+)", lambda m: f"entry: {os.path.join(os.path.dirname(path), m.group(1))}.py:"
                  f"{m.group(2)}", text, count=1, flags=re.M)


def decoder_text() -> str:
    return job_text(DECODER_JOB)


@pytest.fixture
def repo_root():
    return REPO


from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401  (session fixture for tests marked slurm)
