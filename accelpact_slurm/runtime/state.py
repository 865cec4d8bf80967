"""The training state's digest: one SHA-256 that names a training state.

``final_state_digest`` covers the full unsharded parameters and optimizer state, the committed
frontier and epoch, every rank's ``Stateful`` states (scheduler, data loader, the user's own) and
every rank's RNG states.  Two runs that end in the same training state print the same digest,
whatever happened on the way (repairs, restarts).  It is a test oracle, computed once at the end.

Who calls: every rank (the unsharding is collective); rank 0 gets the digest, the others ``None``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from accelpact_slurm.runtime import appstate


def _update_tensor(h: "hashlib._Hash", name: str, value: Any) -> None:
    h.update(name.encode())
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(value).encode())


def rank_fingerprint(run: Any) -> dict[str, str]:
    """This rank's RNG and Stateful states, hashed."""
    rng = hashlib.sha256(json.dumps(appstate.rng_state(), sort_keys=True).encode()).hexdigest()
    states = {n: appstate.encode(o.state_dict(), n) for n, o in run.statefuls.items()}
    return {"rng": rng, "state": hashlib.sha256(json.dumps(states, sort_keys=True).encode()).hexdigest()}


def state_digest(run: Any) -> str | None:
    """Collective: return the digest on rank 0, ``None`` elsewhere."""
    rt = run.job._rt
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(run.model, run.optimizer, options=opts)
    ranks = rt.control.all_gather("digest-rank", rank_fingerprint(run))
    if rt.rank != 0:
        return None
    h = hashlib.sha256()
    for name in sorted(msd):
        _update_tensor(h, f"param:{name}", msd[name])
    for fqn in sorted(osd["state"]):
        for key in sorted(osd["state"][fqn]):
            _update_tensor(h, f"optim:{fqn}:{key}", osd["state"][fqn][key])
    h.update(f"frontier:{run.step};epoch:{run.epoch}".encode())
    for r, fp in enumerate(ranks):
        h.update(f"rank:{r}:{fp['rng']}:{fp['state']}".encode())
    return h.hexdigest()
