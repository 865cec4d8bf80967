"""The training state's digest: one SHA-256 that names a training state.

``final_state_digest`` covers the full (unsharded) parameters and optimizer state, the committed
frontier and epoch, every rank's ``Stateful`` states (scheduler, data loader, the user's own),
every rank's RNG states and every rank's persistent buffers (batch-norm running statistics differ per rank)
(``final_model_digest``: the same without the per-rank parts).  Two runs
that end in the same training state print the same digest, whatever happened on the way (repairs, restarts) and whatever the wrapping (FSDP1 on the mesh or
the group pair, FSDP2): it hashes each full tensor, not the shards.

No process ever holds the whole model, and no rank copies its own state: the tensors come from the snapshot's
capture plan (:func:`ckpt_service.capture.plan_for`: views of the live shards; FSDP1 builds no state dict), walked
tensor by tensor; for each one, the ranks of node 0 (which together hold a complete copy) send their boxes to rank
0, which assembles that one tensor, hashes it and drops it before the next.  (A state dict of FSDP1's optimizer
copies every shard: at the job's end that was the job's memory peak.)

Who calls: every rank, at the end of the job (node 0's ranks take part in one gather per tensor);
rank 0 gets the digest, the others ``None``.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from accelpact_slurm.core.torch_warnings import quiet_state_dict_calls
from accelpact_slurm.runtime.state import appstate
from ckpt_service.capture import Plan, plan_for

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
    plan = plan_for(model, optimizer)  # views of the live shards (FSDP1: no collective, no copy)
    ranks = rt.control.all_gather("digest-rank", rank_fingerprint(statefuls, forward))
    if rt.node != 0:
        return None, None
    tensors, plain = _named(plan)
    # Node 0's ranks together hold every tensor; a rank holds no optimizer state for a parameter wholly on its
    # node peer, so the names are the node's union, in one order every rank of it computes alike.
    meta: list[Any] = [None] * rt.layout.ranks_per_node
    dist.all_gather_object(meta, ({n: (s, str(d)) for n, (s, d, _b) in tensors.items()}, sorted(plain)),
                           group=rt.shard_group)
    shapes: dict[tuple[str, ...], tuple[list[int], str]] = {}
    owner: dict[tuple[str, ...], int] = {}  # a plain value's first holder on the node
    for i, (their_tensors, their_plain) in enumerate(meta):
        for n, sd in their_tensors.items():
            shapes.setdefault(n, sd)
        for n in their_plain:
            owner.setdefault(tuple(n), i)
    # rank 0 hashes the plain values (the same on every rank that has one); one it lacks comes from its first holder
    me = dist.get_rank(rt.shard_group)
    lent: list[Any] = [None] * rt.layout.ranks_per_node if rt.rank == 0 else None
    dist.gather_object({n: plain[n] for n, i in owner.items() if i == me and i != 0}, lent, dst=0,
                       group=rt.shard_group)
    values = dict(plain)
    for part in lent or ():
        values.update(part)
    h = hashlib.sha256() if rt.rank == 0 else None
    for name in sorted(set(shapes) | set(owner), key=_order):
        label = _label(name)
        if name not in shapes:  # a plain value (a step counter, a buffer)
            if h is not None:
                _update_tensor(h, label, values[name])
            continue
        boxes = tensors[name][2] if name in tensors else []
        mine = [(offsets, t.detach().to("cpu").contiguous()) for offsets, t in boxes]
        got: list[Any] = [None] * rt.layout.ranks_per_node if rt.rank == 0 else None
        dist.gather_object(mine, got, dst=0, group=rt.shard_group)
        if h is not None:
            shape, dtype = shapes[name]
            full = torch.empty(tuple(shape), dtype=getattr(torch, dtype.removeprefix("torch.")))
            for part in got:
                for offsets, t in part:
                    full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))].copy_(t)
            _update_tensor(h, label, full)
            del full
    if h is None:
        return None, None
    h.update(f"frontier:{step};epoch:{epoch}".encode())
    model_digest = h.hexdigest()
    for r, fp in enumerate(ranks):
        h.update(f"rank:{r}:{fp['rng']}:{fp['state']}".encode())
        if "buffers" in fp:
            h.update(f"rank:{r}:buffers:{fp['buffers']}".encode())
    return h.hexdigest(), model_digest


def _named(plan: Plan) -> tuple[dict[tuple[str, ...], tuple[list[int], torch.dtype, list[tuple[list[int], torch.Tensor]]]],
                                dict[tuple[str, ...], Any]]:
    """The plan's tensors (``name: (shape, dtype, [(offsets, this rank's box)])``) and plain values, named
    ``("param", fqn)`` or ``("optim", fqn, key)`` as the state dict names them."""
    tensors = {}
    for e in plan.entries:
        boxes = [(list(b.offsets), b.src.reshape(b.sizes)) for b in e.boxes if b.src is not None and b.src.numel()]
        tensors[_name(e.key)] = (list(e.shape), e.dtype, boxes)
    plain: dict[tuple[str, ...], Any] = {("param", fqn): v for fqn, v in plan.plain.get("model", {}).items()}
    for fqn, per in plan.plain.get("optim", {}).get("state", {}).items():
        for k, v in per.items():
            plain[("optim", fqn, k)] = v
    return tensors, plain


def _name(key: tuple[str, ...]) -> tuple[str, ...]:
    if key[0] == "model" and len(key) == 2:
        return ("param", key[1])
    if key[:2] == ("optim", "state") and len(key) == 4:
        return ("optim", key[2], key[3])
    raise ValueError(f"{'.'.join(key)}: a sharded tensor where the state dict has none")


def _order(name: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
    """Every parameter and buffer by name, then the optimizer's state by parameter and key."""
    return (0 if name[0] == "param" else 1, name[1:])


def _label(name: tuple[str, ...]) -> str:
    return f"param:{name[1]}" if name[0] == "param" else f"optim:{name[1]}:{name[2]}"
