"""The torchrun example's model and data: a small next-token model and a synthetic token stream (no download).

:func:`build_model` gives every rank bit-identical weights from the seed alone (an explicit generator);
:class:`Tokens` is a map-style data set whose item ``i`` is a pure function of ``(seed, i)``: a noisy affine
recurrence over the vocabulary that a model learns in a few dozen updates.  :func:`batches` is the plain loop's
helper: the loader's batches, epoch after epoch, ``steps`` of them.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """One residual MLP layer over the previous tokens' mix (a causal cumulative mean), pre-norm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        h = self.norm(x)
        h = h + self.mix(h.cumsum(dim=1) / steps)
        return x + self.down(F.gelu(self.up(h)))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model(seed: int, vocab: int = 128, width: int = 32, layers: int = 2) -> TinyLM:
    model = TinyLM(vocab, width, layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a ``(batch, length + 1)`` block."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class Tokens(torch.utils.data.Dataset):
    """``size`` sequences of ``length + 1`` tokens; item ``i`` depends on ``(seed, i)`` only."""

    def __init__(self, seed: int, vocab: int = 128, length: int = 16, size: int = 4096) -> None:
        self.seed, self.vocab, self.length, self.size = seed, vocab, length, size
        rule = torch.Generator().manual_seed(seed)
        self.a = int(torch.randint(1, 8, (1,), generator=rule)) * 2 + 1
        self.b = int(torch.randint(0, vocab, (1,), generator=rule))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        out = torch.empty(self.length + 1, dtype=torch.long)
        out[0] = int(torch.randint(0, self.vocab, (1,), generator=gen))
        noise = torch.rand(self.length, generator=gen) < 0.1
        rand = torch.randint(0, self.vocab, (self.length,), generator=gen)
        for k in range(self.length):
            out[k + 1] = int(rand[k]) if noise[k] else (self.a * int(out[k]) + self.b) % self.vocab
        return out


def batches(loader: Any, steps: int) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (``set_epoch`` on its sampler), ``steps`` of them."""
    done, epoch = 0, 0
    while done < steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
            done += 1
            if done == steps:
                return
        epoch += 1
