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

A store and its standby (a job with spare nodes, so that node 0's loss is healed like any other): the store links to
the standby as a client of rank :data:`REPLICA_RANK` (:meth:`StoreServer.mirror_to`), first sends it every key it
holds, then holds each write, forwards the writes of each loop round in one batch, and applies and answers them in
order once the standby answered: nothing a client read here is missing there.  The standby (``standby_of``: its
serving socket, bound but not listening, so that every client is refused while the store lives) admits that one
link and nobody else; when the link closes, the store is gone and the standby listens and serves.  A standby that
does not answer within :data:`MIRROR_S` is dropped (reported; :data:`MIRRORED_KEY` deleted) and the store goes on
alone.  An ``add`` may carry a token: one sent again (by a client gone over to the standby) is answered from the
tokens kept, not counted twice.

Who calls: :func:`accelpact_slurm.runtime.transport.store.host_store` on rank 0; :meth:`StoreServer.close` at the rank's
end (the process's exit ends the thread too: it is a daemon thread).
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import secrets
import selectors
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable

from accelpact_slurm.runtime.transport import store_wire as w
from accelpact_slurm.runtime.transport.store_listen import describe_peer, listen, peer_uid  # noqa: F401
from accelpact_slurm.runtime.transport.store_standby import (MIRRORED_KEY, PRESENCE_BASE, REPLICA_RANK,  # noqa: F401
                                                             WRITES, Standby, Witness,
                                                             presence_rank)

log = logging.getLogger(__name__)

PENDING_CAP = 64
HANDSHAKE_S = 5.0
WARN_EVERY_S = 10.0
#: How many add tokens a store remembers (an add sent again after a failover is answered from here).
ADDS_KEPT = 4096


class _Conn:
    __slots__ = ("sock", "peer", "authed", "inbuf", "outbuf", "ns", "deadline", "sealer", "rank", "parked",
                 "writing", "here", "who", "held")

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
        self.held = False  # a write of it waits for the standby's answer (nothing after it is served before)


class _Wait:
    __slots__ = ("conn", "op", "keys", "deadline", "next")

    def __init__(self, conn: _Conn, op: int, keys: list[bytes], deadline: float) -> None:
        self.conn, self.op, self.keys, self.deadline = conn, op, keys, deadline
        self.next = 0  # keys[:next] were there when last looked at (keys are never taken back but by a delete)


class StoreServer(Standby):
    """Serve the job's keys to authenticated clients (see the module docstring)."""

    def __init__(self, sock: socket.socket, key: bytes, binding: str, *, pending_cap: int = PENDING_CAP,
                 handshake_s: float = HANDSHAKE_S, warn_every_s: float = WARN_EVERY_S,
                 on_warning: Callable[[str], None] | None = None, standby_of: socket.socket | None = None,
                 witness: Witness | None = None) -> None:
        self._listen = sock
        # Who left: the open connections of each client rank; when a rank's last one closes, ``witness`` may
        # rewrite one key of it (a rank's heartbeat record marked dead: its process ended, no node peer needed).
        self._witness = witness
        self._open: dict[int, int] = {}
        self._leaving: list[tuple[float, int]] = []  # (when, rank): witness writes waiting out their grace
        # A standby (``standby_of``: the socket it serves clients on, bound, not listening yet): ``sock`` admits
        # the store's link only; once that link was up and is gone, the store is gone and this one serves.
        self._client_sock = standby_of
        self._standby = standby_of is not None
        # Presence connections by rank, and the ranks whose presence ended before this standby served (their
        # departure is witnessed once it serves: the store's own witness may have ended with the store).
        self._present: dict[int, int] = {}
        self._gone_early: dict[int, bytes | None] = {}  # rank -> its record then
        self._linked = False
        self.promoted = standby_of is None
        # A store with a standby: its link, and the writes waiting for the standby's answer (in order).
        self._mirror: tuple[socket.socket, w.Sealer] | None = None
        self._mirror_new: tuple[socket.socket, w.Sealer] | None = None
        self._held: list[tuple[_Conn, int, int, list[bytes]]] = []
        self._adds: OrderedDict[bytes, bytes] = OrderedDict()
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
        if self._mirror_new is not None:
            self._adopt_mirror()
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
        self._release()
        self._expire()
        self._maybe_warn()

    def _next_deadline(self) -> float:
        now = time.monotonic()
        soonest = now + 1.0
        if self._pending:
            soonest = min(soonest, next(iter(self._pending.values())).deadline)  # the oldest expires first
        if self._accept_paused_until:
            soonest = min(soonest, self._accept_paused_until)
        if self._leaving:
            soonest = min(soonest, min(t for t, _r in self._leaving))
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
            if conn.rank <= PRESENCE_BASE:  # a rank's presence: only a standby takes it
                admit = self._standby
            elif conn.rank == REPLICA_RANK:  # a standby's one link, before it serves
                admit = not self.promoted and not self._linked
            else:  # a client only of a serving store
                admit = self.promoted
            if not admit:
                self._drop(conn)
                return
            if conn.rank == REPLICA_RANK:
                self._linked = True
            elif conn.rank >= 0:
                self._open[conn.rank] = self._open.get(conn.rank, 0) + 1
            else:
                present = PRESENCE_BASE - conn.rank
                self._present[present] = self._present.get(present, 0) + 1
            del conn.inbuf[:w.CLIENT_HELLO_SIZE]
            conn.outbuf += w.server_proof(self._key, self._binding, conn.ns, nc, conn.rank, conn.here)
            conn.sealer = w.Sealer(w.session_key(self._key, self._binding, conn.ns, nc, conn.here), b"s", b"c")
            conn.authed = True
            self._pending.pop(conn.sock.fileno(), None)
            self._flush(conn)
        self._serve(conn)

    def _serve(self, conn: _Conn) -> None:
        if conn.rank <= PRESENCE_BASE and conn.inbuf:  # a presence connection asks nothing
            self._drop(conn)
            return
        while (conn.parked is None and not conn.held and len(conn.inbuf) >= w.LEN_SIZE
               and conn.sock.fileno() in self._conns):
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

    def _handle(self, conn: _Conn, op: int, timeout_ms: int, items: list[bytes], *, forwarded: bool = False) -> None:
        if op in WRITES and self._mirror is not None and not forwarded:
            conn.held = True  # applied once the standby has it (:meth:`_release`)
            self._held.append((conn, op, timeout_ms, items))
            return
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
            token = items[2] if len(items) > 2 else None
            if token is not None and token in self._adds:  # sent again after a failover: counted already
                self._reply(conn, w.OK, [self._adds[token]])
                return
            value = int(d.get(items[0], b"0")) + int(items[1])
            d[items[0]] = str(value).encode()
            if token is not None:
                self._adds[token] = d[items[0]]
                if len(self._adds) > ADDS_KEPT:
                    self._adds.popitem(last=False)
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
        if conn.authed and conn.rank == REPLICA_RANK and not self.promoted and not self._stop:
            self._promote()
        if conn.authed and conn.rank >= 0 and conn.sock.fileno() in self._conns:
            left = self._open.get(conn.rank, 0) - 1
            self._open[conn.rank] = left
            if left <= 0 and self._present.get(conn.rank, 0) <= 0 and not self._stop:
                self._left(conn.rank)
        if conn.authed and conn.rank <= PRESENCE_BASE and conn.sock.fileno() in self._conns:
            rank = PRESENCE_BASE - conn.rank
            self._present[rank] = self._present.get(rank, 0) - 1
            if self._present[rank] <= 0 and not self._stop:
                if self.promoted:
                    if self._open.get(rank, 0) <= 0:  # no process of that rank left here (a spare in its place
                        self._left(rank)  # names the rank too)
                elif self._witness is not None:
                    self._gone_early[rank] = self._data.get(self._witness[0](rank))
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
        self._witness_due()
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
