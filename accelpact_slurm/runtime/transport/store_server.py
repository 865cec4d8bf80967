"""The job's own store server: rank 0 hosts it, only clients holding the run's key get in.

One thread, non-blocking sockets, one selector.  A connection must complete the handshake of
:mod:`.store_wire` within ``handshake_s`` or it is closed; at most ``pending_cap`` connections may be in their
handshake at once: a new one makes the oldest leave.  So a flood of idle connections (a foreign user on the
node) costs the server one ``accept`` and one ``close`` each and nothing after they end: the keys, the waits of the
authenticated clients and their speed are untouched.  Refused connections are counted and named (the peer's
address and, for a peer on this node, its user): the first at once, then in one warning per ``warn_every_s``.

The server listens on the rendezvous address only (unless it resolves to loopback where ranks on other hosts must
reach it: :func:`listen`), on the first port of the job's
candidates (:func:`accelpact_slurm.runtime.transport.store.port_candidates`) it can bind: a squatted port is skipped.

Who calls: :func:`accelpact_slurm.runtime.transport.store.host_store` on rank 0; :meth:`StoreServer.close` at the rank's
end (the process's exit ends the thread too: it is a daemon thread).
"""

from __future__ import annotations

import errno
import heapq
import ipaddress
import itertools
import logging
import pwd
import secrets
import selectors
import socket
import threading
import time
from typing import Callable, Iterable

from accelpact_slurm.runtime.transport import store_wire as w

log = logging.getLogger(__name__)

PENDING_CAP = 64
HANDSHAKE_S = 5.0
WARN_EVERY_S = 10.0


class _Conn:
    __slots__ = ("sock", "peer", "authed", "inbuf", "outbuf", "ns", "deadline", "sealer", "rank", "parked",
                 "writing", "here", "who")

    def __init__(self, sock: socket.socket, peer: tuple) -> None:
        self.sock, self.peer = sock, peer
        self.authed = False
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.ns = secrets.token_bytes(w.NONCE)
        self.deadline = time.monotonic() + HANDSHAKE_S
        self.sealer: w.Sealer | None = None
        self.rank = -1
        self.parked: "_Wait | None" = None
        self.writing = False  # registered for EVENT_WRITE (an answer did not fit the socket's buffer at once)
        self.here = w.endpoint(sock.getsockname())  # the address the peer dialled, as this end sees it
        self.who: str | None = None  # the peer in words (its user), looked up while its socket surely exists


class _Wait:
    __slots__ = ("conn", "op", "keys", "deadline", "next")

    def __init__(self, conn: _Conn, op: int, keys: list[bytes], deadline: float) -> None:
        self.conn, self.op, self.keys, self.deadline = conn, op, keys, deadline
        self.next = 0  # keys[:next] were there when last looked at (keys are never taken back but by a delete)


class StoreServer:
    """Serve the job's keys to authenticated clients (see the module docstring)."""

    def __init__(self, sock: socket.socket, key: bytes, binding: str, *, pending_cap: int = PENDING_CAP,
                 handshake_s: float = HANDSHAKE_S, warn_every_s: float = WARN_EVERY_S,
                 on_warning: Callable[[str], None] | None = None) -> None:
        self._listen = sock
        self._listen.setblocking(False)
        self._key, self._binding = key, binding
        self.pending_cap, self.handshake_s, self.warn_every_s = pending_cap, handshake_s, warn_every_s
        self._on_warning = on_warning
        self._data: dict[bytes, bytes] = {}
        self._conns: dict[int, _Conn] = {}
        # The parked waits; each is filed under the first of its keys found missing, so that a write wakes only the
        # waits on the keys it wrote (O(1) a write, not O(waits)); their deadlines in a heap (stale entries of
        # answered waits are skipped, and dropped when they outnumber the live ones).
        self._waits: set[_Wait] = set()
        self._waiting_on: dict[bytes, list[_Wait]] = {}
        self._deadlines: list[tuple[float, int, _Wait]] = []
        self._tie = itertools.count()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = False
        self._pending: dict[int, _Conn] = {}  # in their handshake, oldest first (dicts keep insertion order)
        self._accept_paused_until = 0.0  # out of file descriptors: the listener rests a moment
        #: Connections turned away: closed at accept (too many in their handshake), a wrong handshake, too slow.
        self.refused = {"cap": 0, "bad": 0, "slow": 0}
        self._reported = dict(self.refused)
        self._offenders: list[str] = []
        self._lookups_left, self._lookup_window = 8, time.monotonic()
        self._last_warn = float("-inf")  # the first refusal is reported at once, later ones once per window
        self._thread = threading.Thread(target=self._loop, name="accelpact-store", daemon=True)

    @property
    def port(self) -> int:
        return int(self._listen.getsockname()[1])

    @property
    def address(self) -> tuple:
        return self._listen.getsockname()

    def start(self) -> "StoreServer":
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        for conn in list(self._conns.values()):
            self._drop(conn)
        for s in (self._listen, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def connections(self) -> dict[str, int]:
        """How many connections are open, by state (for tests and the flood warning)."""
        return {"authenticated": len(self._conns) - len(self._pending), "handshake": len(self._pending)}

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._step()
        except Exception:  # noqa: BLE001 - a bug here must not leave the ranks waiting on open sockets
            log.exception("the job's store failed; closing every connection (the ranks fail stop at once)")
            for conn in list(self._conns.values()):
                self._drop(conn)
            try:
                self._listen.close()
            except OSError:
                pass

    def _step(self) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listen, selectors.EVENT_READ, None)
        for key, mask in self._sel.select(self._next_deadline()):
            if key.data is None:
                self._accept()
            elif key.data == "wake":
                try:
                    self._wake_r.recv(64)
                except OSError:
                    pass
            else:
                conn = key.data
                if mask & selectors.EVENT_READ and conn.sock.fileno() in self._conns:
                    self._read(conn)
                if mask & selectors.EVENT_WRITE and conn.sock.fileno() in self._conns:
                    self._flush(conn)
        self._expire()
        self._maybe_warn()

    def _next_deadline(self) -> float:
        now = time.monotonic()
        soonest = now + 1.0
        if self._pending:
            soonest = min(soonest, next(iter(self._pending.values())).deadline)  # the oldest expires first
        if self._accept_paused_until:
            soonest = min(soonest, self._accept_paused_until)
        heap = self._deadlines
        while heap and heap[0][2] not in self._waits:
            heapq.heappop(heap)
        if heap:
            soonest = min(soonest, heap[0][0])
        return max(0.0, soonest - now)

    def _accept(self) -> None:
        for _ in range(256):  # a bounded batch: the other connections are served between batches
            try:
                sock, peer = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the flood reached the process's limit
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self.refused["cap"] += 1
                    # the listener stays readable: rest it a moment instead of spinning on it
                    self._sel.unregister(self._listen)
                    self._accept_paused_until = time.monotonic() + 0.1
                return
            if len(self._pending) >= self.pending_cap:
                # the oldest waiting handshake makes room: a rank completes its own in milliseconds, so a flood
                # must outpace that to keep one out, and nothing it holds lasts
                oldest = next(iter(self._pending.values()))
                self.refused["cap"] += 1
                self._note(oldest)
                self._drop(oldest)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, peer)
            conn.deadline = time.monotonic() + self.handshake_s
            if self._lookups_left > 0:  # a few per window: a flood's connections are not each looked up
                self._lookups_left -= 1
                conn.who = describe_peer(peer)
            self._conns[sock.fileno()] = conn
            self._pending[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            conn.outbuf += w.MAGIC + conn.ns
            self._flush(conn)

    def _note(self, conn: _Conn) -> None:
        """Remember who it was (the first few of each warning's window)."""
        if len(self._offenders) < 4:
            who = conn.who if conn.who and "uid" in conn.who else describe_peer(conn.peer)
            if who not in self._offenders:
                self._offenders.append(who)

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        conn.inbuf += chunk
        if not conn.authed:
            if len(conn.inbuf) < w.CLIENT_HELLO_SIZE:
                return
            got = w.parse_client_hello(bytes(conn.inbuf[:w.CLIENT_HELLO_SIZE]), self._key, self._binding, conn.ns,
                                       conn.here)
            if got is None:
                self.refused["bad"] += 1
                self._note(conn)
                self._drop(conn)
                return
            nc, conn.rank = got
            del conn.inbuf[:w.CLIENT_HELLO_SIZE]
            conn.outbuf += w.server_proof(self._key, self._binding, conn.ns, nc, conn.rank, conn.here)
            conn.sealer = w.Sealer(w.session_key(self._key, self._binding, conn.ns, nc, conn.here), b"s", b"c")
            conn.authed = True
            self._pending.pop(conn.sock.fileno(), None)
            self._flush(conn)
        self._serve(conn)

    def _serve(self, conn: _Conn) -> None:
        while conn.parked is None and len(conn.inbuf) >= w.LEN_SIZE and conn.sock.fileno() in self._conns:
            n = w.frame_length(bytes(conn.inbuf[:w.LEN_SIZE]))
            if n > w.MAX_FRAME:
                log.warning("store: rank %d sent a frame of %d bytes; closing its connection", conn.rank, n)
                self._drop(conn)
                return
            if len(conn.inbuf) < w.LEN_SIZE + n:
                return
            body = bytes(conn.inbuf[w.LEN_SIZE:w.LEN_SIZE + n])
            del conn.inbuf[:w.LEN_SIZE + n]
            assert conn.sealer is not None
            payload = conn.sealer.open(body)
            if payload is None:
                log.warning("store: a frame from rank %d failed its MAC; closing its connection", conn.rank)
                self._drop(conn)
                return
            try:
                op, timeout_ms, items = w.parse_request(payload)
                self._handle(conn, op, timeout_ms, items)
            except (ValueError, IndexError) as exc:
                self._reply(conn, w.ERROR, [str(exc).encode()])

    # ------------------------------------------------------------------ operations

    def _handle(self, conn: _Conn, op: int, timeout_ms: int, items: list[bytes]) -> None:
        d = self._data
        if op == w.SET:
            d[items[0]] = items[1]
            self._reply(conn, w.OK, [])
            self._wake(items[:1])
        elif op == w.MULTI_SET:
            if len(items) % 2:
                raise ValueError("multi_set needs key/value pairs")
            for k, v in zip(items[0::2], items[1::2]):
                d[k] = v
            self._reply(conn, w.OK, [])
            self._wake(items[0::2])
        elif op in (w.GET, w.MULTI_GET, w.WAIT, w.SET_GET):
            if op == w.GET and len(items) != 1:
                raise ValueError("get takes one key")
            if op == w.SET_GET:  # one key set, then the keys read as MULTI_GET does: an agreement in one request
                if len(items) < 3:
                    raise ValueError("set_multi_get needs a key, its value and the keys to read")
                d[items[0]] = items[1]
                written, items, op = items[:1], items[2:], w.MULTI_GET
                if all(k in d for k in items):  # the round's last member: answered before the waits it ends
                    self._reply(conn, w.OK, [d[k] for k in items])
                    self._wake(written)
                    return
                self._wake(written)
            if all(k in d for k in items):
                self._reply(conn, w.OK, [] if op == w.WAIT else [d[k] for k in items])
            else:
                conn.parked = wt = _Wait(conn, op, items, time.monotonic() + timeout_ms / 1000.0)
                self._waits.add(wt)
                heapq.heappush(self._deadlines, (wt.deadline, next(self._tie), wt))
                if len(self._deadlines) > 2 * len(self._waits) + 64:
                    self._deadlines = [e for e in self._deadlines if e[2] in self._waits]
                    heapq.heapify(self._deadlines)
                self._file(wt)
        elif op == w.ADD:
            value = int(d.get(items[0], b"0")) + int(items[1])
            d[items[0]] = str(value).encode()
            self._reply(conn, w.OK, [d[items[0]]])
            self._wake(items[:1])
        elif op == w.CAS:
            k, expected, desired = items
            cur = d.get(k)
            if (cur is None and expected == b"") or (cur is not None and cur == expected):
                d[k] = desired
                self._reply(conn, w.OK, [desired])
                self._wake([k])
            else:
                self._reply(conn, w.OK, [expected if cur is None else cur])
        elif op == w.CHECK:
            self._reply(conn, w.OK, [b"1" if all(k in d for k in items) else b"0"])
        elif op == w.DELETE:
            self._reply(conn, w.OK, [b"1" if d.pop(k, None) is not None else b"0" for k in items])  # one or more keys
        elif op == w.NUM_KEYS:
            self._reply(conn, w.OK, [str(len(d)).encode()])

    def _file(self, wt: _Wait) -> None:
        """File a wait under the first of its keys that is missing; answer it when none is."""
        d, keys = self._data, wt.keys
        while True:
            while wt.next < len(keys) and keys[wt.next] in d:
                wt.next += 1
            if wt.next < len(keys):
                self._waiting_on.setdefault(keys[wt.next], []).append(wt)
                return
            if all(k in d for k in keys):
                self._finish(wt, w.OK, [] if wt.op == w.WAIT else [d[k] for k in keys])
                return
            wt.next = 0  # a key found earlier was deleted since: look again from the first

    def _unfile(self, wt: _Wait) -> None:
        """Take a wait that ends unanswered (its deadline, its connection gone) off the key it is filed under."""
        if wt.next < len(wt.keys):
            filed = self._waiting_on.get(wt.keys[wt.next])
            if filed is not None:
                try:
                    filed.remove(wt)
                except ValueError:
                    pass
                if not filed:
                    del self._waiting_on[wt.keys[wt.next]]

    def _wake(self, written: list[bytes]) -> None:
        """The waits filed under the keys just written: answered, or filed under their next missing key."""
        for k in written:
            # The latest waiter first: in a round, the members that came last are the ones the job waits for.
            for wt in reversed(self._waiting_on.pop(k, ())):
                if wt in self._waits:
                    self._file(wt)

    def _finish(self, wt: _Wait, status: int, items: list[bytes]) -> None:
        if wt not in self._waits:  # already answered (a set served meanwhile woke it)
            return
        self._waits.discard(wt)
        if status != w.OK:
            self._unfile(wt)
        conn = wt.conn
        conn.parked = None
        if conn.sock.fileno() in self._conns:
            self._reply(conn, status, items)
            self._serve(conn)  # a frame that came while the wait lasted

    def _reply(self, conn: _Conn, status: int, items: list[bytes]) -> None:
        assert conn.sealer is not None
        conn.outbuf += conn.sealer.seal(w.answer(status, items))
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(conn)
                return
            del conn.outbuf[:sent]
        writing = bool(conn.outbuf)
        if writing == conn.writing:  # the usual case (the answer went out at once): no epoll_ctl
            return
        conn.writing = writing
        try:
            self._sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0), conn)
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        self._conns.pop(fd, None)
        self._pending.pop(fd, None)
        if conn.parked is not None and conn.parked in self._waits:
            self._waits.discard(conn.parked)
            self._unfile(conn.parked)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass

    def _expire(self) -> None:
        now = time.monotonic()
        heap = self._deadlines
        while heap and (heap[0][2] not in self._waits or heap[0][0] <= now):
            _deadline, _tie, wt = heapq.heappop(heap)
            if wt in self._waits:
                self._finish(wt, w.TIMEOUT, [])
        for conn in [c for c in self._pending.values() if c.deadline <= now]:
            self.refused["slow"] += 1
            self._note(conn)
            self._drop(conn)

    def _maybe_warn(self) -> None:
        now = time.monotonic()
        if now - self._lookup_window >= self.warn_every_s:
            self._lookup_window, self._lookups_left = now, 8
        if now - self._last_warn < self.warn_every_s or self.refused == self._reported:
            return
        new = {k: self.refused[k] - self._reported[k] for k in self.refused}
        self._reported = dict(self.refused)
        self._last_warn = now
        peers = ", ".join(self._offenders) or "unknown peers"
        self._offenders = []
        msg = (f"the control plane's store turned away {sum(new.values())} connection(s) without the run's key "
               f"({new['cap']} over the cap of {self.pending_cap} in their handshake, {new['bad']} with a wrong "
               f"handshake, {new['slow']} silent for {self.handshake_s:g} s) from {peers}: somebody else is "
               f"connecting to this job's store; training is not affected")
        log.warning(msg)
        if self._on_warning is not None:
            try:
                self._on_warning(msg)
            except Exception:  # noqa: BLE001 - a warning must not stop the server
                log.debug("the store's warning callback failed", exc_info=True)


def listen(host: str, candidates: Iterable[int], *, reached_from_other_hosts: bool = False
           ) -> tuple[socket.socket, list[int]]:
    """A listening socket on ``host`` at the first candidate port free to bind; the ports found taken beside it.

    ``reached_from_other_hosts``: ranks on other hosts connect.  A host name that resolves to a loopback address
    here (Debian's ``127.0.1.1 <hostname>`` line in ``/etc/hosts``) could not be reached from them: the server then
    listens on every interface, with a warning (it still admits only holders of the run's key).
    """
    taken: list[int] = []
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    if reached_from_other_hosts and _loopback(str(addr[0])):
        log.warning("store: the rendezvous host %s resolves to %s, a loopback address, on this node; the ranks of "
                    "the other nodes could not reach it there, so the store listens on every interface (it admits "
                    "only holders of the run's key); fix the host's entry in /etc/hosts to listen on one", host,
                    addr[0])
        addr = ("::",) + tuple(addr[1:]) if family == socket.AF_INET6 else ("0.0.0.0",) + tuple(addr[1:])
    for port in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # an earlier start's TIME_WAIT, not a squatter
        try:
            sock.bind((addr[0], port) + tuple(addr[2:]))
        except OSError as exc:
            sock.close()
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                taken.append(port)
                continue
            raise
        sock.listen(1024)
        return sock, taken
    raise OSError(errno.EADDRINUSE, f"every candidate port on {host} is taken: {taken}")


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def describe_peer(peer: tuple) -> str:
    """``127.0.0.1:40312 (uid 65534, nobody)``: the user of a peer on this node, when the kernel says."""
    text = f"{peer[0]}:{peer[1]}"
    uid = peer_uid(peer)
    if uid is None:
        return text
    try:
        return f"{text} (uid {uid}, {pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"{text} (uid {uid})"


def peer_uid(peer: tuple) -> int | None:
    """The owner of the socket at ``peer`` on this node (from ``/proc/net/tcp``, or ``tcp6`` for an IPv6 socket,
    an IPv4 peer's included: a dual-stack client shows there as ``::ffff:a.b.c.d``), or None."""
    ip, port = str(peer[0]).split("%")[0], int(peer[1])
    try:
        packed = socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET, ip)
    except OSError:
        return None
    wanted: list[tuple[str, str]] = []
    if len(packed) == 4:
        wanted.append(("/proc/net/tcp", f"{int.from_bytes(packed, 'little'):08X}:{port:04X}"))
        packed = b"\0" * 10 + b"\xff\xff" + packed  # the same peer on a dual-stack socket
    words = [int.from_bytes(packed[i:i + 4], "little") for i in range(0, 16, 4)]
    wanted.append(("/proc/net/tcp6", "".join(f"{x:08X}" for x in words) + f":{port:04X}"))
    for table, want in wanted:
        try:
            with open(table) as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    if len(f) > 7 and f[1] == want:
                        return int(f[7])
        except OSError:
            continue
    return None
