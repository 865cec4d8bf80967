"""Messages between ranks and their node's daemon: one JSON object per line over a Unix socket.

Each request is one connection: connect, send one line, read one line, close.  Requests (``op``): ``ping``; ``staged``
(a rank finished staging a step); ``status`` (the daemon's view); ``wait`` (block until a step reaches a final state,
with a timeout); ``shutdown``.  Replies carry ``ok`` and either the result or ``error``.  The daemon answers only
peers whose SO_PEERCRED uid is its own (the socket is also 0600 in a 0700 directory).
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

from accelpact_slurm.core.errors import CheckpointError

MAX_LINE = 1 << 20
#: The states a ``wait`` ends on: a step the daemon settled.
FINAL = ("verified", "rejected", "failed")


class DaemonUnavailable(CheckpointError, ConnectionError):
    """The node's daemon could not be reached or did not answer in time."""


class DaemonSilent(DaemonUnavailable, TimeoutError):
    """The node's daemon exists (its socket took the connection, or its queue of connections is full) but did not
    answer in time: stopped (SIGSTOP), stuck, or starved.  Not "no daemon": it may still answer, and read its
    slots, later."""


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (Linux SO_PEERCRED)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", raw)
    return uid


def peer_allowed(uid: int, own_uid: int | None = None) -> tuple[bool, str]:
    """Pure: only the job's user may talk to its daemon."""
    own = os.getuid() if own_uid is None else own_uid
    if uid == own:
        return True, "same user"
    return False, f"uid {uid} is not the job's user (uid {own})"


def send_line(conn: socket.socket, obj: Any) -> None:
    conn.sendall((json.dumps(obj, separators=(",", ":")) + "\n").encode())


def recv_line(conn: socket.socket) -> Any:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_LINE:
            raise CheckpointError("checkpoint daemon message too long")
    if not buf:
        raise ConnectionError("connection closed without a reply")
    return json.loads(buf)


def request(path: str, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One request/reply with the daemon at ``path``; raises :class:`DaemonUnavailable`."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(path)
            # The daemon checks the client's uid; the client checks the daemon's, so that a socket another
            # user planted at this path cannot answer a rank (e.g. report a snapshot verified).
            ok, why = peer_allowed(peer_uid(s))
            if not ok:
                raise DaemonUnavailable(f"checkpoint daemon at {path}: refusing its answer: {why}")
            send_line(s, message)
            reply = recv_line(s)
    except TimeoutError as exc:  # socket.timeout: connected (or queued) but no answer
        raise DaemonSilent(f"checkpoint daemon at {path}: no answer within {timeout_s:g} s") from exc
    except (OSError, ValueError) as exc:
        raise DaemonUnavailable(f"checkpoint daemon at {path}: {exc.__class__.__name__}: {exc}") from exc
    if not isinstance(reply, dict):
        raise DaemonUnavailable(f"checkpoint daemon at {path}: malformed reply")
    return reply
