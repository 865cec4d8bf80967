"""The job's store in a process of its own (:mod:`accelpact_slurm.runtime.transport.store_host`): it serves as the
thread did, holds rank 0's interpreter on no request's path, and lives exactly as long as rank 0.

"Rank 0" here is a real subprocess that hosts the store the way ``build_runtime`` does, so that it can be killed
with ``SIGKILL``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest

from accelpact_slurm.runtime.transport.store import JobStore, binding, host_store, host_store_process, port_candidates
from tests.conftest import REPO

HOST = "127.0.0.1"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(") ", 1)[1][:1] not in "ZX"
    except OSError:
        return False


def _wait_for(cond, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.02)


def test_the_store_process_serves_the_job_and_keeps_the_key_off_its_command_line():
    key = secrets.token_bytes(32)
    ports = port_candidates(key, "501")
    warnings: list[str] = []
    server = host_store_process(HOST, ports, key, binding("501", 0), warnings.append)
    client = JobStore(HOST, ports, key, binding("501", 0), 1, timedelta(seconds=10))
    try:
        assert server.pid != os.getpid() and client.port == server.port
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert client.set_multi_get("a", "1", ["a"]) == [b"1"]
        with open(f"/proc/{server.pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
        assert key.hex().encode() not in cmdline and key not in cmdline
        # Slurm's SIGTERM (or USR2) reaches every process of the step: rank 0 may still need its store to vote
        os.kill(server.pid, signal.SIGTERM)
        os.kill(server.pid, signal.SIGUSR2)
        client.set("after", "term")
        assert client.get("after") == b"term"
    finally:
        client.close()
        server.close()
    assert not _alive(server.pid)


RANK0 = textwrap.dedent("""
    import secrets, sys, time
    from accelpact_slurm.runtime.transport.store import binding, host_store, host_store_process, port_candidates
    key = bytes.fromhex(sys.argv[2])
    serve = host_store_process if sys.argv[1] == "process" else host_store
    server = serve("127.0.0.1", port_candidates(key, "502"), key, binding("502", 0))
    print(server.port, getattr(server, "pid", 0), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["process", "thread"])
@pytest.mark.slow
def test_the_store_goes_with_rank_0_when_it_is_killed(how):
    """A client waiting on the store fails at once when rank 0 dies, as it did when a thread of rank 0 served it
    (the control: ``thread``); the server process does not outlive rank 0."""
    key = secrets.token_bytes(32)
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, how, key.hex()], stdout=subprocess.PIPE, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    try:
        port, pid = (int(x) for x in rank0.stdout.readline().split())
        client = JobStore(HOST, [port], key, binding("502", 0), 1, timedelta(seconds=60))
        client.set("k", "v")
        got: list[BaseException | bytes] = []
        waiter = threading.Thread(target=lambda: got.append(_get_or_error(client, "never-set")), daemon=True)
        waiter.start()
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(10)
        waiter.join(20)
        assert not waiter.is_alive(), "the client's wait outlived rank 0's store"
        assert isinstance(got[0], Exception), got
        if how == "process":
            _wait_for(lambda: not _alive(pid), f"the store process {pid} to end with rank 0", 10)
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait(10)


def _get_or_error(client: JobStore, key: str) -> BaseException | bytes:
    try:
        return client.get(key)
    except Exception as exc:  # noqa: BLE001 - what the waiter saw is the test's to check
        return exc
