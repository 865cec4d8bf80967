"""The reference example's model and data: a small pre-LayerNorm causal decoder on a synthetic token stream.

Every :class:`Block` is one FSDP unit; the root module holds the embeddings, the final norm and the
output head.  Parameters are initialised from an explicit generator, so every rank builds
bit-identical weights from the job's seed whatever else used the global RNG.

:class:`TokenStream` is a map-style data set: sequence ``i`` is a pure function of ``(seed, i)`` (a
noisy affine recurrence over the vocabulary, one rule per seed, 10% noise tokens): learnable, not
trivial, and needing no file.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_MIX = 0x9E3779B97F4A7C15


class Block(nn.Module):
    """One decoder layer: causal self-attention and a GELU MLP, pre-norm, residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class CausalDecoder(nn.Module):
    def __init__(self, *, layers: int, width: int, heads: int, vocab: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"params.width ({width}) must be divisible by params.heads ({heads})")
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a ``(batch, seq_len + 1)`` token block."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic initialisation from ``seed`` alone, in parameter-name order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # LayerNorm weights
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def build_model(seed: int, **shape: int | float) -> CausalDecoder:
    model = CausalDecoder(**shape)  # type: ignore[arg-type]
    init_weights(model, seed)
    return model


class TokenStream(torch.utils.data.Dataset):
    """``size`` random-access token sequences of length ``seq_len + 1`` (inputs and targets)."""

    def __init__(self, vocab: int, seq_len: int, seed: int, size: int, noise: float = 0.1) -> None:
        self.vocab, self.seq_len, self.seed, self.size, self.noise = vocab, seq_len, seed, size, noise
        rule = torch.Generator().manual_seed(seed % (2**63))
        # One affine rule per stream (an odd multiplier): a bigram a model learns in a few dozen updates.
        self.rule = (int(torch.randint(1, 8, (1,), generator=rule)) * 2 + 1,
                     int(torch.randint(0, vocab, (1,), generator=rule)))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
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
