"""A deterministic synthetic token stream with a resumable cursor.

Sequence ``i`` is a pure function of ``(seed, i)``: a noisy affine recurrence
over the vocabulary (one rule per seed, 10% noise tokens): learnable, not trivial.  The stream's whole state is
the integer cursor (the number of sequences consumed by the job), so resuming is
exact and needs no file.
"""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15


class TokenStream:
    """Random-access token sequences of length ``seq_len + 1`` (inputs and targets)."""

    def __init__(self, vocab: int, seq_len: int, seed: int, noise: float = 0.1) -> None:
        self.vocab = vocab
        self.seq_len = seq_len
        self.seed = seed
        self.noise = noise
        rule = torch.Generator().manual_seed(seed % (2**63))
        # One affine rule per stream (an odd multiplier): a bigram a model learns in a few dozen updates.
        self.rule = (int(torch.randint(1, 8, (1,), generator=rule)) * 2 + 1,
                     int(torch.randint(0, vocab, (1,), generator=rule)))

    def sequence(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * _MIX + index) % (2**63))
        a, b = self.rule
        out = torch.empty(self.seq_len + 1, dtype=torch.long)
        out[0] = int(torch.randint(0, self.vocab, (1,), generator=gen))
        flips = torch.rand(self.seq_len, generator=gen) < self.noise
        rand = torch.randint(0, self.vocab, (self.seq_len,), generator=gen)
        for k in range(self.seq_len):
            nxt = (a * int(out[k]) + b) % self.vocab
            out[k + 1] = int(rand[k]) if flips[k] else nxt
        return out

    def batch(self, start: int, size: int) -> torch.Tensor:
        """Sequences ``start .. start + size - 1`` as a ``(size, seq_len + 1)`` tensor."""
        return torch.stack([self.sequence(start + j) for j in range(size)])

    def rank_batch(self, cursor: int, rank: int, world_size: int, batch_per_rank: int) -> torch.Tensor:
        """The batch rank ``rank`` trains on when the job's cursor is ``cursor``."""
        return self.batch(cursor + rank * batch_per_rank, batch_per_rank)

    @staticmethod
    def advance(cursor: int, world_size: int, batch_per_rank: int) -> int:
        """The cursor after one update of the whole job."""
        return cursor + world_size * batch_per_rank

    def fixed_batch(self, size: int = 4) -> torch.Tensor:
        """A batch outside the training stream, used for the replay check of a snapshot."""
        return self.batch(-(10**9), size)
