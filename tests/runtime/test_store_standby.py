"""The store's standby: every write the store answers is on the standby first, and when the store's process is
SIGKILLed its clients go on against the standby, with every key and no add counted twice.

Real processes (:func:`host_store_process`, :func:`host_standby_process`), real sockets, a real ``SIGKILL``.
Negative controls: a standby the store never linked to never serves (the clients fail as without one); a store
that does not forward its writes loses them.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from accelpact_slurm.runtime.transport import store as st
from accelpact_slurm.runtime.transport import store_wire as w
from accelpact_slurm.runtime.transport.store import (JobStore, binding, host_standby_process, host_store,
                                                      host_store_process, port_candidates, standby_ports)
from accelpact_slurm.runtime.transport.store_server import MIRRORED_KEY, REPLICA_RANK

HOST = "127.0.0.1"


def _pair(job: str, *, link: bool = True):
    key = secrets.token_bytes(32)
    bind = binding(job, 0)
    warnings: list[str] = []
    primary = host_store_process(HOST, port_candidates(key, bind), key, bind, warnings.append)
    standby, link_port = host_standby_process(HOST, key, bind, warnings.append)
    if link:
        primary.mirror_to(HOST, [link_port], 10.0)
    return key, bind, primary, standby, warnings


def _client(key, bind, rank, primary, standby):
    c = JobStore(HOST, [primary.port], key, bind, rank, timedelta(seconds=10))
    c.set_standby(HOST, [standby.port])
    return c


def _wait_linked(client: JobStore) -> None:
    client.wait([MIRRORED_KEY.decode()], timedelta(seconds=10))


def test_the_standby_serves_every_key_once_the_store_is_killed():
    key, bind, primary, standby, warnings = _pair("701")
    a = _client(key, bind, 0, primary, standby)
    b = _client(key, bind, 1, primary, standby)
    try:
        a.set("before-link", "1")
        _wait_linked(a)
        a.set("k", "v")
        a.multi_set(["m1", "m2"], ["x", "y"])
        assert a.add("counter", 2) == 2
        assert a.compare_set("cas", "", "first") == b"first"
        a.set("gone", "1")
        assert a.delete_key("gone")
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(b.multi_get(["later"])))
        waiter.start()  # parked on the store when it dies: asked again of the standby
        threading.Event().wait(0.2)
        os.kill(primary.pid, signal.SIGKILL)
        primary.proc.wait(timeout=10)
        assert a.get("k") == b"v" and a.get("before-link") == b"1"
        assert a.multi_get(["m1", "m2"]) == [b"x", b"y"]
        assert a.add("counter", 3) == 5
        assert a.compare_set("cas", "first", "second") == b"second"
        assert not a.check(["gone"])
        a.set("later", "now")
        waiter.join(15)
        assert got == [[b"now"]]
        assert a.failed_over and b.failed_over and a.port == standby.port
        assert a.check([MIRRORED_KEY.decode()])  # a key of the store like any other: the standby took it too
    finally:
        for c in (a, b):
            c.close()
        primary.close()
        standby.close()


def test_negative_control_a_standby_never_linked_does_not_serve(monkeypatch):
    monkeypatch.setattr(st, "FAILOVER_S", 1.0)
    key, bind, primary, standby, _ = _pair("702", link=False)
    a = _client(key, bind, 0, primary, standby)
    try:
        a.set("k", "v")
        os.kill(primary.pid, signal.SIGKILL)
        primary.proc.wait(timeout=10)
        with pytest.raises(dist.DistNetworkError):
            a.get("k")
        assert not a.failed_over
    finally:
        a.close()
        primary.close()
        standby.close()


def test_a_live_store_keeps_its_clients_and_a_standby_admits_one_link_only():
    """While the store lives its standby's serving port refuses every client (no split brain), and the link's
    port admits the store's link once and nobody else."""
    key, bind, primary, standby, _ = _pair("703")
    a = _client(key, bind, 0, primary, standby)
    try:
        _wait_linked(a)
        with pytest.raises(dist.DistNetworkError):
            JobStore(HOST, [standby.port], key, bind, 5, timedelta(seconds=1))
        link_port = standby_ports(key, bind)[0][0]
        with pytest.raises(dist.DistNetworkError):  # a client on the link's port, and a second link
            JobStore(HOST, [link_port], key, bind, 5, timedelta(seconds=1))
        with pytest.raises(OSError):
            st._handshake(HOST, link_port, key, bind, REPLICA_RANK, 1.0)
        a.set("still", "here")
        assert a.get("still") == b"here" and not a.failed_over
    finally:
        a.close()
        primary.close()
        standby.close()


def test_an_add_sent_again_with_its_token_is_counted_once():
    key = secrets.token_bytes(32)
    bind = binding("704", 0)
    server = host_store(HOST, port_candidates(key, bind), key, bind)
    c = JobStore(HOST, [server.port], key, bind, 0, timedelta(seconds=5))
    try:
        token = secrets.token_bytes(12)
        once = c._call(w.ADD, [b"n", b"4", token])
        again = c._call(w.ADD, [b"n", b"4", token])
        assert once == again == [b"4"]
        assert c.add("n", 1) == 5  # a new token counts
    finally:
        c.close()
        server.close()


_HOLDER = """
import os, sys, time
from datetime import timedelta
from accelpact_slurm.runtime.detection import liveness as lv
from accelpact_slurm.runtime.transport.store import JobStore
key, bind, port, rank, stop = bytes.fromhex(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
a = JobStore("127.0.0.1", [port], key, bind, rank, timedelta(seconds=10))
b = JobStore("127.0.0.1", [port], key, bind, rank, timedelta(seconds=10))
state = lv.LocalState(update=3, phase="vote")
if stop == "stop":
    state.stop = {"cause": "completed", "reason": "the job finished", "exit_code": 0}
a.set(lv.record_key(rank), lv.encode(1, os.getpid(), state))
b.set("ready/%d" % rank, "1")
time.sleep(600)
"""


@pytest.mark.parametrize("said", ["nothing", "stop"])
def test_the_store_witnesses_a_rank_whose_every_connection_closed(tmp_path, said):
    """A rank process with two connections is SIGKILLed: the store marks its heartbeat record dead at once (a node
    lost whole is named without waiting for its heartbeat to age).  Negative control: a rank that said it finished
    is left as it is; a rank with one of two connections closed is not dead."""
    import subprocess
    import sys

    from accelpact_slurm.runtime.detection import liveness as lv
    from tests.conftest import REPO

    key = secrets.token_bytes(32)
    bind = binding("705", 0)
    server = host_store_process(HOST, port_candidates(key, bind), key, bind)
    watcher = JobStore(HOST, [server.port], key, bind, 0, timedelta(seconds=10))
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), key.hex(), bind, str(server.port), "3", said],
                              env={**os.environ, "PYTHONPATH": REPO})
    try:
        watcher.wait(["ready/3"], timedelta(seconds=60))
        other = JobStore(HOST, [server.port], key, bind, 3, timedelta(seconds=10))  # a third of rank 3's, closed
        other.close()
        assert not lv.decode(watcher.get(lv.record_key(3))).get("dead")
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        deadline = time.monotonic() + 10
        while True:
            rec = lv.decode(watcher.get(lv.record_key(3)))
            if rec.get("dead") or time.monotonic() > deadline:
                break
            threading.Event().wait(0.02)
        if said == "stop":
            assert "dead" not in rec and rec["stop"]["cause"] == "completed"
        else:
            assert rec["dead"] == {"by": lv.STORE_WITNESS, "how": "every connection of its process to the job's "
                                                                  "store closed"}
            seen = lv.Seen(rec, b"", time.monotonic())
            assert lv._member_gone(3, seen, time.monotonic(), 60.0, lambda r: f"rank {r}").kind == lv.DEAD
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
        watcher.close()
        server.close()


_PRESENT = """
import os, sys, time
from datetime import timedelta
from accelpact_slurm.runtime.detection import liveness as lv
from accelpact_slurm.runtime.transport.store import JobStore
from accelpact_slurm.runtime.transport.store_dial import handshake
from accelpact_slurm.runtime.transport.store_server import presence_rank
key, bind, port, link, rank = bytes.fromhex(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
a = JobStore("127.0.0.1", [port], key, bind, rank, timedelta(seconds=10))
here = handshake("127.0.0.1", link, key, bind, presence_rank(rank), 10.0)
a.set(lv.record_key(rank), lv.encode(1, os.getpid(), lv.LocalState(update=3, phase="vote")))
a.set("ready/%d" % rank, "1")
time.sleep(600)
"""


def test_the_standby_witnesses_the_ranks_that_end_with_the_store(tmp_path):
    """Node 0 lost whole: rank 1 (a process with a connection to the store and a presence at the standby) and the
    store are SIGKILLed together; once the standby serves, rank 1's record is marked dead by it (the store, its
    other witness, ended with it).  Negative control: rank 3's old process, ended after a spare took its place (a
    client named rank 3 that writes its record), is not marked; once the spare ends too, it is."""
    import subprocess
    import sys

    from accelpact_slurm.runtime.detection import liveness as lv
    from tests.conftest import REPO

    key, bind, primary, standby, _ = _pair("706")
    link = standby_ports(key, bind)[0][0]
    watcher = _client(key, bind, 0, primary, standby)
    script = tmp_path / "present.py"
    script.write_text(_PRESENT)
    holders = {r: subprocess.Popen([sys.executable, str(script), key.hex(), bind, str(primary.port), str(link),
                                    str(r)], env={**os.environ, "PYTHONPATH": REPO}) for r in (1, 3)}
    try:
        _wait_linked(watcher)
        watcher.wait(["ready/1", "ready/3"], timedelta(seconds=60))
        os.kill(holders[3].pid, signal.SIGSTOP)  # rank 3's presence ends later, after a spare wrote its record
        os.kill(primary.pid, signal.SIGKILL)
        os.kill(holders[1].pid, signal.SIGKILL)
        holders[1].wait(timeout=30)
        primary.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not (lv.decode(watcher.get(lv.record_key(1))) or {}).get("dead"):
            assert time.monotonic() < deadline, watcher.get(lv.record_key(1))
            threading.Event().wait(0.02)
        assert lv.decode(watcher.get(lv.record_key(1)))["dead"]["by"] == lv.STORE_WITNESS
        # rank 3: its place taken (a spare's client, named rank 3, writes its record), then its old process ends
        spare = JobStore(HOST, [standby.port], key, bind, 3, timedelta(seconds=10))
        spare.set(lv.record_key(3), lv.encode(7, 4242, lv.LocalState(update=5, phase="forward")))
        os.kill(holders[3].pid, signal.SIGKILL)
        holders[3].wait(timeout=30)
        watcher.set("after", "1")  # a round trip after the close was served
        assert not lv.decode(watcher.get(lv.record_key(3))).get("dead")
        spare.close()  # the spare ends too: now rank 3 is gone
        deadline = time.monotonic() + 10
        while not (lv.decode(watcher.get(lv.record_key(3))) or {}).get("dead"):
            assert time.monotonic() < deadline, watcher.get(lv.record_key(3))
            threading.Event().wait(0.02)
    finally:
        for p in holders.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        watcher.close()
        primary.close()
        standby.close()
