"""A rank's application state (S_app) as the checkpoint service sees it.

The tensors (weights, AdamW state) are captured by :mod:`ckpt_service.capture` (this rank's boxes,
copied into shared memory).  This module holds the rest of a snapshot and the load path:
:func:`extra_state` (the non-tensor state every rank shares at a committed boundary, plus every
rank's RNG), :func:`extra_to_dcp` (how that is stored beside the tensors) and :func:`load`
(collective: restores a Trainer from a DCP snapshot directory with stock ``dcp.load`` into the
sharded state dict and ``set_state_dict``, then the extra state: RNG, cursor, frontier, losses,
scheduler).
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

EXTRA = "extra"


def rng_b64() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


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
