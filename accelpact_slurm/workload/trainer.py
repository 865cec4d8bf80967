"""The reference training loop: FSDP HSDP over the 2-D mesh, AdamW, LR schedule.

One :class:`Trainer` per rank.  It owns the application state the paper calls
S_app (sharded weights, both AdamW moments, the optimizer step counter, the RNG
states, the data cursor and the committed frontier) and exposes it for the
digest, the checkpoint client and the repair engine.

Training is deterministic: the same seed and topology give bitwise-equal states.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.runtime.topology import Runtime
from accelpact_slurm.workload.data import TokenStream
from accelpact_slurm.workload.model import Block, build_model

log = logging.getLogger(__name__)


def lr_lambda(cfg: JobConfig):
    """Linear warm-up then cosine decay to ``min_lr`` over ``steps`` (a multiplier of ``lr``)."""
    t = cfg.train
    floor = t.min_lr / t.lr

    def fn(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, cfg.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def wrap_fsdp(model: nn.Module, cfg: JobConfig, rt: Runtime) -> nn.Module:
    """Wrap with FSDP1 ``HYBRID_SHARD`` (mesh or group pair) or FSDP2 ``fully_shard`` on the 2-D mesh."""
    if cfg.model.fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=rt.mesh)
        fully_shard(model, mesh=rt.mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs: dict[str, Any] = dict(
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )
    if rt.mesh is not None:
        kwargs["device_mesh"] = rt.mesh
    else:
        kwargs["process_group"] = (rt.shard_group, rt.replicate_group)
    return FSDP(model, **kwargs)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@dataclass
class StepResult:
    step: int
    loss: float
    tokens: int


@dataclass
class Progress:
    """The non-tensor part of S_app, identical on every rank at a committed boundary."""

    step: int = 0  # committed frontier F: number of completed updates
    cursor: int = 0  # data cursor kappa: sequences consumed by the whole job
    losses: list[float] = field(default_factory=list)


class Trainer:
    """Builds the model, optimizer and scheduler for one rank and runs updates."""

    def __init__(self, cfg: JobConfig, rt: Runtime) -> None:
        self.cfg = cfg
        self.rt = rt
        torch.set_num_threads(cfg.train.threads_per_rank)
        # Per-rank RNG (dropout) from the job seed: reproducible, different on every rank.
        torch.manual_seed(cfg.seed * 1000 + rt.rank + 1)
        model = build_model(cfg.model, cfg.seed)
        self.model = wrap_fsdp(model, cfg, rt)
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, foreach=False
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.stream = TokenStream(cfg.model.vocab, cfg.model.seq_len, cfg.seed)
        self.progress = Progress()

    @property
    def tokens_per_update(self) -> int:
        return self.rt.layout.world_size * self.cfg.train.batch_per_rank * self.cfg.model.seq_len

    def batch(self) -> torch.Tensor:
        p, t = self.progress, self.cfg.train
        return self.stream.rank_batch(p.cursor, self.rt.rank, self.rt.layout.world_size, t.batch_per_rank)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def commit(self, loss: float) -> None:
        """Advance the frontier after ``optimizer.step`` returned on this rank."""
        p = self.progress
        p.step += 1
        p.cursor = TokenStream.advance(p.cursor, self.rt.layout.world_size, self.cfg.train.batch_per_rank)
        p.losses.append(loss)

    def eval_loss(self, tokens: torch.Tensor) -> float:
        """Loss without dropout and without touching any RNG (every rank must call it)."""
        self.model.eval()
        with torch.no_grad():
            return float(lm_loss(self.model, tokens))
