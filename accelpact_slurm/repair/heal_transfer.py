"""The heal's transfer: a survivor's local shards sent to the spare that takes the dead rank's place, in place.

With HSDP, rank i of every node holds the same shard (weights and optimizer state), so rank i of a surviving
node (the *source*) has exactly what rank i of the dead node had.  Over the heal's replication group (two of its
members: the source and the spare), the source sends

1. a manifest: JSON naming every tensor (its name, local shape, dtype, number of elements), the optimizer's
   non-tensor state and hyper-parameters, the frontier (the committed update), the generation and both ranks,
   with an HMAC-SHA256 under the run's key (:func:`ckpt_service.auth.sign`);
2. after the spare's acknowledgement, every tensor's local bytes, one ``send`` each, in the manifest's order
   (a window of them in flight at once: :func:`accelpact_slurm.repair.heal_wire.send_tensors`).

The spare checks the manifest before it accepts any tensor: the MAC first (nothing of an unauthenticated
manifest is looked at), then the generation, the frontier, its own rank, and every name, shape and dtype against
its own tensors.  It answers accept or refuse (with the reason); on a refusal neither side moves a tensor and
both raise :class:`~accelpact_slurm.core.errors.HealRefused`.  Accepted tensors are received into the spare's own
tensors (the DTensors' local tensors of its parameters and optimizer state): no second copy of the model is
made.  Optimizer state that the spare has not created yet (an optimizer that never stepped) is allocated once,
from the manifest, as its parameter's layout (``zeros_like``) or as a plain tensor, then received into.  No
pickle anywhere: frames of JSON and raw tensor bytes (:mod:`accelpact_slurm.repair.heal_wire`).

Who calls: the source (:func:`send_shards`) and the spare (:func:`recv_shards`), each once per heal, after both
built the heal's groups (:mod:`accelpact_slurm.repair.heal`) and before the certificate.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from accelpact_slurm.core.errors import HealError, HealRefused
from accelpact_slurm.repair import heal_wire as wire
from ckpt_service.auth import authenticate, sign

FORMAT = "accelpact-heal-shards/1"
OPTIM = "optim."
#: Hyper-parameter values of a param group that travel (the rest, ``params`` above all, do not).
_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class Shard:
    """One tensor of a rank's shard: its name, the local tensor the bytes live in, and how to allocate it."""

    name: str
    tensor: torch.Tensor | None  # None: optimizer state the optimizer has not created yet
    like_param: bool = False  # optimizer state laid out as its parameter (a DTensor of the same spec)


@dataclass(frozen=True)
class TransferStats:
    """What one side of a transfer moved: the tensors' bytes and count, and the manifest's bytes; the seconds of
    the manifest's exchange (it includes waiting for the peer to come), of the tensors', and of both."""

    tensor_bytes: int
    tensors: int
    manifest_bytes: int
    manifest_seconds: float
    tensor_seconds: float

    @property
    def seconds(self) -> float:
        return self.manifest_seconds + self.tensor_seconds

    @property
    def rate_mb_s(self) -> float:
        """The tensors' rate (MB/s)."""
        return self.tensor_bytes / 1e6 / self.tensor_seconds if self.tensor_seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, float]:
        return {"tensor_bytes": self.tensor_bytes, "tensors": self.tensors, "manifest_bytes": self.manifest_bytes,
                "manifest_seconds": self.manifest_seconds, "tensor_seconds": self.tensor_seconds,
                "seconds": self.seconds, "rate_mb_s": self.rate_mb_s}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """``{id(parameter): name}`` of ``model``'s parameters."""
    return {id(p): name for name, p in model.named_parameters()}


def shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Shard]:
    """This rank's shard, in a fixed order: every parameter (``named_parameters``), then every optimizer state
    tensor (``optim.<param>.<key>``, parameters in the optimizer's order, keys sorted).  Local tensors only."""
    with torch.no_grad():
        out = [Shard(name, _local(p)) for name, p in model.named_parameters()]
        names = param_names(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for key in sorted(state):
                    v = state[key]
                    if isinstance(v, torch.Tensor):
                        out.append(Shard(f"{OPTIM}{names[id(p)]}.{key}", _local(v), isinstance(v, DTensor)))
    return out


def _scalars(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = param_names(model)
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, v in sorted(optimizer.state.get(p, {}).items()):
                if not isinstance(v, torch.Tensor):
                    if not isinstance(v, _SCALARS):
                        raise HealError(f"optimizer state {names[id(p)]}.{key} is a {type(v).__name__}: only "
                                        f"tensors, numbers, strings and None travel in a heal")
                    out[f"{OPTIM}{names[id(p)]}.{key}"] = v
    return out


def param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's hyper-parameters that are numbers, strings, None or tuples of numbers (as lists)."""
    out = []
    for group in optimizer.param_groups:
        doc: dict[str, Any] = {}
        for k, v in sorted(group.items()):
            if k == "params":
                continue
            if isinstance(v, _SCALARS) and not (isinstance(v, float) and v != v):
                doc[k] = v
            elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v):
                doc[k] = list(v)
        out.append(doc)
    return out


def describe(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, frontier: int, generation: int,
             source_rank: int, target_rank: int) -> dict[str, Any]:
    """The (unsigned) manifest of this rank's shard, for ``target_rank`` (pure but for reading the model)."""
    tensors = []
    for s in shards(model, optimizer):
        t = s.tensor
        assert t is not None
        tensors.append({"name": s.name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                        "numel": t.numel(), "like_param": s.like_param})
    return {"format": FORMAT, "frontier": frontier, "generation": generation, "source_rank": source_rank,
            "target_rank": target_rank, "tensors": tensors, "scalars": _scalars(model, optimizer),
            "param_groups": param_groups(optimizer)}


def signed_manifest(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, key: bytes, frontier: int,
                    generation: int, source_rank: int, target_rank: int) -> dict[str, Any]:
    """:func:`describe`, MAC'd under the run's ``key``."""
    return sign(describe(model, optimizer, frontier=frontier, generation=generation, source_rank=source_rank,
                         target_rank=target_rank), key)


def send_shards(pg: dist.ProcessGroup, peer: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                key: bytes, frontier: int, generation: int, source_rank: int, target_rank: int,
                manifest: dict[str, Any] | None = None) -> TransferStats:
    """The source's side: send the signed manifest to group rank ``peer``, wait for its answer, then every tensor.

    ``manifest`` replaces the one this builds (a test sends a tampered one).  Raises :class:`HealRefused` with the
    spare's reason when it refuses.
    """
    t0 = time.monotonic()
    doc = manifest if manifest is not None else signed_manifest(
        model, optimizer, key=key, frontier=frontier, generation=generation, source_rank=source_rank,
        target_rank=target_rank)
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    wire.send_frame(pg, peer, blob)
    answer = wire.recv_json(pg, peer, 1 << 16)
    t1 = time.monotonic()
    if not isinstance(answer, dict) or answer.get("accept") is not True:
        reason = answer.get("reason") if isinstance(answer, dict) else answer
        raise HealRefused(f"the spare (rank {target_rank}) refused the manifest: {reason}")
    with torch.no_grad():
        tensors = [s.tensor.contiguous() for s in shards(model, optimizer) if s.tensor is not None]
        wire.send_tensors(pg, peer, tensors)
    moved = sum(t.numel() * t.element_size() for t in tensors)
    return TransferStats(moved, len(tensors), len(blob), t1 - t0, time.monotonic() - t1)


def _receivers(model: torch.nn.Module, optimizer: torch.optim.Optimizer, manifest: dict[str, Any]) -> list[Shard]:
    """The spare's own shard in the manifest's order, with a ``None`` tensor for optimizer state still to be
    allocated (only where the manifest names state the optimizer has not created for that parameter yet)."""
    have = {s.name: s for s in shards(model, optimizer)}
    params = dict(model.named_parameters())
    out: list[Shard] = []
    for entry in manifest["tensors"]:
        name = entry["name"]
        if name in have:
            out.append(have[name])
            continue
        param, _, key = name.removeprefix(OPTIM).rpartition(".")
        if name.startswith(OPTIM) and param in params and key not in optimizer.state.get(params[param], {}):
            out.append(Shard(name, None, bool(entry.get("like_param"))))
    return out


def check_manifest(model: torch.nn.Module, optimizer: torch.optim.Optimizer, doc: Any, *, key: bytes,
                   frontier: int, generation: int, rank: int) -> tuple[list[Shard], list[str]]:
    """``(the spare's shards in the manifest's order, every problem)``: the MAC first, then the heal's identity
    (generation, frontier, target rank), then every tensor (name, shape, dtype)."""
    ok, why = authenticate(doc, key)
    if not ok:
        return [], [why]
    problems = []
    for field, want in (("format", FORMAT), ("generation", generation), ("frontier", frontier),
                        ("target_rank", rank)):
        if doc.get(field) != want:
            problems.append(f"{field} is {doc.get(field)!r}, this heal expects {want!r}")
    if problems:
        return [], problems
    mine = _receivers(model, optimizer, doc)
    entries = {e["name"]: e for e in doc["tensors"]}
    ours = {s.name for s in mine}
    problems += [f"{n}: sent, but this rank has no such tensor" for n in entries if n not in ours]
    problems += [f"{s.name}: this rank's tensor, not in the manifest"
                 for s in shards(model, optimizer) if s.name not in entries]
    params = dict(model.named_parameters())
    for s in mine:
        entry = entries[s.name]
        t = s.tensor
        if t is None and s.like_param:  # to be allocated as its parameter's local layout: that shape
            t = _local(params[s.name.removeprefix(OPTIM).rpartition(".")[0]])
        if t is None:  # to be allocated as a plain tensor, as described
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        if list(t.shape) != entry["shape"] or (s.tensor is not None and dtype != entry["dtype"]):
            problems.append(f"{s.name}: sent {entry['dtype']}{entry['shape']}, this rank holds {dtype}{list(t.shape)}")
        elif s.tensor is not None and not t.is_contiguous():
            problems.append(f"{s.name}: this rank's tensor is not contiguous (cannot be received in place)")
    return mine, problems


def _allocate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mine: list[Shard],
              doc: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors to receive into, allocating the optimizer state the manifest names and the optimizer lacks."""
    params = dict(model.named_parameters())
    entries = {e["name"]: e for e in doc["tensors"]}
    out = []
    for s in mine:
        if s.tensor is not None:
            out.append(s.tensor)
            continue
        pname, _, key = s.name.removeprefix(OPTIM).rpartition(".")
        p = params[pname]
        e = entries[s.name]
        dtype = getattr(torch, e["dtype"])
        with torch.no_grad():
            value = torch.zeros_like(p, dtype=dtype) if s.like_param else torch.zeros(e["shape"], dtype=dtype)
        optimizer.state[p][key] = value
        out.append(_local(value))
    return out


def _apply_scalars(model: torch.nn.Module, optimizer: torch.optim.Optimizer, doc: dict[str, Any]) -> None:
    params = dict(model.named_parameters())
    for name, v in doc.get("scalars", {}).items():
        pname, _, key = name.removeprefix(OPTIM).rpartition(".")
        optimizer.state[params[pname]][key] = v
    for group, sent in zip(optimizer.param_groups, doc.get("param_groups", [])):
        for k, v in sent.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


def recv_shards(pg: dist.ProcessGroup, peer: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                key: bytes, frontier: int, generation: int, rank: int,
                limit: int = wire.MAX_FRAME) -> TransferStats:
    """The spare's side: receive the manifest from group rank ``peer``, check it, answer, receive every tensor in
    place.  Raises :class:`HealRefused` (after telling the source) when the manifest is refused: then no tensor of
    this rank has been written."""
    t0 = time.monotonic()
    blob = wire.recv_frame(pg, peer, limit)
    mine: list[Shard] = []
    try:
        doc = json.loads(blob)
    except ValueError as exc:
        doc, problems = None, [f"the manifest is not JSON: {exc}"]
    else:
        mine, problems = check_manifest(model, optimizer, doc, key=key, frontier=frontier, generation=generation,
                                        rank=rank)
    if problems:
        reason = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        wire.send_json(pg, peer, {"accept": False, "reason": reason})
        raise HealRefused(f"refused the manifest from the source: {reason}")
    assert isinstance(doc, dict)
    targets = _allocate(model, optimizer, mine, doc)
    wire.send_json(pg, peer, {"accept": True})
    t1 = time.monotonic()
    with torch.no_grad():
        wire.recv_tensors(pg, peer, targets)
    moved = sum(t.numel() * t.element_size() for t in targets)
    _apply_scalars(model, optimizer, doc)
    return TransferStats(moved, len(targets), len(blob), t1 - t0, time.monotonic() - t1)


def tensor_digest(t: torch.Tensor) -> str:
    """An exact digest of a tensor's bytes, dtype and shape (BLAKE2b, 128 bits; cheap next to the transfer)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{str(t.dtype)}{list(t.shape)}".encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def shard_digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """``{name: digest}`` of this rank's shard (:func:`shards`), and of the optimizer's other state and
    hyper-parameters (``optim.scalars``)."""
    out = {}
    with torch.no_grad():
        for s in shards(model, optimizer):
            assert s.tensor is not None
            out[s.name] = tensor_digest(s.tensor)
    extra = json.dumps({"scalars": _scalars(model, optimizer), "param_groups": param_groups(optimizer)},
                       sort_keys=True).encode()
    out["optim.scalars"] = hashlib.blake2b(extra, digest_size=16).hexdigest()
    return out
