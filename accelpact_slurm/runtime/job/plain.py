"""The plain job: what the package's ``init()`` returns outside a job, so that one script runs both ways.

Started by plain ``torchrun`` (or a single ``python``), a script written against the public API still runs, with
the same calls, but unprotected: no repair, no snapshots, no vote.  :class:`PlainJob` joins the world torchrun
describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``; a world of one
without them), builds the same 2-D mesh (``("replicate", "shard")``: nodes x ranks of a node) and hands out the
same names as the protected Job; :class:`PlainRun` counts updates and stops :meth:`PlainRun.batches` after
``steps``.  Rank 0 says once that the run is unprotected.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from accelpact_slurm.core.config import JobConfig
from accelpact_slurm.core.errors import UsageError
from accelpact_slurm.runtime.state import appstate
from accelpact_slurm.runtime.state.sampler import ShardedSampler

_job: "PlainJob | None" = None


def plain_job(asked: Mapping[str, int]) -> "PlainJob":
    """This process's plain job (one per process: a second call returns it, with the same values)."""
    global _job
    if _job is None:
        _job = PlainJob(steps=asked.get("steps", JobConfig.steps), seed=asked.get("seed", JobConfig.seed))
        return _job
    for key, value in asked.items():
        if getattr(_job, key) != value:
            raise UsageError("accelpact_slurm.init", f"{key}={value}",
                             f"a first call had {key}={getattr(_job, key)}: call it once, with the script's values")
    return _job


class PlainJob:
    """The protected Job's names, on the world torchrun started; :meth:`protect` returns a :class:`PlainRun`."""

    def __init__(self, *, steps: int, seed: int) -> None:
        env = os.environ
        cuda = torch.cuda.is_available() and "LOCAL_RANK" in env
        if not dist.is_initialized():
            if "WORLD_SIZE" in env:  # torchrun's env:// rendezvous
                dist.init_process_group("nccl" if cuda else "gloo")
            else:  # a single python: a world of one
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.ranks_per_node = int(env.get("LOCAL_WORLD_SIZE", self.world_size))
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            self.ranks_per_node = self.world_size
        self.local_rank = int(env.get("LOCAL_RANK", self.rank % self.ranks_per_node))
        self.num_nodes, self.node = self.world_size // self.ranks_per_node, self.rank // self.ranks_per_node
        self.device = torch.device(f"cuda:{self.local_rank}" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self._mesh: Any = None
        self.steps, self.seed = steps, seed
        self.config: JobConfig | None = None
        self.params: dict[str, Any] = {}
        self.run_dir: str | None = None
        self.run: PlainRun | None = None
        if self.rank == 0:
            print("[accelpact] not started by accelpact-run: training unprotected (no repair, no snapshots); "
                  "start it with accelpact-run [flags] SCRIPT.py [its args]", file=sys.stderr, flush=True)

    @property
    def mesh(self) -> Any:
        """The 2-D ``DeviceMesh`` ``("replicate", "shard")``, built at its first use (a script that builds its own
        makes no second one)."""
        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.num_nodes, self.ranks_per_node),
                                          mesh_dim_names=("replicate", "shard"))
        return self._mesh

    @property
    def groups(self) -> tuple[Any, Any]:
        return self.mesh.get_group("shard"), self.mesh.get_group("replicate")

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    def log(self, message: str) -> None:
        if self.is_lead:
            print(f"[accelpact] {message}", flush=True)

    def on_stop(self, hook: Callable[[Any], Any]) -> None:
        """Nothing stops a plain job's rank but the script itself: the hook is never called."""

    def sampler(self, dataset: Any, *, shuffle: bool = True, seed: int | None = None,
                drop_last: bool = True) -> ShardedSampler:
        return ShardedSampler(dataset, rank=self.rank, world_size=self.world_size, shuffle=shuffle,
                              seed=self.seed if seed is None else seed, drop_last=drop_last)

    def protect(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                state: Mapping[str, Any] | None = None, exact: bool = True) -> "PlainRun":
        """Seed every rank's generators as the protected job does; nothing is guarded."""
        if self.run is not None:
            raise UsageError("job.protect", "a second call", "call job.protect once per job, after wrapping")
        if exact:
            torch.use_deterministic_algorithms(True)
        appstate.seed_all(self.seed * 1000 + self.rank + 1)
        self.run = PlainRun(self)
        return self.run


class _Update:
    def __init__(self, step: int) -> None:
        self.step = step
        self.loss: Any = None


class PlainRun:
    """The loop's side of a plain job: ``batches`` until ``steps`` updates, ``update`` counts them."""

    def __init__(self, job: PlainJob) -> None:
        self.job = job
        self.step = 0
        self.epoch = 0
        self.losses: list[float] = []

    def batches(self, iterable: Iterable[Any]) -> Iterator[Any]:
        while self.step < self.job.steps:
            sampler = getattr(iterable, "sampler", None)
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(self.epoch)
            empty = True
            for item in iterable:
                empty = False
                yield item
                if self.step >= self.job.steps:
                    return
            if empty:
                raise UsageError("run.batches", type(iterable).__name__, "the data loader yielded no batch")
            self.epoch += 1

    @contextmanager
    def update(self) -> Iterator[_Update]:
        update = _Update(self.step + 1)
        yield update
        self.step += 1
        if update.loss is not None:
            loss = update.loss
            self.losses.append(float(loss.detach() if isinstance(loss, torch.Tensor) else loss))
            if self.job.is_lead and (self.step % 5 == 0 or self.step == self.job.steps):
                print(f"[accelpact] step {self.step:>5}/{self.job.steps}  loss {self.losses[-1]:.4f} "
                      f"(unprotected)", flush=True)

    def save(self) -> bool:
        """A plain job takes no snapshots."""
        return False
