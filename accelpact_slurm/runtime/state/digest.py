"""The training state's digest: one SHA-256 that names a training state.

``final_state_digest`` covers the full (unsharded) parameters and optimizer state, the committed
frontier and epoch, every rank's ``Stateful`` states (scheduler, data loader, the user's own),
every rank's RNG states and every rank's persistent buffers (batch-norm running statistics differ per rank)
(``final_model_digest``: the same without the per-rank parts).  Two runs
that end in the same training state print the same digest, whatever happened on the way (repairs, restarts) and whatever the wrapping (FSDP1 on the mesh or
the group pair, FSDP2): it hashes each full tensor, not the shards.

No process ever holds the whole model: the sharded state dict is walked tensor by tensor; for each
one, the ranks of node 0 (which together hold a complete copy) send their chunks to rank 0, which
assembles that one tensor, hashes it and drops it before the next.

Who calls: every rank, at the end of the job (node 0's ranks take part in one gather per tensor);
rank 0 gets the digest, the others ``None``.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from accelpact_slurm.core.torch_warnings import quiet_state_dict_calls
from accelpact_slurm.runtime.state import appstate
from ckpt_service.capture import _local_chunks
import torch.distributed as dist

if TYPE_CHECKING:
    from accelpact_slurm.runtime.job.topology import Runtime


def _update_tensor(h: "hashlib._Hash", name: str, value: Any) -> None:
    h.update(name.encode())
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(value).encode())


def rank_fingerprint(statefuls: dict[str, Any], forward: Any) -> dict[str, str]:
    """This rank's RNG and Stateful states and its persistent buffers (batch-norm statistics differ per rank), hashed."""
    rng = hashlib.sha256(json.dumps(appstate.rng_state(), sort_keys=True).encode()).hexdigest()
    states = {n: appstate.encode(o.state_dict(), n) for n, o in statefuls.items()}
    out = {"rng": rng, "state": hashlib.sha256(json.dumps(states, sort_keys=True).encode()).hexdigest()}
    items = forward.digest_items()
    if items:
        h = hashlib.sha256()
        for name, buf in items:
            _update_tensor(h, f"buffer:{name}", buf)
        out["buffers"] = h.hexdigest()
    return out


@quiet_state_dict_calls()  # torch's deprecation noise on a group pair's ShardedTensors (shape, dtype), every rank
def state_digests(rt: Runtime, model: Any, optimizer: Any, statefuls: dict[str, Any], forward: Any, step: int,
                  epoch: int) -> tuple[str | None, str | None]:
    """Collective: ``(final_state_digest, final_model_digest)`` on rank 0, ``(None, None)`` elsewhere.

    The model digest covers the full parameters, the optimizer state, the frontier and the epoch, and
    nothing per rank: it names the same training state on any allocation (the number of nodes and of
    ranks per node changes the per-rank RNG and data loader states, not the model).
    """
    msd, osd = get_state_dict(model, optimizer)  # sharded: DTensor / ShardedTensor, nothing gathered
    ranks = rt.control.all_gather("digest-rank", rank_fingerprint(statefuls, forward))
    on_node0 = rt.node == 0
    h = hashlib.sha256() if rt.rank == 0 else None
    items = [(f"param:{n}", msd[n]) for n in sorted(msd)]
    items += [(f"optim:{f}:{k}", osd["state"][f][k]) for f in sorted(osd["state"]) for k in sorted(osd["state"][f])]
    for name, value in items:
        chunks = _local_chunks(value)
        if chunks is None:  # a plain value (a step counter): the same on every rank
            if h is not None:
                _update_tensor(h, name, value)
            continue
        if not on_node0:
            continue
        mine = [(list(o), t.detach().to("cpu").contiguous()) for o, t in chunks if t.numel()]
        got: list[Any] = [None] * rt.layout.ranks_per_node if rt.rank == 0 else None
        dist.gather_object(mine, got, dst=0, group=rt.shard_group)
        if h is not None:
            full = torch.empty(tuple(value.shape), dtype=value.dtype)
            for part in got:
                for offsets, t in part:
                    full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))].copy_(t)
            _update_tensor(h, name, full)
            del full
    if h is None:
        return None, None
    h.update(f"frontier:{step};epoch:{epoch}".encode())
    model = h.hexdigest()
    for r, fp in enumerate(ranks):
        h.update(f"rank:{r}:{fp['rng']}:{fp['state']}".encode())
        if "buffers" in fp:
            h.update(f"rank:{r}:buffers:{fp['buffers']}".encode())
    return h.hexdigest(), model
