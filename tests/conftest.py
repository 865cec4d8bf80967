"""Shared fixtures."""

from __future__ import annotations

import os
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


@pytest.fixture
def repo_root():
    return REPO


from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401  (session fixture for tests marked slurm)
