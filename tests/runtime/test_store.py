"""The job's own store: what torch's ``TCPStore`` does for the ranks, and nothing for anyone else.

The cross-user tests run the intruder as a real second user (``nobody``), as the other security tests do.  Each
carries its control: the same probe against a plain ``TCPStore`` (what the job used before) does get in, reads the
vote, holds its flood of connections open, or takes the job's port.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from accelpact_slurm.runtime.transport import store_wire as w
from accelpact_slurm.runtime.transport.store import JobStore, NotOurs, binding, host_store, port_candidates
from accelpact_slurm.runtime.transport.store_server import StoreServer, listen, peer_uid

ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="a second user (nobody) needs root to set up")
NOBODY = 65534
HOST = "127.0.0.1"


@pytest.fixture
def job():
    """A served store and a factory of its clients."""
    key = secrets.token_bytes(32)
    bind_to = binding("4242", 0)
    ports = port_candidates(key, "4242")
    warnings: list[str] = []
    sock, _taken = listen(HOST, ports)
    server = StoreServer(sock, key, bind_to, handshake_s=1.0, on_warning=warnings.append).start()
    clients: list[JobStore] = []

    def client(rank: int = 0, timeout_s: float = 10.0) -> JobStore:
        c = JobStore(HOST, ports, key, bind_to, rank, timedelta(seconds=timeout_s))
        clients.append(c)
        return c

    yield server, client, warnings, key
    for c in clients:
        c.close()
    server.close()


def _as_nobody(code: str, timeout_s: float = 60.0) -> str:
    """Run ``code`` as the second user; its stdout."""
    prelude = textwrap.dedent(f"""
        import encodings.idna, os, resource, selectors, socket, sys, time
        from datetime import timedelta
        import torch.distributed as dist  # before the user changes: the interpreter's files are root's only here
        resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
    """)
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout_s, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# ---------------------------------------------------------------------- what the ranks need


def test_the_store_does_what_the_ranks_ask_through_a_prefix(job):
    _server, client, _w, _k = job
    p = dist.PrefixStore("cp/g0", client())
    p.set("vote#0/0", "a")
    p.set("bin", b"\x00\xff")
    assert p.get("vote#0/0") == b"a" and p.multi_get(["vote#0/0", "bin"]) == [b"a", b"\x00\xff"]
    assert p.add("n", 2) == 2 and p.add("n", 3) == 5
    assert p.compare_set("n", "5", "9") == b"9" and p.compare_set("n", "5", "1") == b"9"
    assert p.compare_set("fresh", "", "x") == b"x" and p.compare_set("absent", "e", "x") == b"e"
    assert p.check(["n", "bin"]) and not p.check(["n", "nope"])
    assert p.delete_key("n") and not p.delete_key("n")
    p.multi_set(["m1", "m2"], ["1", "2"])
    assert p.get("m2") == b"2" and p.num_keys() >= 5
    p.wait(["m1"], timedelta(seconds=1))
    # Several keys in one delete (the control plane's cleanup), named in full: the prefix is the caller's.
    base = client()
    assert base.delete_keys(["cp/g0/m1", "cp/g0/m2", "cp/g0/never"]) == 2 and not p.check(["m1"])
    assert base.delete_keys([]) == 0


def test_a_wait_ends_when_another_client_sets_the_key_and_runs_out_with_a_store_error(job):
    _server, client, _w, _k = job
    a, b = client(0), client(1)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(a.get("late")))
    t.start()
    b.set("late", "here")
    t.join(10)
    assert got == [b"here"]
    a.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        a.multi_get(["never"])
    a.set("after", "1")  # the connection still serves after a timeout
    assert b.get("after") == b"1"
    # torch's "no timeout" (zero) waits without a deadline, as TCPStore's does, instead of timing out at once
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(a.wait(["later"], timedelta(0)) is None))
    t.start()
    b.set("later", "1")
    t.join(10)
    assert done == [True]


def test_set_multi_get_sets_its_key_and_reads_the_round_once_every_key_is_in(job):
    """A control-plane round in one request: each member's key is set at once (the others see it) and its read
    waits for every member's; the last member's request is answered at once; a missing member runs out the
    deadline with a store error, its own key set all the same."""
    _server, client, _w, _k = job
    a, b, c = client(0), client(1), client(2)
    keys = ["r/0", "r/1", "r/2"]
    got: dict[str, list[bytes]] = {}
    threads = [threading.Thread(target=lambda n=n, s=s: got.__setitem__(n, s.set_multi_get(f"r/{n}", f"v{n}", keys)))
               for n, s in (("0", a), ("1", b))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not c.check(["r/0", "r/1"]):  # both parked with their keys set
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert c.set_multi_get("r/2", "v2", keys) == [b"v0", b"v1", b"v2"]
    for t in threads:
        t.join(10)
    assert got == {"0": [b"v0", b"v1", b"v2"], "1": [b"v0", b"v1", b"v2"]}
    a.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        a.set_multi_get("s/0", "x", ["s/0", "s/1"])
    assert b.get("s/0") == b"x"


def test_gloo_groups_rendezvous_through_it(job):
    _server, client, _w, _k = job
    stores = [dist.PrefixStore("g", client(r)) for r in range(2)]
    out: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(stores[r], r, 2, timedelta(seconds=20))
        t = torch.full((3,), float(r + 1))
        pg.allreduce([t]).wait()
        out[r] = t

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0].tolist() == out[1].tolist() == [3.0, 3.0, 3.0]


def test_a_frame_changed_replayed_or_reordered_fails_its_mac():
    session = secrets.token_bytes(32)
    tx, rx = w.Sealer(session, b"c", b"s"), w.Sealer(session, b"s", b"c")
    f1, f2 = tx.seal(b"first"), tx.seal(b"second")
    assert rx.open(f2[w.LEN_SIZE:]) is None  # out of order
    tampered = bytearray(f1)
    tampered[-1] ^= 1
    assert rx.open(bytes(tampered[w.LEN_SIZE:])) is None
    assert rx.open(f1[w.LEN_SIZE:]) == b"first"
    assert rx.open(f1[w.LEN_SIZE:]) is None  # replayed
    assert rx.open(f2[w.LEN_SIZE:]) == b"second"


def test_a_client_of_another_job_or_start_or_key_is_turned_away(job):
    server, _client, _w, key = job
    for other_key, bind_to in ((key, binding("4242", 1)), (key, binding("4243", 0)), (secrets.token_bytes(32),
                                                                                      binding("4242", 0))):
        with pytest.raises(dist.DistNetworkError, match="answered without the run's key"):
            JobStore(HOST, [server.port], other_key, bind_to, 0, timedelta(seconds=1))
    assert server.refused["bad"] == 3


# ---------------------------------------------------------------------- everyone else


def test_the_store_listens_on_the_rendezvous_address_only():
    key = secrets.token_bytes(32)
    server = host_store(HOST, port_candidates(key, "1"), key, binding("1", 0))
    plain = dist.TCPStore(HOST, 0, 1, is_master=True, wait_for_workers=False)
    try:
        assert _listening_address(server.port) == HOST
        # Control: torch's store, given the same address, listens on every interface (what the job did before).
        assert _listening_address(plain.port) in ("0.0.0.0", "::")
    finally:
        server.close()
        del plain


@ROOT_ONLY
@pytest.mark.slow
def test_another_user_can_neither_read_nor_change_a_vote(job):
    server, client, warnings, _key = job
    mine = client(0)
    mine.set("cp/g0/vote#3/1", '{"ok": true, "loss": 2.5}')
    plain = dist.TCPStore(HOST, 0, 1, is_master=True, wait_for_workers=False)  # the control: the store of before
    plain.set("cp/g0/vote#3/1", '{"ok": true, "loss": 2.5}')
    out = _as_nobody(f"""
        import socket
        from datetime import timedelta
        import torch.distributed as dist
        def probe(port):
            try:
                s = dist.TCPStore("{HOST}", port, 1, False, timeout=timedelta(seconds=2))
                value = s.get("cp/g0/vote#3/1")
                s.set("cp/g0/vote#3/1", '{{"ok": false, "reason": "hers"}}')
                return "read " + value.decode()
            except Exception as exc:
                return "refused " + type(exc).__name__
        print("plain:", probe({plain.port}))
        print("job:", probe({server.port}))
        raw = socket.create_connection(("{HOST}", {server.port}), timeout=5)
        hello = raw.recv(100)
        raw.sendall(b"APST1\\n" + bytes(32) + bytes(4) + bytes(32))
        print("raw:", raw.recv(100) == b"")
    """)
    assert "plain: read " in out, out  # the probe works: it reads and rewrites a plain TCPStore
    assert "job: refused" in out and "raw: True" in out, out
    assert mine.get("cp/g0/vote#3/1") == b'{"ok": true, "loss": 2.5}'
    assert plain.get("cp/g0/vote#3/1") != b'{"ok": true, "loss": 2.5}'  # the control was rewritten
    assert server.refused["bad"] + server.refused["slow"] >= 1
    _wait_for(lambda: warnings, "the store's warning")
    assert "uid 65534" in warnings[0] and "turned away" in warnings[0], warnings


@ROOT_ONLY
@pytest.mark.slow
def test_a_flood_of_idle_connections_is_bounded_named_and_gone_with_it():
    key = secrets.token_bytes(32)
    bind_to = binding("7", 0)
    warnings: list[str] = []
    sock, _ = listen(HOST, port_candidates(key, "7"))
    server = StoreServer(sock, key, bind_to, handshake_s=0.5, warn_every_s=5.0, on_warning=warnings.append).start()
    mine = JobStore(HOST, [server.port], key, bind_to, 0, timedelta(seconds=10))
    plain = dist.TCPStore(HOST, 0, 1, is_master=True, wait_for_workers=False)
    try:
        code = f"""
            import socket, sys, time, selectors
            def flood(port, n=3000):
                socks = []
                for _ in range(n):
                    try:
                        socks.append(socket.create_connection(("{HOST}", port), timeout=5))
                    except OSError:
                        pass
                sel = selectors.DefaultSelector()
                for s in socks:
                    s.setblocking(False); sel.register(s, selectors.EVENT_READ)
                closed, deadline = set(), time.monotonic() + 3.0
                while time.monotonic() < deadline and len(closed) < len(socks):
                    for k, _ in sel.select(0.2):
                        try:
                            data = k.fileobj.recv(4096)
                        except OSError:
                            data = b""
                        if not data:
                            closed.add(k.fileobj); sel.unregister(k.fileobj)
                print(port, len(socks), len(closed), flush=True)
                for s in socks:
                    s.close()
            flood({plain.port}, 1000)
            flood({server.port})
        """
        out: list[str] = []
        intruder = threading.Thread(target=lambda: out.append(_as_nobody(code, 120)))
        intruder.start()
        served = 0
        while intruder.is_alive():  # the job keeps using its store while the flood lasts
            mine.set("hb/0", str(served))
            assert mine.get("hb/0") == str(served).encode()
            served += 1
        intruder.join()
        lines = dict((int(p), (int(n), int(c))) for p, n, c in (ln.split() for ln in out[0].split("\n") if ln))
        opened, closed = lines[server.port]
        assert opened >= 2000 and closed == opened, lines  # every one of them closed by the store
        p_opened, p_closed = lines[plain.port]
        assert p_opened >= 900 and p_closed == 0, lines  # control: torch's store keeps them all
        assert served > 0
        _wait_for(lambda: server.connections()["handshake"] == 0, "the flood's connections to be gone")
        assert server.connections()["authenticated"] == 1
        _wait_for(lambda: warnings, "the flood's warning")
        assert "uid 65534" in " ".join(warnings) and "training is not affected" in warnings[0], warnings
    finally:
        mine.close()
        server.close()
        del plain


@ROOT_ONLY
def test_a_squatted_port_is_skipped_and_a_squatter_not_believed():
    """She binds the job's first port and answers like a store: the job serves on its next one, and the ranks,
    which try the first port first, do not believe her."""
    key = secrets.token_bytes(32)
    ports = port_candidates(key, "9", n=4)
    squatter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import encodings.idna, os, socket
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
        s = socket.socket(); s.bind(("{HOST}", {ports[0]})); s.listen(64); print("ready", flush=True)
        while True:
            c, _ = s.accept()
            c.sendall(b"APST1\\n" + bytes(32)); c.recv(1000); c.sendall(bytes(32)); c.close()
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "ready"
        server = host_store(HOST, ports, key, binding("9", 0))
        try:
            assert server.port == ports[1]
            client = JobStore(HOST, ports, key, binding("9", 0), 1, timedelta(seconds=10))
            assert client.port == ports[1]
            client.set("k", "v")
            assert server._data[b"k"] == b"v"
            client.close()
        finally:
            server.close()
        # Control: a rank that only knew the first port (the job's fixed port of before) talks to her.
        with pytest.raises(NotOurs):
            from accelpact_slurm.runtime.transport.store import _handshake
            _handshake(HOST, ports[0], key, binding("9", 0), 1, 5.0)
    finally:
        squatter.kill()
        squatter.wait(10)


def test_ports_follow_the_run_key_not_the_job_id_alone():
    a, b = secrets.token_bytes(32), secrets.token_bytes(32)
    assert port_candidates(a, "1234") == port_candidates(a, "1234")
    assert port_candidates(a, "1234") != port_candidates(b, "1234")
    # Job ids 10,000 apart gave the same ports before; now they share none (with overwhelming probability).
    assert not set(port_candidates(a, "1234")[:4]) & set(port_candidates(b, "11234")[:4])
    assert port_candidates(a, "1", first=4000)[0] == 4000
    assert all(20000 <= p < 32768 for p in port_candidates(a, "1"))


def test_the_uid_of_a_local_peer_is_named():
    srv = socket.socket()
    srv.bind((HOST, 0))
    srv.listen(1)
    c = socket.create_connection(srv.getsockname())
    conn, peer = srv.accept()
    try:
        assert peer_uid(peer) == os.getuid()
    finally:
        for s in (c, conn, srv):
            s.close()


def _listening_address(port: int) -> str:
    for table, fam in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as fh:
            next(fh)
            for line in fh:
                f = line.split()
                addr, p = f[1].split(":")
                if int(p, 16) == port and f[3] == "0A":  # LISTEN
                    raw = bytes.fromhex(addr)
                    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    return socket.inet_ntop(fam, packed)
    raise AssertionError(f"nothing listens on {port}")


def _wait_for(cond, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.02)


def test_a_host_name_on_loopback_is_not_bound_there_when_other_hosts_must_reach_it():
    """Debian maps a host's own name to 127.0.1.1: bound there, the store would be unreachable from the other
    nodes; it listens on every interface instead (still admitting only holders of the key)."""
    sock, _ = listen("127.0.1.1", [0], reached_from_other_hosts=True)
    try:
        assert sock.getsockname()[0] == "0.0.0.0"
    finally:
        sock.close()
    sock, _ = listen("127.0.1.1", [0])  # the embedded default: every rank is on this host
    try:
        assert sock.getsockname()[0] == "127.0.1.1"
    finally:
        sock.close()


def _relay(to_port: int) -> tuple[socket.socket, threading.Thread]:
    """A listener that forwards every byte to the store and back (what another user could put on a port)."""
    lst = socket.socket()
    lst.bind((HOST, 0))
    lst.listen(4)

    def pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve() -> None:
        try:
            c, _ = lst.accept()
        except OSError:
            return
        up = socket.create_connection((HOST, to_port))
        threading.Thread(target=pump, args=(c, up), daemon=True).start()
        pump(up, c)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lst, t


def test_a_relay_in_the_middle_gets_no_connection(job):
    """She binds a port the ranks try first and forwards the bytes to the job's store: the handshake names the
    address the rank dialled, so the store refuses it (before, the relayed handshake passed and she read every
    frame)."""
    server, _client, _w, key = job
    lst, t = _relay(server.port)
    try:
        with pytest.raises(dist.DistNetworkError, match="answered without the run's key"):
            JobStore(HOST, [lst.getsockname()[1]], key, binding("4242", 0), 1, timedelta(seconds=2))
        assert server.refused["bad"] == 1
    finally:
        lst.close()
        t.join(5)


def test_a_flood_of_handshakes_cannot_keep_a_rank_out():
    """Connections that never finish their handshake fill the slots: a new one makes the oldest leave, so a rank
    gets in at once (before, it was closed at accept until the flood's connections timed out)."""
    key = secrets.token_bytes(32)
    sock, _ = listen(HOST, port_candidates(key, "5"))
    server = StoreServer(sock, key, binding("5", 0), pending_cap=4, handshake_s=60.0).start()
    idle = [socket.create_connection((HOST, server.port)) for _ in range(4)]
    try:
        for s in idle:
            assert s.recv(100).startswith(w.MAGIC)  # each was taken into the handshake
        client = JobStore(HOST, [server.port], key, binding("5", 0), 0, timedelta(seconds=3))
        client.set("k", "v")
        assert client.get("k") == b"v" and server.refused["cap"] >= 1
        client.close()
    finally:
        for s in idle:
            s.close()
        server.close()


def test_pipelined_requests_neither_kill_the_store_nor_shift_its_answers(job):
    """A client that does not wait for its answers: A waits for k with a set of j queued behind it, B waits for
    j, C sets k.  Serving A's queued set answers B inside the same wake-up; B must not be answered twice (that
    raised inside the store's thread and ended it, leaving every rank waiting on an open socket)."""
    server, client, _w, _k = job
    a, b, c = client(0), client(1), client(2)

    def answer(store):
        n = w.frame_length(store._sock.recv(w.LEN_SIZE, socket.MSG_WAITALL))
        return w.parse_answer(store._sealer.open(store._sock.recv(n, socket.MSG_WAITALL)))

    a._sock.sendall(a._sealer.seal(w.request(w.GET, 10000, [b"k"])) + a._sealer.seal(w.request(w.SET, 0, [b"j", b"J"])))
    b._sock.sendall(b._sealer.seal(w.request(w.GET, 10000, [b"j"])))
    _wait_for(lambda: len(server._waits) == 2, "both waits parked")
    c.set("k", "K")
    assert answer(a) == (w.OK, [b"K"]) and answer(a) == (w.OK, []) and answer(b) == (w.OK, [b"J"])
    c.set("after", "1")  # the store still serves
    assert c.get("after") == b"1" and server._thread.is_alive()


def test_a_call_interrupted_before_its_answer_closes_the_connection(job, monkeypatch):
    """An exception between a request and its answer (a signal's, say): the next call must not read the old
    answer as its own; the connection is closed instead."""
    import accelpact_slurm.runtime.transport.store as st

    _server, client, _w, _k = job
    c = client(0)
    c.set("a", "1")
    c.set("b", "2")
    real = st._recv_exact
    calls = []

    def interrupted(sock, n):
        calls.append(n)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(sock, n)

    monkeypatch.setattr(st, "_recv_exact", interrupted)
    with pytest.raises(KeyboardInterrupt):
        c.get("a")
    with pytest.raises(dist.DistNetworkError, match="closed"):
        c.get("b")


def test_a_write_wakes_only_the_waits_on_its_key_and_a_deleted_key_is_waited_for_again(job):
    """Waits are filed under the first key they miss: a write answers exactly those that then have every key,
    one whose key was deleted meanwhile waits on, and one that runs out leaves nothing filed behind."""
    server, client, _w, _k = job
    a, b, c = client(0), client(1), client(2)

    def answer(store):
        n = w.frame_length(store._sock.recv(w.LEN_SIZE, socket.MSG_WAITALL))
        return w.parse_answer(store._sealer.open(store._sock.recv(n, socket.MSG_WAITALL)))

    a._sock.sendall(a._sealer.seal(w.request(w.MULTI_GET, 10000, [b"x", b"y", b"z"])))
    b._sock.sendall(b._sealer.seal(w.request(w.GET, 300, [b"never"])))
    _wait_for(lambda: len(server._waits) == 2, "both waits parked")
    c.set("x", "1")
    c.set("y", "2")
    c.delete_key("x")
    c.set("z", "3")  # x is gone again: a's wait goes on
    assert c.check(["y", "z"]) and len(server._waits) >= 1
    c.set("x", "4")
    assert answer(a) == (w.OK, [b"4", b"2", b"3"])
    assert answer(b)[0] == w.TIMEOUT
    c.set("after", "1")  # a round trip: the store has served everything before it
    assert not server._waits and not server._waiting_on
