"""The client's side of the store's handshake, torch-free: dial the job's store and prove the run's key.

Used by every client (:class:`.store.JobStore`) and by the store that mirrors its writes to a standby
(:mod:`.store_server`, in its own process where torch is not imported).
"""

from __future__ import annotations

import hmac
import secrets
import socket

from accelpact_slurm.runtime.transport import store_wire as w

#: A client waits this long for a server's hello and proof before it tries the next port.
HELLO_S = 5.0


class NotOurs(ConnectionError):
    """The port answered, but not with the run's key: another program or another user's server."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the store closed the connection")
        got += k
    return bytes(buf)


def handshake(host: str, port: int, key: bytes, bind_to: str, rank: int,
               budget_s: float) -> tuple[socket.socket, w.Sealer]:
    """The job's store at ``host:port``, authenticated; each of the host's addresses is tried in turn.

    Raises :class:`NotOurs` when every address that answered proved not to be the job's store (wrong magic, a
    refused proof, a wrong proof), and ``OSError`` for what may pass (refused: not up yet; closed or silent before
    its hello: turned away while the store was busy).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    not_ours: NotOurs | None = None
    transient: OSError | None = None
    for family, kind, proto, _name, addr in infos:
        try:
            return _handshake_at(family, kind, proto, addr, key, bind_to, rank, budget_s)
        except NotOurs as exc:
            not_ours = exc
        except OSError as exc:
            transient = exc
    if transient is not None or not_ours is None:
        raise transient or ConnectionError(f"{host}:{port} has no address")
    raise not_ours


def _handshake_at(family: int, kind: int, proto: int, addr: tuple, key: bytes, bind_to: str, rank: int,
                  budget_s: float) -> tuple[socket.socket, w.Sealer]:
    where = f"{addr[0]}:{addr[1]}"
    sock = socket.socket(family, kind, proto)
    try:
        sock.settimeout(min(max(budget_s, 0.5), HELLO_S))
        sock.connect(addr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = recv_exact(sock, w.HELLO_SIZE)
        except socket.timeout as exc:  # maybe queued behind a flood: try again later, not "not ours"
            raise ConnectionError(f"{where} sent no hello within {sock.gettimeout():g} s") from exc
        if not hello.startswith(w.MAGIC):
            raise NotOurs(f"{where} is not a store of this project")
        ns = hello[len(w.MAGIC):]
        nc = secrets.token_bytes(w.NONCE)
        server = w.endpoint(sock.getpeername())
        sock.sendall(w.client_hello(key, bind_to, ns, nc, rank, server))
        try:
            proof = recv_exact(sock, w.MAC)
        except (ConnectionResetError, socket.timeout) as exc:  # our proof was refused: another job's, start's or
            raise NotOurs(f"{where} refused the handshake (not this job's store)") from exc  # key's, or a relay
        if not hmac.compare_digest(proof, w.server_proof(key, bind_to, ns, nc, rank, server)):
            raise NotOurs(f"{where} does not hold the run's key")
        sock.settimeout(None)
        return sock, w.Sealer(w.session_key(key, bind_to, ns, nc, server), b"c", b"s")
    except BaseException:
        sock.close()
        raise
