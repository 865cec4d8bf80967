"""Where the job's store listens, and who a peer is: the first free candidate port (:func:`listen`), and a peer's user
on this node (:func:`describe_peer`, for the store's warnings).  Torch-free; split off :mod:`.store_server`.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import pwd
import socket
from typing import Iterable

log = logging.getLogger("accelpact_slurm.runtime.transport.store_server")

def listen(host: str, candidates: Iterable[int], *, reached_from_other_hosts: bool = False, backlog: int = 1024
           ) -> tuple[socket.socket, list[int]]:
    """A listening socket on ``host`` at the first candidate port free to bind; the ports found taken beside it
    (``backlog`` 0: bound only, listening later: a standby's port, which refuses every client until it serves).

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
        if backlog:
            sock.listen(backlog)
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
