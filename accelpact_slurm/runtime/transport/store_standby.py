"""The standby side of the job's store: mirroring every write to a standby, the standby's promotion, and the
witness that marks a rank dead once its every connection (or its presence at the standby) closed.

A mixin of :class:`~.store_server.StoreServer` (which says how the pieces fit: its module docstring); split off
for size.  Torch-free, as the server is.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Any, Callable

from accelpact_slurm.runtime.transport import store_wire as w
from accelpact_slurm.runtime.transport.store_dial import handshake, recv_exact

log = logging.getLogger("accelpact_slurm.runtime.transport.store_server")

#: The rank a store's link to its standby names in its handshake (no client has it).
REPLICA_RANK = -2
#: A rank's presence at the standby (``PRESENCE_BASE - rank`` in its handshake): a connection it only holds open,
#: so that the standby witnesses the rank's end even when the store, which would have, ends with it (node 0).
PRESENCE_BASE = -3


def presence_rank(rank: int) -> int:
    """The number a presence connection of ``rank`` names in its handshake (:data:`PRESENCE_BASE`)."""
    return PRESENCE_BASE - rank


#: How long the store waits for its standby's answer to the writes it forwarded, before it goes on without one.
MIRROR_S = 10.0
#: The requests that change the keys: forwarded to the standby before they are applied.
WRITES = frozenset({w.SET, w.MULTI_SET, w.SET_GET, w.ADD, w.CAS, w.DELETE})
#: Set while the store has a standby that holds every key (a client waits on it; deleted when the standby is lost).
MIRRORED_KEY = b"store/mirrored"
#: How long the store's witness waits after a rank's last connection closed before it marks the rank dead: a node peer
#: of the rank (its pidfd) marks it first, with what only a node peer can see (the OOM killer's doing).
WITNESS_GRACE_S = 0.25

#: A store's witness of clients that left (``StoreServer(witness=...)``): the key of a rank's record, and the record
#: rewritten once every connection of that rank closed (None: leave it).
Witness = tuple[Callable[[int], bytes], Callable[[bytes | None], bytes | None]]


class Standby:
    """The store's standby and witness methods (see the module); state lives in :class:`.StoreServer`."""

    # what these methods use of the server (set in StoreServer.__init__, or its methods)
    _data: dict[bytes, bytes]
    _key: bytes
    _binding: str
    _stop: bool
    _wake_w: socket.socket
    _mirror: tuple[socket.socket, w.Sealer] | None
    _mirror_new: tuple[socket.socket, w.Sealer] | None
    _held: list[tuple[Any, int, int, list[bytes]]]
    _witness: Witness | None
    _leaving: list[tuple[float, int]]
    _open: dict[int, int]
    _present: dict[int, int]
    _gone_early: dict[int, bytes | None]
    _client_sock: socket.socket | None
    _listen: socket.socket
    _sel: selectors.BaseSelector
    _accept_paused_until: float
    _on_warning: Callable[[str], None] | None
    _conns: dict[int, Any]
    promoted: bool
    _wake: Any
    _handle: Any
    _reply: Any
    _serve: Any


    def mirror_to(self, host: str, ports: list[int], deadline_s: float) -> threading.Thread:
        """Forward every write to the standby at ``host`` (first of ``ports`` that answers with the run's key),
        connected from a thread within ``deadline_s``; from then on a write is applied, and answered, only once the
        standby has it, so whatever a client saw here the standby holds.  Without an answer from the standby within
        :data:`MIRROR_S` the store goes on alone (reported)."""

        def link() -> None:
            deadline = time.monotonic() + deadline_s
            last: BaseException | None = None
            while time.monotonic() < deadline and not self._stop:
                for port in ports:
                    try:
                        self._mirror_new = handshake(host, port, self._key, self._binding, REPLICA_RANK,
                                                     max(0.5, deadline - time.monotonic()))
                        self._wake_w.send(b"m")
                        return
                    except OSError as exc:
                        last = exc
                threading.Event().wait(0.05)
            self._report(f"the store's standby at {host} did not answer within {deadline_s:g} s ({last}); "
                         f"the store has no standby")

        t = threading.Thread(target=link, name="accelpact-store-mirror", daemon=True)
        t.start()
        return t

    @property
    def mirrored(self) -> bool:
        return self._mirror is not None

    def _adopt_mirror(self) -> None:
        """The link is up: the standby gets every key held now (in one frame each up to a bound), then every write."""
        link, self._mirror_new = self._mirror_new, None
        assert link is not None
        self._mirror = link
        batch: list[bytes] = []
        size = 0
        for k, v in self._data.items():
            batch += [k, v]
            size += len(k) + len(v) + 8
            if size > w.MAX_FRAME // 4:
                self._forward([(w.MULTI_SET, batch)])
                batch, size = [], 0
        if batch and self._mirror is not None:
            self._forward([(w.MULTI_SET, batch)])
        if self._mirror is not None and self._forward([(w.SET, [MIRRORED_KEY, b"1"])]):
            self._data[MIRRORED_KEY] = b"1"
            self._wake([MIRRORED_KEY])
            log.info("store: the standby holds %d keys and gets every write from now on", len(self._data))

    def _forward(self, writes: list[tuple[int, list[bytes]]]) -> bool:
        """Send ``writes`` to the standby and read its answers; on any failure the store goes on without it."""
        if self._mirror is None:
            return False
        sock, sealer = self._mirror
        try:
            sock.settimeout(MIRROR_S)
            sock.sendall(b"".join(sealer.seal(w.request(op, 0, items)) for op, items in writes))
            for _ in writes:
                n = w.frame_length(recv_exact(sock, w.LEN_SIZE))
                if n > w.MAX_FRAME or sealer.open(recv_exact(sock, n)) is None:
                    raise ConnectionError("a bad answer")
            return True
        except (OSError, ValueError) as exc:
            self._mirror = None
            self._data.pop(MIRRORED_KEY, None)
            try:
                sock.close()
            except OSError:
                pass
            self._report(f"the store lost its standby ({type(exc).__name__}: {exc}); it goes on without one")
            return False

    def _release(self) -> None:
        """The writes held this round: forwarded to the standby in one batch, then applied and answered in order
        (and what their connections sent after them served), until none is held."""
        while self._held:
            held, self._held = self._held, []
            self._forward([(w.SET, items[:2]) if op == w.SET_GET else (op, items) for _c, op, _t, items in held])
            for conn, op, timeout_ms, items in held:
                conn.held = False
                try:  # applied even if its client left meanwhile: the standby has it
                    self._handle(conn, op, timeout_ms, items, forwarded=True)
                except (ValueError, IndexError) as exc:
                    self._reply(conn, w.ERROR, [str(exc).encode()])
                if conn.sock.fileno() in self._conns:
                    self._serve(conn)

    def _left(self, rank: int) -> None:
        """Every connection of client ``rank`` closed: the witness's write, :data:`WITNESS_GRACE_S` later (a node
        peer of the rank, which sees more, such as the OOM killer's doing, marks it first)."""
        if self._witness is not None:
            self._leaving.append((time.monotonic() + WITNESS_GRACE_S, rank))

    def _witness_due(self) -> None:
        now = time.monotonic()
        due = [r for t, r in self._leaving if t <= now]
        if not due:
            return
        self._leaving = [(t, r) for t, r in self._leaving if t > now]
        for rank in due:  # still gone (a spare in its place names the rank: it is then not gone)
            if self._open.get(rank, 0) <= 0 and self._present.get(rank, 0) <= 0:
                self._left_now(rank)

    def _left_now(self, rank: int) -> None:
        """The witness's write for ``rank`` (forwarded first, as a client's write is)."""
        if self._witness is None:
            return
        key_of, rewrite = self._witness
        key = key_of(rank)
        try:
            value = rewrite(self._data.get(key))
        except Exception:  # noqa: BLE001 - a witness that fails leaves the key as it is
            log.debug("store: the witness of rank %d failed", rank, exc_info=True)
            return
        if value is None:
            return
        if self._mirror is not None:
            self._forward([(w.SET, [key, value])])
        self._data[key] = value
        self._wake([key])

    def _promote(self) -> None:
        """The standby's link is gone, so is the store: serve its clients on the socket kept for it."""
        self.promoted = True
        assert self._client_sock is not None
        try:
            self._sel.unregister(self._listen)
        except (KeyError, ValueError, OSError):
            pass
        self._listen.close()
        self._client_sock.listen(1024)
        self._client_sock.setblocking(False)
        self._listen = self._client_sock
        self._accept_paused_until = 0.0
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._report(f"the store is gone; its standby serves the job's {len(self._data)} keys on port "
                     f"{self._listen.getsockname()[1]}")
        for rank, then in sorted(self._gone_early.items()):  # ended before the store, or with it: witnessed here,
            if self._witness is not None and self._data.get(self._witness[0](rank)) == then \
                    and self._present.get(rank, 0) <= 0:  # unless its place was taken since (a spare's heartbeat
                self._left(rank)  # changed the record)
        self._gone_early.clear()

    def _report(self, msg: str) -> None:
        log.warning("store: %s", msg)
        if self._on_warning is not None:
            try:
                self._on_warning(msg)
            except Exception:  # noqa: BLE001 - a report must not stop the server
                log.debug("the store's warning callback failed", exc_info=True)
