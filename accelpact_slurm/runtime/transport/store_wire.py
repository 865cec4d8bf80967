"""The wire of the job's own store: a mutual handshake under the run's key, then MAC'd frames.

Torch's ``TCPStore`` lets anyone who reaches its port read, write and delete every key, and a few thousand idle
connections slow it for good.  The job's store (:mod:`.store`, :mod:`.store_server`) speaks this protocol
instead; it is small enough to read in one sitting.  Torch-free.

Handshake (fixed sizes, before anything else is read or answered)::

    server -> client   MAGIC | Ns (32 random bytes)
    client -> server   MAGIC | Nc (32) | rank (4) | HMAC(key, "client" | binding | server | Ns | Nc | rank)
    server -> client   HMAC(key, "server" | binding | server | Ns | Nc | rank)

``binding`` names the job, its step and its start (``<job id>/<restart>``): a client of another job, or of an
earlier start of this one, does not get in, and a server that cannot answer with the run's key (a squatter on the
port) is not believed.  ``server`` is the server's address and port as the client dialled it and as the server's
socket has it: a relay (another user's listener forwarding the bytes to the real store) is dialled elsewhere, so
its connections fail the proof.  Each part of a MAC's input is length-prefixed.  Both sides then derive a session key from the two nonces; every frame after that is::

    length (4) | tag (16) | payload

with ``tag = HMAC(session, direction | counter | payload)[:16]``: a frame cannot be forged, replayed or reordered
inside the connection (frames are authenticated, not encrypted: only the job's ranks get a connection).  A
request's payload is ``op (1) | timeout in ms (4) | items``; an answer's is
``status (1) | items``; items are ``count (4)`` then ``length (4) | bytes`` each.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

MAGIC = b"APST1\n"
NONCE = 32
MAC = 32
TAG = 16
#: The largest frame either side accepts once authenticated (votes, offers and Gloo addresses are small; a
#: snapshot's extra state grows with the job).
MAX_FRAME = 1 << 30

# Requests.
SET, GET, ADD, CAS, CHECK, DELETE, MULTI_GET, MULTI_SET, WAIT, NUM_KEYS, SET_GET = range(1, 12)
OPS = {SET: "set", GET: "get", ADD: "add", CAS: "compare_set", CHECK: "check", DELETE: "delete_key",
       MULTI_GET: "multi_get", MULTI_SET: "multi_set", WAIT: "wait", NUM_KEYS: "num_keys",
       SET_GET: "set_multi_get"}
# Answers.
OK, TIMEOUT, ERROR = 0, 1, 2

_HELLO = struct.Struct(">i")
_LEN = struct.Struct(">I")
_REQ = struct.Struct(">BI")
_COUNT = struct.Struct(">I")
_CTR = struct.Struct(">BQ")

HELLO_SIZE = len(MAGIC) + NONCE
CLIENT_HELLO_SIZE = len(MAGIC) + NONCE + _HELLO.size + MAC


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(_LEN.pack(len(p)) + p for p in parts), hashlib.sha256).digest()


def endpoint(address: tuple) -> bytes:
    """The server's end of a connection, as both sides see it: ``ip:port`` (an IPv4 address a dual-stack socket
    shows as ``::ffff:a.b.c.d`` is written as ``a.b.c.d``)."""
    ip = str(address[0]).split("%")[0]
    if ip.startswith("::ffff:") and "." in ip:
        ip = ip[len("::ffff:"):]
    return f"{ip}:{int(address[1])}".encode()


def client_proof(key: bytes, binding: str, ns: bytes, nc: bytes, rank: int, server: bytes) -> bytes:
    return _mac(key, b"client", binding.encode(), server, ns, nc, _HELLO.pack(rank))


def server_proof(key: bytes, binding: str, ns: bytes, nc: bytes, rank: int, server: bytes) -> bytes:
    return _mac(key, b"server", binding.encode(), server, ns, nc, _HELLO.pack(rank))


def session_key(key: bytes, binding: str, ns: bytes, nc: bytes, server: bytes) -> bytes:
    return _mac(key, b"session", binding.encode(), server, ns, nc)


def client_hello(key: bytes, binding: str, ns: bytes, nc: bytes, rank: int, server: bytes) -> bytes:
    """``server``: :func:`endpoint` of the address the client dialled.  A relay (another user's listener that
    forwards the bytes to the job's store) is dialled at another address than the store's: the store refuses the
    proof, and the relay cannot change it."""
    return MAGIC + nc + _HELLO.pack(rank) + client_proof(key, binding, ns, nc, rank, server)


def parse_client_hello(blob: bytes, key: bytes, binding: str, ns: bytes, server: bytes) -> tuple[bytes, int] | None:
    """``(Nc, rank)`` of an authentic client hello that dialled ``server`` (this end's :func:`endpoint`), else
    None (pure)."""
    if len(blob) != CLIENT_HELLO_SIZE or not blob.startswith(MAGIC):
        return None
    nc = blob[len(MAGIC):len(MAGIC) + NONCE]
    (rank,) = _HELLO.unpack_from(blob, len(MAGIC) + NONCE)
    proof = blob[len(MAGIC) + NONCE + _HELLO.size:]
    if not hmac.compare_digest(proof, client_proof(key, binding, ns, nc, rank, server)):
        return None
    return nc, rank


class Sealer:
    """The MAC'd frames of one side of one connection (``direction``: b"c" for the client's, b"s" the server's)."""

    def __init__(self, session: bytes, send_dir: bytes, recv_dir: bytes) -> None:
        self._session = session
        self._send_dir, self._recv_dir = send_dir, recv_dir
        self._sent = self._received = 0

    def seal(self, payload: bytes) -> bytes:
        tag = hmac.digest(self._session, _CTR.pack(self._send_dir[0], self._sent) + payload, "sha256")
        self._sent += 1
        return _LEN.pack(TAG + len(payload)) + tag[:TAG] + payload

    def open(self, body: bytes) -> bytes | None:
        """The payload of one frame's body (after its length), or None when its tag is wrong."""
        if len(body) < TAG:
            return None
        tag, payload = body[:TAG], body[TAG:]
        want = hmac.digest(self._session, _CTR.pack(self._recv_dir[0], self._received) + payload, "sha256")[:TAG]
        if not hmac.compare_digest(tag, want):
            return None
        self._received += 1
        return payload


def frame_length(head: bytes) -> int:
    (n,) = _LEN.unpack(head)
    return n


LEN_SIZE = _LEN.size


def pack_items(items: list[bytes]) -> bytes:
    out = [_COUNT.pack(len(items))]
    for it in items:
        out.append(_LEN.pack(len(it)))
        out.append(it)
    return b"".join(out)


def unpack_items(blob: bytes, offset: int) -> list[bytes]:
    """The items of ``blob`` from ``offset``; ValueError when malformed (pure)."""
    if len(blob) < offset + _COUNT.size:
        raise ValueError("truncated item count")
    (n,) = _COUNT.unpack_from(blob, offset)
    pos = offset + _COUNT.size
    items = []
    for _ in range(n):
        if len(blob) < pos + _LEN.size:
            raise ValueError("truncated item length")
        (size,) = _LEN.unpack_from(blob, pos)
        pos += _LEN.size
        if len(blob) < pos + size:
            raise ValueError("truncated item")
        items.append(blob[pos:pos + size])
        pos += size
    if pos != len(blob):
        raise ValueError("trailing bytes")
    return items


def request(op: int, timeout_ms: int, items: list[bytes]) -> bytes:
    return _REQ.pack(op, max(0, min(timeout_ms, 0xFFFFFFFF))) + pack_items(items)


def parse_request(payload: bytes) -> tuple[int, int, list[bytes]]:
    if len(payload) < _REQ.size:
        raise ValueError("truncated request")
    op, timeout_ms = _REQ.unpack_from(payload)
    if op not in OPS:
        raise ValueError(f"unknown operation {op}")
    return op, timeout_ms, unpack_items(payload, _REQ.size)


def answer(status: int, items: list[bytes]) -> bytes:
    return bytes([status]) + pack_items(items)


def parse_answer(payload: bytes) -> tuple[int, list[bytes]]:
    if not payload:
        raise ValueError("empty answer")
    return payload[0], unpack_items(payload, 1)
