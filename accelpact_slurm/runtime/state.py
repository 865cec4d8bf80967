"""The training state's digest: one SHA-256 that names a training state.

``final_state_digest`` covers the full unsharded parameters, both AdamW moments,
the optimizer step counter, the data cursor, the committed frontier and every
rank's RNG state.  Two runs that end in the same training state print the same
digest, whatever happened on the way (repairs, restarts).

Who calls: every rank (the unsharding is collective); rank 0 gets the digest,
the others ``None``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from accelpact_slurm.workload.trainer import Trainer


def rng_fingerprint() -> str:
    """SHA-256 of this rank's CPU RNG state (and CUDA's where present)."""
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        for s in torch.cuda.get_rng_state_all():
            h.update(s.numpy().tobytes())
    return h.hexdigest()


def _update_tensor(h: "hashlib._Hash", name: str, value: Any) -> None:
    h.update(name.encode())
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(value).encode())


def state_digest(trainer: Trainer) -> str | None:
    """Collective: return the digest on rank 0, ``None`` elsewhere."""
    rt = trainer.rt
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(trainer.model, trainer.optimizer, options=opts)
    rngs = rt.control.all_gather("digest-rng", rng_fingerprint())
    if rt.rank != 0:
        return None
    h = hashlib.sha256()
    for name in sorted(msd):
        _update_tensor(h, f"param:{name}", msd[name])
    for fqn in sorted(osd["state"]):
        for key in sorted(osd["state"][fqn]):
            _update_tensor(h, f"optim:{fqn}:{key}", osd["state"][fqn][key])
    p = trainer.progress
    h.update(f"frontier:{p.step};cursor:{p.cursor};sched:{trainer.scheduler.last_epoch}".encode())
    for r, fp in enumerate(rngs):
        h.update(f"rng:{r}:{fp}".encode())
    return h.hexdigest()
