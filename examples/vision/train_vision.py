"""Second example user job: a small CNN classifier on synthetic images, HSDP on the job's mesh.

``accelpact-run`` calls :func:`main` on every rank with a ``Job`` built from
``job.yaml`` (the ``entry: train_vision:main`` line).  The script is written only
against the public API: it builds and shards the model, hands model, optimizer,
scheduler and data cursor to ``job.protect`` and runs one ``run.update()`` per
optimizer update, with gradient accumulation over ``params.accumulate``
micro-batches and gradient-norm clipping.  Phases, the fault vote, commits,
snapshots and RNG states are the project's business.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from accelpact_slurm import Job
from bn_models import MODELS as BN_MODELS, build as build_bn_model, wrap_unit
from vision_model import ConvBlock, SyntheticImages, VisionNet


class Grouped:
    """Groups a stateful loader's batches into lists of ``k`` consecutive micro-batches.

    One group is one optimizer update.  A trailing group shorter than ``k`` at the
    end of an epoch is dropped.  The resumable state is the loader's own: after
    ``load_state_dict`` the next iteration continues at the next unread batch.

    Args:
        loader: A ``StatefulDataLoader`` (anything with ``state_dict``/``load_state_dict``).
        k: Micro-batches per group.
    """

    def __init__(self, loader: StatefulDataLoader, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.loader = loader
        self.k = k

    @property
    def sampler(self) -> Any:
        """The loader's sampler, so that epoch handling (``set_epoch``) reaches it."""
        return self.loader.sampler

    def __len__(self) -> int:
        return len(self.loader) // self.k

    def __iter__(self) -> Iterator[list[Any]]:
        batches = iter(self.loader)
        while True:
            group = list(itertools.islice(batches, self.k))
            if len(group) < self.k:
                return
            yield group

    def state_dict(self) -> dict[str, Any]:
        """The loader's state (its position in the current epoch, sampler included)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loader's state; the next ``iter()`` resumes from it."""
        self.loader.load_state_dict(state)


def build_model(p: dict[str, Any], seed: int) -> nn.Module:
    """``params.model``: ``vision`` (:class:`VisionNet`, the default) or one of the batch-norm models shaped like
    torchvision's (``mobilenet``, ``resnet``: :mod:`bn_models`), ``params.channels`` wide."""
    kind = p.get("model", "vision")
    if kind == "vision":
        return VisionNet(classes=p["classes"], channels=p["channels"], dropout=p.get("dropout", 0.1), seed=seed,
                         norm=p.get("norm", "group"))
    if kind in BN_MODELS:
        return build_bn_model(kind, classes=p["classes"], width=p["channels"], dropout=p.get("dropout", 0.1),
                              seed=seed)
    raise ValueError(f"params.model must be vision, {' or '.join(BN_MODELS)}, got {kind!r}")


def shard(model: nn.Module, job: Job, flavour: str) -> nn.Module:
    """Wrap ``model`` for HSDP on ``job.mesh``: every wrap unit (:class:`ConvBlock`, or the batch-norm model's
    block) is its own unit.

    Args:
        model: The unwrapped model, already on ``job.device``.
        job: The running job (for ``mesh`` and ``device``).
        flavour: ``"fsdp2"`` (``fully_shard``) or ``"fsdp1"`` (``FullyShardedDataParallel``).

    Returns:
        The wrapped model (the same object for FSDP2).
    """
    bf16 = job.params.get("precision", "fp32") == "bf16"  # compute in bf16, keep fp32 weights, reduce in fp32
    unit = ConvBlock if isinstance(model, VisionNet) else wrap_unit(model)
    if flavour == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
        for block in [m for m in model.modules() if isinstance(m, unit)]:
            fully_shard(block, mesh=job.mesh, **mp)
        fully_shard(model, mesh=job.mesh, **mp)
        return model
    if flavour == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
        return FullyShardedDataParallel(
            model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=ModuleWrapPolicy({unit}),
            use_orig_params=True, device_id=job.device, device_mesh=job.mesh, **mp)
    raise ValueError(f"params.fsdp must be fsdp1 or fsdp2, got {flavour!r}")


def clipper(model: nn.Module, flavour: str, max_norm: float) -> Callable[[], torch.Tensor]:
    """A function clipping the global gradient norm of the (sharded) model to ``max_norm``.

    FSDP1 needs its own ``model.clip_grad_norm_`` (flat, sharded gradients); with
    FSDP2 the gradients are DTensors and ``torch.nn.utils.clip_grad_norm_`` works.

    Args:
        model: The wrapped model.
        flavour: ``"fsdp1"`` or ``"fsdp2"``.
        max_norm: The clipping threshold.

    Returns:
        A no-argument callable returning the total norm before clipping.
    """
    if flavour == "fsdp1":
        return lambda: model.clip_grad_norm_(max_norm)
    return lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def main(job: Job) -> None:
    """Train the classifier for ``job.steps`` updates, resuming from a snapshot if there is one.

    Args:
        job: The running job, built by ``accelpact-run`` from ``job.yaml``.
    """
    p = job.params
    flavour = p.get("fsdp", "fsdp2")
    k = int(p.get("accumulate", 1))

    model = build_model(p, job.seed).to(job.device)
    size = sum(t.numel() for t in model.parameters())
    model = shard(model, job, flavour)
    opt = torch.optim.SGD(model.parameters(), lr=p["lr"], momentum=p["momentum"], foreach=False)
    # cycle_momentum=False: keep params.momentum fixed instead of OneCycle's 0.85..0.95 cycle.
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=p["lr"], total_steps=job.steps, cycle_momentum=False)

    data = SyntheticImages(p["images"], image_size=p["image_size"], classes=p["classes"], seed=job.seed)
    loader = StatefulDataLoader(data, batch_size=p["batch_size"], sampler=job.sampler(data, shuffle=True),
                                num_workers=0)
    grouped = Grouped(loader, k)
    run = job.protect(model, opt, scheduler=sched, state={"data": grouped})
    clip = clipper(model, flavour, float(p["clip"]))
    job.log(f"vision: {p.get('model', 'vision')}, {size} parameters, {flavour}, {job.num_nodes}x{job.ranks_per_node} ranks, "
            f"{k} x {p['batch_size']} images per rank per update, {len(grouped)} updates per epoch")

    model.train()
    for group in run.batches(grouped):
        with run.update() as u:
            total = torch.zeros((), device=job.device)
            for images, labels in group:
                images, labels = images.to(job.device), labels.to(job.device)
                loss = F.cross_entropy(model(images).float(), labels)
                (loss / k).backward()
                total += loss.detach()
            clip()
            u.loss = total / k  # before the step: it travels in the update's vote
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    job.log(f"vision: finished {job.steps} updates")
