"""A rank's application state (S_app) as the checkpoint service sees it.

:func:`capture` (collective: every rank, same step) returns this rank's local
shards of the weights and AdamW state plus the non-tensor state, detached from
training (cloned), in the nested layout of
``torch.distributed.checkpoint.state_dict.get_state_dict``: ``{"model": {fqn:
...}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
"param_groups": [...]}}``.  Every sharded tensor (a DTensor from a device mesh
or FSDP2, a ShardedTensor from FSDP1's group pair) becomes a *shard node*::

    {"__shard__": True, "global": [sizes], "chunks": [[offsets], tensor], ...]}

so the daemon can reassemble the node's full tensors without torch.distributed.

:func:`load` (collective) restores a Trainer from a DCP snapshot directory with
stock ``dcp.load`` into the sharded state dict and ``set_state_dict``, then the
extra state (RNG, cursor, frontier, losses, scheduler).
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger(__name__)

SHARD = "__shard__"
EXTRA = "extra"


def _local_chunks(value: Any) -> list[tuple[list[int], torch.Tensor]] | None:
    """``[(global offsets, local tensor)]`` for a sharded tensor, ``None`` for anything else."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        DTensor = ()  # type: ignore[assignment]
    if DTensor and isinstance(value, DTensor):
        chunks = value.__create_chunk_list__()
        local = value.to_local()
        if not chunks:
            return []
        return [(list(chunks[0].offsets), local.detach().clone())]
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
    return None


def _detach(value: Any) -> Any:
    chunks = _local_chunks(value)
    if chunks is not None:
        return {SHARD: True, "global": list(value.shape), "chunks": [[o, t] for o, t in chunks]}
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_detach(v) for v in value]
        return out if isinstance(value, list) else tuple(out)
    return value


def rng_b64() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def capture(trainer: Any) -> dict[str, Any]:
    """Collective: this rank's detached shards in the nested ``get_state_dict`` layout."""
    msd, osd = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": _detach(msd), "optim": _detach(osd)}


def extra_state(trainer: Any, rngs: list[str]) -> dict[str, Any]:
    """The non-tensor state every rank shares at a committed boundary, plus every rank's RNG (base64)."""
    p = trainer.progress
    return {"step": p.step, "cursor": p.cursor, "losses": list(p.losses),
            "scheduler": trainer.scheduler.state_dict(), "rng": {str(r): s for r, s in enumerate(rngs)}}


def extra_to_dcp(extra: dict[str, Any]) -> dict[str, Any]:
    """The ``extra`` entry of the saved state dict: a JSON string and one uint8 RNG tensor per rank."""
    rng = {r: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()
           for r, s in extra["rng"].items()}
    meta = {k: v for k, v in extra.items() if k != "rng"}
    return {"json": json.dumps(meta), "rng": rng}


def load(trainer: Any, path: str, rank: int) -> dict[str, Any]:
    """Collective: restore ``trainer`` from the DCP directory ``path``; return the extra state."""
    msd, osd = get_state_dict(trainer.model, trainer.optimizer)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    probe = torch.get_rng_state()
    ex = {EXTRA: {"json": "", "rng": {str(rank): torch.empty_like(probe)}}}
    dcp.load(ex, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    meta = json.loads(ex[EXTRA]["json"])
    p = trainer.progress
    p.step, p.cursor, p.losses = int(meta["step"]), int(meta["cursor"]), [float(x) for x in meta["losses"]]
    trainer.scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(ex[EXTRA]["rng"][str(rank)])
    return meta
