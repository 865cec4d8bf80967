"""``job.sampler(dataset)``: a deterministic, resumable, distributed sampler for map-style data sets.

Every rank of the world reads a disjoint share (data parallelism spans both mesh dimensions): epoch ``e`` permutes the
indices with a generator seeded by ``(seed, e)`` (or keeps their order), drops the tail that does not divide by the
world size (or pads it by wrapping), and rank ``r`` takes every ``world``-th index from ``r``.  The order is a pure
function of ``(seed, epoch)``, so a data loader (torchdata's ``StatefulDataLoader``) that records how far it got
resumes exactly.  The sampler keeps no state of its own on purpose: the epoch is the run's (``run.batches`` calls
``set_epoch``), and the position inside an epoch is the data loader's (a sampler with a ``state_dict`` would make
``StatefulDataLoader`` skip its own fast-forward).
"""

from __future__ import annotations

from typing import Iterator, Sized

import torch


class ShardedSampler(torch.utils.data.Sampler[int]):
    def __init__(self, dataset: Sized, *, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        self.n = len(dataset)
        if self.n < world_size and drop_last:
            raise ValueError(f"the data set has {self.n} items, fewer than the {world_size} ranks of the job; "
                             f"use a larger data set or drop_last=False")
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by ``run.batches`` before every pass."""
        self.epoch = int(epoch)

    def _order(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.n, generator=gen).tolist()
        else:
            order = list(range(self.n))
        if self.drop_last:
            return order[: self.n - self.n % self.world_size]
        pad = (-self.n) % self.world_size
        return order + order[:pad]

    def __iter__(self) -> Iterator[int]:
        return iter(self._order()[self.rank::self.world_size])

    def __len__(self) -> int:
        total = self.n - self.n % self.world_size if self.drop_last else -(-self.n // self.world_size) * self.world_size
        return total // self.world_size
