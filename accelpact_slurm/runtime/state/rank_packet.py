"""A rank's per-rank state as one packet: what no replica holds, for the spare that takes a dead rank's place.

With HSDP every shard of the weights and optimizer state lives on one rank of every node, so a spare gets those
from a live replica (:mod:`accelpact_slurm.repair.heal_transfer`).  What lives nowhere else: the rank's RNG states
(torch CPU and, where present, CUDA; Python's ``random``; NumPy's global), its module buffers (batch-norm running
statistics differ per rank: each sees its own batches) and its data position (the loader's ``state_dict()`` or
whatever the caller passes).  :func:`pack_rank_state` takes them as they are at an update's vote (or its commit:
:mod:`.buddy_ring`); a buddy on another node keeps the packet (:class:`BuddyCopies`); the spare applies it
(:func:`apply_rank_state`) and packs itself again to show, in the heal's certificate, that it now holds exactly
what the buddy recorded.  :func:`with_states` replaces the ``Stateful`` states of a packet (the ones changed after
the vote), keeping the rest.

The packet, no pickle: ``MAGIC``, the header's length (8 bytes, big-endian), the header (JSON: rank, frontier,
the RNG states as :func:`~accelpact_slurm.runtime.state.appstate.rng_state` writes them, the data state as
:func:`~accelpact_slurm.runtime.state.appstate.encode` writes it, and each buffer's name, dtype, shape, offset and
length), then the buffers' raw bytes.  Its digest is the SHA-256 of all of it.  Packing the same state twice gives
the same bytes (sorted keys, buffers by name), which is what the certificate compares.

Who calls: every rank at each update's vote (pack, hand to the job's store: :mod:`.buddy_ring`); the buddy
(:meth:`BuddyCopies.keep`); the spare during a heal (:func:`apply_rank_state`, then :func:`pack_rank_state` for the
certificate).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from accelpact_slurm.core.errors import HealError
from accelpact_slurm.runtime.state import appstate
from accelpact_slurm.runtime.state.buffers import buffer_items

MAGIC = b"APRS1\n"
_LEN = 8
#: The largest header a reader accepts (RNG states are a few KB; a loader's state a few more).
MAX_HEADER = 16 << 20


@dataclass(frozen=True)
class RankPacket:
    """One rank's packed per-rank state at ``frontier`` (the bytes) and its digest."""

    rank: int
    frontier: int
    blob: bytes
    digest: str
    #: :func:`buffers_digest` of the model it was packed from ("" where not known: a packet read back).
    buffers: str = field(default="", compare=False)


def digest_of(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _buffer_bytes(model: torch.nn.Module) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Every persistent buffer's entry (name, dtype, shape, offset, length) and raw bytes, by name."""
    entries, chunks, offset = [], [], 0
    with torch.no_grad():
        for name, buf in buffer_items(model):
            t = _local(buf).detach().to("cpu").contiguous().reshape(-1)
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                            "shape": list(_local(buf).shape), "offset": offset, "nbytes": len(raw)})
            chunks.append(raw)
            offset += len(raw)
    return entries, chunks


def buffers_digest(model: torch.nn.Module) -> str:
    """The digest of this rank's persistent buffers as a packet holds them (whether they moved between two looks)."""
    return _buffers_digest(*_buffer_bytes(model))


def _buffers_digest(entries: list[dict[str, Any]], chunks: list[bytes]) -> str:
    h = hashlib.sha256(json.dumps(entries, sort_keys=True).encode())
    for raw in chunks:
        h.update(raw)
    return h.hexdigest()


def pack_rank_state(model: torch.nn.Module, *, rank: int, frontier: int,
                    data_state: Mapping[str, Any] | None = None, encoded_data: Any = None) -> RankPacket:
    """This rank's RNG states, persistent module buffers and ``data_state`` (the data position: a loader's
    ``state_dict()``, or any state dict of numbers, strings, lists, dicts and tensors) as one packet.
    ``encoded_data``: the data state already as :func:`~accelpact_slurm.runtime.state.appstate.encode` writes it
    (the caller encoded its parts once for its own use), in place of ``data_state``."""
    entries, chunks = _buffer_bytes(model)
    data = encoded_data if encoded_data is not None else appstate.encode(dict(data_state or {}), "data_state")
    header = {"format": "accelpact-rank-state/1", "rank": rank, "frontier": frontier, "rng": appstate.rng_state(),
              "data": data, "buffers": entries}
    return _assemble(rank, frontier, header, chunks, _buffers_digest(entries, chunks))


def _assemble(rank: int, frontier: int, header: dict[str, Any], chunks: list[Any], buffers: str = "") -> RankPacket:
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob = b"".join([MAGIC, len(head).to_bytes(_LEN, "big"), head, *chunks])
    return RankPacket(rank, frontier, blob, digest_of(blob), buffers)


# A packet's data state is ``{"run": ..., "state": {name: state_dict}}`` as appstate.encode writes a dict:
# ``{"__dict__": {"s:<key>": ...}}``; the three functions below are the only ones that read or write that form.
def encoded_states(data: Any) -> dict[str, Any]:
    """The encoded ``state_dict()`` of every ``Stateful`` in an encoded data state, by name (empty if none)."""
    try:
        held = data["__dict__"]["s:state"]["__dict__"]
    except (KeyError, TypeError):
        return {}
    return {k[2:]: v for k, v in held.items() if isinstance(k, str) and k.startswith("s:")}


def encoded_data_state(run: Mapping[str, Any], states: Mapping[str, Any]) -> Any:
    """The encoded data state ``{"run": run, "state": ...}`` from ``states`` already encoded (name -> encoded)."""
    data = appstate.encode({"run": dict(run)}, "data_state")
    data["__dict__"]["s:state"] = {"__dict__": {f"s:{n}": v for n, v in states.items()}}
    return data


def with_states(packet: RankPacket, states: Mapping[str, Any]) -> RankPacket:
    """``packet`` with the encoded states of some ``Stateful`` objects replaced (name -> encoded
    ``state_dict()``): the same RNG states, buffers and position, a new digest.  :class:`HealError` when the
    packet is malformed or holds no such ``Stateful``."""
    header, payload = read_packet(packet.blob, expect_digest=packet.digest)
    held = encoded_states(header.get("data"))
    unknown = sorted(set(states) - set(held))
    if unknown:
        raise HealError(f"rank {packet.rank}'s packet holds no state {', '.join(map(repr, unknown))}")
    if not states:
        return packet
    header["data"]["__dict__"]["s:state"] = {"__dict__": {f"s:{n}": v for n, v in {**held, **states}.items()}}
    return _assemble(packet.rank, packet.frontier, header, [payload])


def read_packet(blob: bytes, *, expect_digest: str | None = None) -> tuple[dict[str, Any], memoryview]:
    """``(header, payload)`` of a packet; :class:`HealError` when it is malformed or its digest is not
    ``expect_digest``.  The digest is checked before anything of the packet is parsed."""
    if expect_digest is not None and digest_of(blob) != expect_digest:
        raise HealError(f"the per-rank packet's digest {digest_of(blob)} is not the recorded {expect_digest}")
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + _LEN:
        raise HealError("not a per-rank packet (bad magic)")
    n = int.from_bytes(blob[len(MAGIC):len(MAGIC) + _LEN], "big")
    start = len(MAGIC) + _LEN
    if n > MAX_HEADER or start + n > len(blob):
        raise HealError(f"the per-rank packet's header length {n} is out of bounds")
    try:
        header = json.loads(blob[start:start + n])
    except ValueError as exc:
        raise HealError(f"the per-rank packet's header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != "accelpact-rank-state/1":
        raise HealError("the per-rank packet's header is not of format accelpact-rank-state/1")
    return header, memoryview(blob)[start + n:]


def apply_rank_state(model: torch.nn.Module, blob: bytes, *, rank: int, frontier: int,
                     expect_digest: str | None = None) -> dict[str, Any]:
    """Put a packet's RNG states and buffers in place on this rank (the spare taking ``rank``'s place); return
    its data state (decoded) for the caller's loader.  Every buffer is checked (name, dtype, shape) before any is
    written; a packet of another rank or frontier is refused (:class:`HealError`)."""
    header, payload = read_packet(blob, expect_digest=expect_digest)
    if header.get("rank") != rank or header.get("frontier") != frontier:
        raise HealError(f"the per-rank packet is rank {header.get('rank')}'s at update {header.get('frontier')}, "
                        f"not rank {rank}'s at update {frontier}")
    live = dict(buffer_items(model))
    plan = []
    problems = []
    for e in header["buffers"]:
        buf = live.get(e["name"])
        if buf is None:
            problems.append(f"{e['name']}: no such buffer here")
            continue
        local = _local(buf)
        dtype = str(local.dtype).removeprefix("torch.")
        if dtype != e["dtype"] or list(local.shape) != e["shape"] or e["offset"] + e["nbytes"] > len(payload):
            problems.append(f"{e['name']}: packed {e['dtype']}{e['shape']}, here {dtype}{list(local.shape)}")
            continue
        plan.append((local, e))
    missing = sorted(set(live) - {e["name"] for e in header["buffers"]})
    problems += [f"{n}: a buffer here, not in the packet" for n in missing]
    if problems:
        raise HealError("the per-rank packet does not fit this model: " + "; ".join(problems[:8]))
    with torch.no_grad():
        for local, e in plan:
            if e["nbytes"]:
                raw = torch.frombuffer(bytearray(payload[e["offset"]:e["offset"] + e["nbytes"]]), dtype=torch.uint8)
                local.copy_(raw.view(local.dtype).reshape(local.shape))
    appstate.set_rng_state(header["rng"])
    data = appstate.decode(header["data"])
    return data if isinstance(data, dict) else {}


class BuddyCopies:
    """The per-rank packets a buddy keeps for ranks of other nodes: the newest of each rank, in memory.

    :meth:`keep` is what the buddy calls when a packet arrives (the ring that sends them at each committed
    update is the runtime's); during a heal the buddy hands the dead rank's packet and its recorded digest to the
    spare (:meth:`latest`).  Thread-safe (the ring may deliver off the training thread).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._packets: dict[int, RankPacket] = {}

    def keep(self, rank: int, frontier: int, blob: bytes, digest: str) -> RankPacket:
        """Keep ``rank``'s packet at ``frontier`` after checking ``digest`` (the sender's) and the packet's own
        rank and frontier; an older frontier than the one kept is refused (:class:`HealError`)."""
        header, _ = read_packet(blob, expect_digest=digest)
        if header.get("rank") != rank or header.get("frontier") != frontier:
            raise HealError(f"a packet said to be rank {rank}'s at update {frontier} is rank "
                            f"{header.get('rank')}'s at update {header.get('frontier')}")
        packet = RankPacket(rank, frontier, bytes(blob), digest)
        with self._lock:
            held = self._packets.get(rank)
            if held is not None and held.frontier > frontier:
                raise HealError(f"rank {rank}'s packet at update {frontier} is older than the kept one "
                                f"({held.frontier})")
            self._packets[rank] = packet
        return packet

    def latest(self, rank: int) -> RankPacket | None:
        with self._lock:
            return self._packets.get(rank)
