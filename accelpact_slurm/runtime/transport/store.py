"""The job's own store: a ``torch.distributed.Store`` only the job's ranks can reach.

The data plane's rendezvous (Gloo, NCCL), the control plane's agreements and the ranks' heartbeats all go through one
store, hosted by rank 0: a :class:`~.store_server.StoreServer` in a process of its own that lives exactly as long as
rank 0 (:mod:`.store_host`).  Every connection proves, in a mutual handshake, that it holds the run's key
(``.accelpact-key``, readable by the job's user only) and is of this job and start (:mod:`.store_wire`); every frame
after it carries a MAC.  So another user on a node can neither read, write nor delete a vote, and a server she puts on
the job's port first is not believed: the ranks go on to the job's next candidate port.

Ports: :func:`port_candidates` derives the job's ports from the run's key and the job id (not guessable from the job
id; two keys never share a sequence), after the launcher's explicit port if any.  Rank 0 binds the first it can, on
the rendezvous address only; every other rank tries them in order until one answers with the run's key, within
``startup_s``.

Who calls: :func:`accelpact_slurm.runtime.job.topology.init_runtime` (rank 0 hosts; every rank connects, one client for
the data plane, one for the control plane) and the liveness thread (its own client).  Torch only for the ``Store``
base class.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch.distributed as dist

from accelpact_slurm.core.errors import ControlPlaneError
from accelpact_slurm.runtime.transport import store_wire as w
from accelpact_slurm.runtime.transport.store_host import StoreProcess, spawn
from accelpact_slurm.runtime.transport.store_server import StoreServer, listen

log = logging.getLogger(__name__)

#: Derived ports lie below Linux's default ephemeral range (32768-60999), where outgoing connections take theirs.
PORT_LOW, PORT_HIGH = 20000, 32768
CANDIDATES = 16
#: A client waits this long for a server's hello and proof before it tries the next port.
HELLO_S = 5.0
#: How long past a call's own deadline a client waits for the store's answer (the store answers a wait that runs
#: out itself; this covers a store host whose process is slow to get to it).
ANSWER_MARGIN_S = 15.0
#: What torch's "no timeout" (a zero timeout) becomes: the longest wait the wire carries (49 days).
NO_TIMEOUT_S = 0xFFFFFFFF / 1000.0 - ANSWER_MARGIN_S


def binding(job_id: str, restart: int) -> str:
    """What a connection is bound to: this job (with its Slurm step, when it has one) and this start of it."""
    return f"{job_id}/{int(restart)}"


def port_candidates(key: bytes, job_id: str, first: int | None = None, n: int = CANDIDATES) -> list[int]:
    """The job's store ports, in the order every rank tries them (pure): ``first`` (the launcher's), then ports
    derived from the run's key and ``job_id`` (what :func:`binding` binds: the job, its step and its start, so
    that each start has ports of its own)."""
    out: list[int] = [first] if first else []
    counter = 0
    while len(out) < n + (1 if first else 0):
        digest = hmac.new(key, f"accelpact-store-port/{job_id}/{counter}".encode(), hashlib.sha256).digest()
        counter += 1
        for i in range(0, len(digest) - 1, 2):
            port = PORT_LOW + int.from_bytes(digest[i:i + 2], "big") % (PORT_HIGH - PORT_LOW)
            if port not in out:
                out.append(port)
    return out[:n + (1 if first else 0)]


def host_store(host: str, candidates: Sequence[int], key: bytes, bind_to: str,
               on_warning: Callable[[str], None] | None = None, *,
               reached_from_other_hosts: bool = False) -> StoreServer:
    """Rank 0: serve the job's store on ``host`` at the first candidate port it can bind (see the module;
    ``reached_from_other_hosts``: :func:`.store_server.listen`)."""
    sock, taken = listen(host, candidates, reached_from_other_hosts=reached_from_other_hosts)
    if taken:
        log.warning("store: port(s) %s on %s were taken (by another program or user); serving on %d",
                    taken, host, sock.getsockname()[1])
    return StoreServer(sock, key, bind_to, on_warning=on_warning).start()


def host_store_process(host: str, candidates: Sequence[int], key: bytes, bind_to: str,
                       on_warning: Callable[[str], None] | None = None, *,
                       reached_from_other_hosts: bool = False) -> StoreProcess:
    """Rank 0: :func:`host_store`, served by a process of its own that lives exactly as long as this one
    (:mod:`.store_host`: rank 0's interpreter is then on no request's path)."""
    sock, taken = listen(host, candidates, reached_from_other_hosts=reached_from_other_hosts)
    if taken:
        log.warning("store: port(s) %s on %s were taken (by another program or user); serving on %d",
                    taken, host, sock.getsockname()[1])
    return spawn(sock, key, bind_to, on_warning)


class NotOurs(ConnectionError):
    """The port answered, but not with the run's key: another program or another user's server."""


class JobStore(dist.Store):
    """A client of the job's store (see the module docstring); calls are serialised per client object.

    Args:
        host: the store's host (rank 0's rendezvous address).
        candidates: the ports to try, in order (:func:`port_candidates`).
        key: the run's key.
        bind_to: :func:`binding` of this job and start.
        rank: this client's rank (named in the handshake and in the server's log).
        timeout: the default deadline of a blocking call (``get``, ``wait``, ``multi_get``), and of connecting.
    """

    def __init__(self, host: str, candidates: Sequence[int], key: bytes, bind_to: str, rank: int,
                 timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self._lock = threading.Lock()
        self.host, self.rank = host, rank
        self.port, self._sock, self._sealer = self._connect(host, list(candidates), key, bind_to, rank,
                                                            timeout.total_seconds())
        self._sock_timeout: float | None = None

    # ------------------------------------------------------------------ connecting

    @staticmethod
    def _connect(host: str, candidates: list[int], key: bytes, bind_to: str, rank: int,
                 deadline_s: float) -> tuple[int, socket.socket, w.Sealer]:
        deadline = time.monotonic() + deadline_s
        not_ours: set[int] = set()
        last: BaseException | None = None
        while True:
            for port in candidates:
                if port in not_ours:
                    continue
                try:
                    sock, sealer = _handshake(host, port, key, bind_to, rank, max(0.1, deadline - time.monotonic()))
                    if not_ours:
                        log.warning("store: port(s) %s on %s answered without the run's key (another user's or "
                                    "program's server); the job's store is at %d", sorted(not_ours), host, port)
                    return port, sock, sealer
                except NotOurs as exc:
                    not_ours.add(port)
                    last = exc
                except OSError as exc:  # refused (not up yet), reset (turned away while the server was busy)
                    last = exc
                if time.monotonic() >= deadline:
                    break
            if time.monotonic() >= deadline or not_ours >= set(candidates):  # nowhere left to find the job's
                break
            threading.Event().wait(0.05)
        raise dist.DistNetworkError(
            f"could not reach the job's store on {host} within {deadline_s:g} s (ports tried: {candidates}; "
            f"{len(not_ours)} answered without the run's key); last error: {type(last).__name__}: {last}")

    # ------------------------------------------------------------------ requests

    def _call(self, op: int, items: list[bytes], timeout_s: float | None = None,
              meanwhile: Callable[[], None] | None = None) -> list[bytes]:
        """One request and its answer.  ``meanwhile`` runs once the request is sent, before the answer is read
        (work of the caller's own while the store waits for others: the answer waits in the socket); an exception
        of it is raised after the answer is read, so that the connection stays in step."""
        wait_s = self.timeout.total_seconds() if timeout_s is None else timeout_s
        failed: Exception | None = None
        if wait_s <= 0:  # torch's kNoTimeout (zero): wait without a deadline, as TCPStore does
            wait_s = NO_TIMEOUT_S
        with self._lock:
            if self._sock is None:
                raise dist.DistNetworkError(f"the job's store connection of rank {self.rank} is closed")
            try:
                if wait_s != self._sock_timeout:  # a syscall or two: only when the deadline changes
                    self._sock.settimeout(wait_s + ANSWER_MARGIN_S)
                    self._sock_timeout = wait_s
                self._sock.sendall(self._sealer.seal(w.request(op, int(wait_s * 1000), items)))
                if meanwhile is not None:
                    try:
                        meanwhile()
                    except Exception as exc:  # noqa: BLE001 - raised once the answer is in
                        failed = exc
                head = _recv_exact(self._sock, w.LEN_SIZE)
                n = w.frame_length(head)
                if n > w.MAX_FRAME:
                    raise ConnectionError(f"the job's store sent a frame of {n} bytes")
                payload = self._sealer.open(_recv_exact(self._sock, n))
            except OSError as exc:
                self._close_locked()
                raise dist.DistNetworkError(f"lost the job's store at {self.host}:{self.port}: "
                                            f"{type(exc).__name__}: {exc}") from exc
            except BaseException:  # interrupted between a request and its answer: the next call would read this
                self._close_locked()  # one's answer (a signal's exception, say), so the connection ends here
                raise
            if payload is None:
                self._close_locked()
                raise dist.DistNetworkError(f"an answer of the job's store at {self.host}:{self.port} failed its "
                                            f"MAC; connection closed")
        if failed is not None:
            raise failed
        status, out = w.parse_answer(payload)
        if status == w.TIMEOUT:
            raise dist.DistStoreError(f"wait timeout after {wait_s * 1000:.0f}ms for {w.OPS[op]} of "
                                      f"{[k.decode(errors='replace') for k in items[:4]]}")
        if status == w.ERROR:
            raise ControlPlaneError(f"the job's store refused {w.OPS[op]}: {out[0].decode(errors='replace')}")
        return out

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def set(self, key: str, value: bytes | str) -> None:
        self._call(w.SET, [_b(key), _b(value)])

    def get(self, key: str) -> bytes:
        return self._call(w.GET, [_b(key)])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(w.MULTI_GET, [_b(k) for k in keys])

    def set_multi_get(self, key: str, value: bytes | str, keys: list[str],
                      meanwhile: Callable[[], None] | None = None) -> list[bytes]:
        """``set(key, value)`` then ``multi_get(keys)`` in one request (full keys: no ``PrefixStore`` passes this
        through): a control-plane round costs its member one round trip.  ``meanwhile`` as in :meth:`_call`."""
        return self._call(w.SET_GET, [_b(key), _b(value)] + [_b(k) for k in keys], meanwhile=meanwhile)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        items: list[bytes] = []
        for k, v in zip(keys, values):
            items += [_b(k), _b(v)]
        self._call(w.MULTI_SET, items)

    def add(self, key: str, value: int) -> int:
        return int(self._call(w.ADD, [_b(key), str(int(value)).encode()])[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call(w.CAS, [_b(key), _b(expected), _b(desired)])[0]

    def check(self, keys: list[str]) -> bool:
        return self._call(w.CHECK, [_b(k) for k in keys])[0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._call(w.DELETE, [_b(key)])[0] == b"1"

    def delete_keys(self, keys: list[str]) -> int:
        """Delete several keys in one request (full keys: no ``PrefixStore`` passes this through); how many were there."""
        if not keys:
            return 0
        return sum(r == b"1" for r in self._call(w.DELETE, [_b(k) for k in keys]))

    def num_keys(self) -> int:
        return int(self._call(w.NUM_KEYS, [])[0])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(w.WAIT, [_b(k) for k in keys], None if timeout is None else timeout.total_seconds())

    # torch's C++ side looks these up by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys


def _b(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the store closed the connection")
        got += k
    return bytes(buf)


def _handshake(host: str, port: int, key: bytes, bind_to: str, rank: int,
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
            hello = _recv_exact(sock, w.HELLO_SIZE)
        except socket.timeout as exc:  # maybe queued behind a flood: try again later, not "not ours"
            raise ConnectionError(f"{where} sent no hello within {sock.gettimeout():g} s") from exc
        if not hello.startswith(w.MAGIC):
            raise NotOurs(f"{where} is not a store of this project")
        ns = hello[len(w.MAGIC):]
        nc = secrets.token_bytes(w.NONCE)
        server = w.endpoint(sock.getpeername())
        sock.sendall(w.client_hello(key, bind_to, ns, nc, rank, server))
        try:
            proof = _recv_exact(sock, w.MAC)
        except (ConnectionResetError, socket.timeout) as exc:  # our proof was refused: another job's, start's or
            raise NotOurs(f"{where} refused the handshake (not this job's store)") from exc  # key's, or a relay
        if not hmac.compare_digest(proof, w.server_proof(key, bind_to, ns, nc, rank, server)):
            raise NotOurs(f"{where} does not hold the run's key")
        sock.settimeout(None)
        return sock, w.Sealer(w.session_key(key, bind_to, ns, nc, server), b"c", b"s")
    except BaseException:
        sock.close()
        raise
