"""The reference job, written against the public API only: a causal decoder, FSDP HSDP, AdamW, warm-up + cosine.

``accelpact-run examples/decoder/job.yaml`` calls :func:`main` on every rank with the :class:`Job`.
The job file's ``params`` section holds this example's own settings (model shape, FSDP flavour,
optimiser); the project's sections (topology, checkpoint, timeouts, recovery, faults) are the
project's business.
"""

from __future__ import annotations

import math

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from accelpact_slurm import Job
from decoder_model import Block, TokenStream, build_model, lm_loss

SHAPE = ("layers", "width", "heads", "vocab", "seq_len", "dropout")


def wrap(model: torch.nn.Module, job: Job, fsdp: str, mesh: str) -> torch.nn.Module:
    """FSDP1 ``HYBRID_SHARD`` on the job's mesh or its explicit group pair, or FSDP2 ``fully_shard``."""
    if fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=job.mesh)
        return fully_shard(model, mesh=job.mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    where = {"device_mesh": job.mesh} if mesh == "device_mesh" else {"process_group": job.groups}
    return FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=ModuleWrapPolicy({Block}),
                use_orig_params=True, device_id=job.device, **where)


def schedule(steps: int, warmup: int, floor: float):
    """Linear warm-up then cosine decay to ``floor`` (a multiplier of the learning rate)."""
    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def main(job: Job) -> None:
    p = job.params
    model = wrap(build_model(job.seed, **{k: p[k] for k in SHAPE}).to(job.device), job, p.get("fsdp", "fsdp1"),
                 p.get("mesh", "device_mesh"))
    beta1, beta2 = p.get("betas", (0.9, 0.95))
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=(beta1, beta2), weight_decay=p["weight_decay"],
                            foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(job.steps, p["warmup_steps"], p["min_lr"] / p["lr"]))
    data = TokenStream(p["vocab"], p["seq_len"], job.seed, p["sequences"])
    loader = StatefulDataLoader(data, batch_size=p["batch_per_rank"], sampler=job.sampler(data, shuffle=False))
    run = job.protect(model, opt, scheduler=sched, state={"data": loader})
    for tokens in run.batches(loader):
        with run.update() as update:
            loss = lm_loss(model, tokens.to(job.device))
            loss.backward()
            update.loss = loss  # before the step: it travels in the update's vote
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
