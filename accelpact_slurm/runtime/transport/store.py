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

In a job with spare nodes the store has a standby on node 1 (:func:`host_standby_process`,
:func:`accelpact_slurm.runtime.job.topology.mirror_store`): every write is on it before the store answers, and a
client whose connection to the store breaks sends its request again to the standby (:meth:`JobStore.set_standby`),
which serves once the store is gone.

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
from accelpact_slurm.runtime.detection import liveness as lv
from accelpact_slurm.runtime.transport import store_wire as w
from accelpact_slurm.runtime.transport.store_dial import HELLO_S, NotOurs
from accelpact_slurm.runtime.transport.store_dial import handshake as _handshake, recv_exact as _recv_exact
from accelpact_slurm.runtime.transport.store_host import StoreProcess, spawn
from accelpact_slurm.runtime.transport.store_server import StoreServer, listen

log = logging.getLogger(__name__)

#: Derived ports lie below Linux's default ephemeral range (32768-60999), where outgoing connections take theirs.
PORT_LOW, PORT_HIGH = 20000, 32768
CANDIDATES = 16
#: How long past a call's own deadline a client waits for the store's answer (the store answers a wait that runs
#: out itself; this covers a store host whose process is slow to get to it).
ANSWER_MARGIN_S = 15.0
#: How long a client whose store is gone tries its standby: it serves within milliseconds of the store's end (its link
#: closes); one that does not answer by then is gone too (a start that ended: its spares must still see their stop).
FAILOVER_S = 3.0
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
    return StoreServer(sock, key, bind_to, on_warning=on_warning, witness=(lv.witness_key, lv.witnessed_death)).start()


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


def standby_ports(key: bytes, job_id: str) -> tuple[list[int], list[int]]:
    """The standby's ports (pure): where the store's link reaches it, and where it serves clients once the store is
    gone (both derived as :func:`port_candidates` are, apart from the store's own)."""
    link = port_candidates(key, f"{job_id}/standby-link")
    return link, port_candidates(key, f"{job_id}/standby")


def host_standby_process(host: str, key: bytes, bind_to: str, on_warning: Callable[[str], None] | None = None, *,
                         reached_from_other_hosts: bool = False) -> tuple[StoreProcess, int]:
    """The store's standby beside this rank, in a process of its own that lives exactly as long as this rank: it
    takes the store's writes over its link, and serves the job's clients once the store is gone
    (:mod:`.store_server`).  Returns the process (its ``port``: where clients reach it then) and its link's port."""
    link_ports, client_ports = standby_ports(key, bind_to)
    link, _ = listen(host, link_ports, reached_from_other_hosts=reached_from_other_hosts)
    serve, _ = listen(host, client_ports, reached_from_other_hosts=reached_from_other_hosts, backlog=0)
    link_port = int(link.getsockname()[1])
    return spawn(link, key, bind_to, on_warning, standby_of=serve), link_port


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
        self._key, self._bind_to = key, bind_to
        self.port, self._sock, self._sealer = self._connect(host, list(candidates), key, bind_to, rank,
                                                            timeout.total_seconds())
        self._sock_timeout: float | None = None
        #: The standby that takes the store's place if its host dies (:meth:`set_standby`), and whether this
        #: client went over to it.
        self.standby: tuple[str, list[int]] | None = None
        self.failed_over = False

    def sibling(self, timeout: timedelta, rank: int | None = None) -> "JobStore":
        """Another client of the store this one talks to now (its standby, once gone over), with the same standby:
        for a thread of its own.  ``rank``: the rank it names (default this one's)."""
        rank = self.rank if rank is None else rank
        try:
            other = JobStore(self.host, [self.port], self._key, self._bind_to, rank, timeout)
        except dist.DistNetworkError:
            if self.standby is None or self.failed_over:
                raise
            other = JobStore(self.standby[0], self.standby[1], self._key, self._bind_to, rank, timeout)
            other.failed_over = True
        if self.standby is not None and not self.failed_over and not other.failed_over:
            other.set_standby(*self.standby)
        other.failed_over = other.failed_over or self.failed_over
        return other

    def set_standby(self, host: str, ports: Sequence[int]) -> None:
        """Where the store's standby serves once the store's host is gone (:mod:`.store_server`, mirrored): a
        request that loses its connection is sent again there, once, instead of failing."""
        self.standby = (host, [int(p) for p in ports])

    def _fail_over(self, lost: OSError) -> bool:
        """The connection to the store broke: connect to its standby (it listens only once the store is gone, so a
        live store's client never gets in), within :data:`FAILOVER_S`.  True when connected."""
        if self.standby is None or self.failed_over:
            return False
        host, ports = self.standby
        log.warning("rank %d lost the job's store at %s:%d (%s); going over to its standby at %s", self.rank,
                    self.host, self.port, lost, host)
        try:
            self.port, self._sock, self._sealer = self._connect(host, ports, self._key, self._bind_to, self.rank,
                                                                FAILOVER_S)
        except dist.DistNetworkError as exc:
            log.warning("rank %d: the store's standby did not answer: %s", self.rank, exc)
            return False
        self.host, self.failed_over, self._sock_timeout = host, True, None
        return True

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
            while True:
                if self._sock is None:
                    raise dist.DistNetworkError(f"the job's store connection of rank {self.rank} is closed")
                try:
                    if wait_s != self._sock_timeout:  # a syscall or two: only when the deadline changes
                        self._sock.settimeout(wait_s + ANSWER_MARGIN_S)
                        self._sock_timeout = wait_s
                    self._sock.sendall(self._sealer.seal(w.request(op, int(wait_s * 1000), items)))
                    if meanwhile is not None:
                        once, meanwhile = meanwhile, None  # not again if the request is sent again
                        try:
                            once()
                        except Exception as exc:  # noqa: BLE001 - raised once the answer is in
                            failed = exc
                    head = _recv_exact(self._sock, w.LEN_SIZE)
                    n = w.frame_length(head)
                    if n > w.MAX_FRAME:
                        raise ConnectionError(f"the job's store sent a frame of {n} bytes")
                    payload = self._sealer.open(_recv_exact(self._sock, n))
                    break
                except OSError as exc:
                    self._close_locked()
                    if not isinstance(exc, socket.timeout) and self._fail_over(exc):
                        continue  # the same request, to the standby (an add carries its token: counted once)
                    raise dist.DistNetworkError(f"lost the job's store at {self.host}:{self.port}: "
                                                f"{type(exc).__name__}: {exc}") from exc
                except BaseException:  # interrupted between a request and its answer: the next call would read
                    self._close_locked()  # this one's answer (a signal's exception, say): the connection ends here
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
        # A token of its own: sent again to a standby that already applied it, it is not counted twice.
        return int(self._call(w.ADD, [_b(key), str(int(value)).encode(), secrets.token_bytes(12)])[0])

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
