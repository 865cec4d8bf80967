"""The heal's wire: framed bytes between two members of a process group, point to point, no pickle.

A frame is an int64 length then that many bytes (a uint8 tensor), each a ``send``/``recv`` of the group (Gloo
supports both).  The receiver refuses a length above its limit before it allocates anything: a peer that
sends a huge length gets an error, not an allocation.  Every call blocks at most the group's own timeout
(the heal builds its groups with the job's collective timeout).

Who calls: :mod:`accelpact_slurm.repair.heal_transfer` (the manifest, the acknowledgement), the certificate
(:mod:`accelpact_slurm.repair.heal`) and the per-rank packet's hand-over, on the two ranks of one pair only.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from accelpact_slurm.core.errors import HealError

#: The largest frame a receiver accepts unless told otherwise (a manifest of a very large model is a few MB).
MAX_FRAME = 64 << 20


def send_tensor(pg: dist.ProcessGroup, peer: int, t: torch.Tensor, tag: int = 0) -> None:
    """Send ``t`` (contiguous, CPU for Gloo) to group rank ``peer``."""
    dist.send(t, group=pg, group_dst=peer, tag=tag)


def recv_tensor(pg: dist.ProcessGroup, peer: int, t: torch.Tensor, tag: int = 0) -> None:
    """Receive into ``t`` itself (in place) from group rank ``peer``."""
    dist.recv(t, group=pg, group_src=peer, tag=tag)


#: How many tensors of a stream are in flight at once (posted, not yet waited on): one ``send``/``recv`` round trip
#: per tensor is what a stream of small tensors costs otherwise.
WINDOW = 32


def _stream(post, pg: dist.ProcessGroup, peer: int, tensors: list[torch.Tensor], window: int) -> None:
    """Post one operation per tensor, at most ``window`` in flight, each under its own tag (1, 2, ...: frames use
    tag 0), and wait for all of them."""
    pending: list[dist.Work] = []
    for i, t in enumerate(tensors):
        if len(pending) >= window:
            pending.pop(0).wait()
        work = post(t, group=pg, **{"group_dst" if post is dist.isend else "group_src": peer}, tag=i + 1)
        assert work is not None
        pending.append(work)
    for work in pending:
        work.wait()


def send_tensors(pg: dist.ProcessGroup, peer: int, tensors: list[torch.Tensor], window: int = WINDOW) -> None:
    """Send every tensor of ``tensors`` (contiguous) to group rank ``peer``, in order, ``window`` in flight."""
    _stream(dist.isend, pg, peer, tensors, window)


def recv_tensors(pg: dist.ProcessGroup, peer: int, tensors: list[torch.Tensor], window: int = WINDOW) -> None:
    """Receive into every tensor of ``tensors`` itself (in place), from group rank ``peer``: the counterpart of
    :func:`send_tensors`."""
    _stream(dist.irecv, pg, peer, tensors, window)


def send_frame(pg: dist.ProcessGroup, peer: int, blob: bytes) -> None:
    """One frame: the length, then the bytes (nothing for an empty frame)."""
    send_tensor(pg, peer, torch.tensor([len(blob)], dtype=torch.int64))
    if blob:
        send_tensor(pg, peer, torch.frombuffer(bytearray(blob), dtype=torch.uint8))


def recv_frame(pg: dist.ProcessGroup, peer: int, limit: int = MAX_FRAME) -> bytes:
    """The next frame from ``peer``; :class:`HealError` for a length outside ``[0, limit]``."""
    n = torch.zeros(1, dtype=torch.int64)
    recv_tensor(pg, peer, n)
    size = int(n.item())
    if not 0 <= size <= limit:
        raise HealError(f"group rank {peer} announced a frame of {size} bytes (the limit is {limit}): refused")
    if size == 0:
        return b""
    buf = torch.empty(size, dtype=torch.uint8)
    recv_tensor(pg, peer, buf)
    return buf.numpy().tobytes()


def _encode(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _decode(blob: bytes, peer: int) -> Any:
    try:
        return json.loads(blob)
    except ValueError as exc:
        raise HealError(f"group rank {peer} sent a frame that is not JSON: {exc}") from exc


def send_json(pg: dist.ProcessGroup, peer: int, doc: Any) -> None:
    send_frame(pg, peer, _encode(doc))


def recv_json(pg: dist.ProcessGroup, peer: int, limit: int = MAX_FRAME) -> Any:
    return _decode(recv_frame(pg, peer, limit), peer)


def exchange_json(pg: dist.ProcessGroup, me: int, peer: int, doc: Any, limit: int = MAX_FRAME) -> Any:
    """:func:`exchange_frame` of a JSON document."""
    return _decode(exchange_frame(pg, me, peer, _encode(doc), limit), peer)


def exchange_frame(pg: dist.ProcessGroup, me: int, peer: int, blob: bytes, limit: int = MAX_FRAME) -> bytes:
    """Send ``blob`` to ``peer`` and receive its frame; the lower group rank sends first (no two sends facing each
    other, which Gloo may not complete for frames larger than the socket's buffers)."""
    if me < peer:
        send_frame(pg, peer, blob)
        return recv_frame(pg, peer, limit)
    got = recv_frame(pg, peer, limit)
    send_frame(pg, peer, blob)
    return got
