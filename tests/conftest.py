"""Shared fixtures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests never read the user's own configuration (an envelope the user earned with accelpact-qualify lives
# there and would change which action a test's fault gets); subprocesses inherit this.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="accelpact-test-config-")


def run_cli(args, *, env=None, timeout=600, cwd=REPO):
    """Run a project command as a user would (a fresh interpreter), with a deadline."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONPATH", REPO)
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd)


DECODER_JOB = os.path.join(REPO, "examples", "decoder", "job.yaml")
VISION_JOB = os.path.join(REPO, "examples", "vision", "job.yaml")


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wait_for(pred, timeout_s, what):
    """``pred()``'s first truthy value, polled until the deadline (then an AssertionError naming ``what``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)  # polling interval, not synchronisation
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def job_text(path: str = DECODER_JOB) -> str:
    """An example's job file with its entry made absolute, so that a copy elsewhere still finds it."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    return re.sub(r"^entry: (\w+):(\w+)", lambda m: f"entry: {os.path.join(os.path.dirname(path), m.group(1))}.py:"
                  f"{m.group(2)}", text, count=1, flags=re.M)


def decoder_text() -> str:
    return job_text(DECODER_JOB)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, args, world: int, out, deadline_s: float) -> dict:
    """Run ``worker(rank, *args)`` on ``world`` spawned processes with a deadline; return every rank's
    ``out/rank-R.json`` (each worker writes its results there)."""
    import json
    import time

    import torch.multiprocessing as mp

    ctx = mp.spawn(worker, args=args, nprocs=world, join=False)
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() > end:
                pytest.fail(f"the {world} ranks did not finish within {deadline_s:g} s")
    except mp.ProcessRaisedException as exc:
        pytest.fail(f"a rank raised: {exc}")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = {}
    for r in range(world):
        path = out / f"rank-{r}.json"
        assert path.exists(), f"rank {r} wrote no result"
        results[r] = json.loads(path.read_text())
    return results


@pytest.fixture
def repo_root():
    return REPO


from tests.slurm_cluster import slurm_cluster, watchdog_restarts  # noqa: E402,F401  (slurm_cluster: a fixture)


def pytest_terminal_summary(terminalreporter):
    """The dev-cluster daemons the watchdog had to start again during the session (a Slurm crash, not a test's)."""
    restarts = watchdog_restarts()
    if restarts:
        terminalreporter.section("dev-cluster watchdog")
        for line in restarts:
            terminalreporter.write_line(line)


def stage_half(daemon, slot, step: int, local_rank: int, t) -> dict:
    """Stage ``t`` (a [4, 8] float32 tensor) as local rank ``local_rank``'s half (rows ``4 * local_rank``..) of an
    [8, 8] weight at ``step`` into ``slot`` and hand it to ``daemon`` as a rank does; the daemon's reply."""
    from ckpt_service import staging
    from ckpt_service.capture import Box, Entry, Plan

    plan = Plan([Entry(("model", "w"), [8, 8], t.dtype, [Box([4 * local_rank, 0], [4, 8], t)])], {"lr": 0.1},
                "test")
    nbytes = plan.layout()
    slot.ensure(staging.slot_bytes(nbytes))
    token = staging.new_token()
    staging.clear_stamp(slot.buf, nbytes)
    plan.copy_into(slot.buf)
    staging.write_stamp(slot.buf, nbytes, step, token)
    meta = {"job_id": "t", "config_digest": None, "config": None, "world_size": 2, "layout": [1, 2],
            "extra_json": json.dumps({"run": {"step": step}, "ranks": {}}), "capture": None}
    desc = staging.write_descriptor(daemon.stage_root, step, local_rank, {
        "step": step, "rank": local_rank, "local_rank": local_rank, "meta": meta, "slot": slot.path,
        "slot_ino": slot.ino, "nbytes": nbytes, "stamp": {"at": nbytes, "token": token},
        "entries": plan.describe(), "plain": plan.plain, "source": plan.source})
    return daemon.handle({"op": "staged", "step": step, "local_rank": local_rank, "nranks": 2, "path": desc})
