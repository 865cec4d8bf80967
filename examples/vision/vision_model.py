"""A small residual convolutional classifier and a synthetic image data set.

This is the second example user job's model code; it shares nothing with the
reference causal decoder.  :class:`VisionNet` is a conv stem, three
:class:`ConvBlock` residual units (each its own FSDP wrap unit), GroupNorm or
BatchNorm (``norm="batch"``: running statistics the forward updates, a buffer
per rank, since each rank sees its own batches), global average pooling and a
linear head, with dropout so that the RNG state matters.

Both halves are deterministic without touching the global RNG: weights come
from an explicit generator seeded by ``seed`` (every rank builds bit-identical
weights), and image ``i`` of :class:`SyntheticImages` is a pure function of
``(seed, i)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_MASK63 = (1 << 63) - 1


def make_norm(kind: str, channels: int) -> nn.Module:
    """``"group"``: GroupNorm with 4 groups; ``"batch"``: BatchNorm2d (running statistics in buffers)."""
    if kind == "group":
        return nn.GroupNorm(4, channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    raise ValueError(f"norm {kind!r}: use 'group' or 'batch'")


def _mix(seed: int, index: int) -> int:
    """A 63-bit generator seed for ``(seed, index)``: distinct pairs give unrelated streams."""
    x = ((seed + 1) * 6364136223846793005 + (index + 1) * 1442695040888963407) & _MASK63
    x ^= x >> 29
    return (x * 0xBF58476D1CE4E5B9) & _MASK63


class ConvBlock(nn.Module):
    """A pre-norm residual block: two 3x3 convolutions, optionally halving the resolution.

    Args:
        cin: Input channels.
        cout: Output channels.
        stride: 1 keeps the resolution, 2 halves it.
        dropout: Dropout probability inside the residual branch.
        norm: ``"group"`` or ``"batch"`` (see :func:`make_norm`).
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, dropout: float = 0.1, norm: str = "group") -> None:
        super().__init__()
        self.norm1 = make_norm(norm, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm2 = make_norm(norm, cout)
        self.drop = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.skip = nn.Conv2d(cin, cout, 1, stride=stride, bias=False) if (cin != cout or stride != 1) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.relu(self.norm1(x)))
        h = self.conv2(self.drop(F.relu(self.norm2(h))))
        return h + (x if self.skip is None else self.skip(x))


class VisionNet(nn.Module):
    """Conv stem, three residual blocks (the last two at half resolution), pool, linear head.

    With ``channels=16`` and ten classes it has about 40k parameters.

    Args:
        classes: Number of output classes.
        channels: Width of the stem and the first block (later blocks use twice that).
        dropout: Dropout probability (residual branches and before the head).
        seed: Seed of the explicit generator every weight is drawn from.
        norm: ``"group"`` or ``"batch"`` (see :func:`make_norm`).
    """

    def __init__(self, classes: int = 10, channels: int = 16, dropout: float = 0.1, seed: int = 0,
                 norm: str = "group") -> None:
        super().__init__()
        c = channels
        # Module constructors run their default init on the global RNG: fork it so that
        # building the model leaves the caller's RNG stream untouched.
        with torch.random.fork_rng(devices=[]):
            self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
            self.blocks = nn.ModuleList([
                ConvBlock(c, c, 1, dropout, norm),
                ConvBlock(c, 2 * c, 2, dropout, norm),
                ConvBlock(2 * c, 2 * c, 1, dropout, norm),
            ])
            self.norm = make_norm(norm, 2 * c)
            self.drop = nn.Dropout(dropout)
            self.head = nn.Linear(2 * c, classes)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Re-draw every parameter from ``torch.Generator().manual_seed(seed)`` in name order.

        Convolutions get He-normal weights (the second conv of each residual branch is
        scaled down so the blocks start close to the identity), the head a small normal,
        norm weights one, biases zero.

        Args:
            seed: The generator seed; equal seeds give bit-identical weights.
        """
        gen = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # a norm's scale
                p.fill_(1.0)
            else:
                fan_in = p[0].numel()
                std = (2.0 / fan_in) ** 0.5
                if name.endswith("conv2.weight"):
                    std *= 0.2
                elif name.startswith("head"):
                    std = fan_in ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits ``(batch, classes)`` for images ``(batch, 3, S, S)``."""
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        x = F.relu(self.norm(x)).mean(dim=(2, 3))
        return self.head(self.drop(x))


class SyntheticImages(torch.utils.data.Dataset):
    """A map-style data set of noisy, shifted class prototypes.

    Each class has a smooth random colour pattern (a 4x4 grid per channel,
    upsampled).  Item ``i`` picks a label, scales its prototype by a random
    contrast, rolls it by up to two pixels and adds Gaussian noise, all drawn
    from a generator seeded by ``(seed, i)`` alone.

    Args:
        count: Number of items.
        image_size: Side ``S`` of the square images.
        classes: Number of classes.
        seed: Data set seed (prototypes and every item derive from it).
        noise: Standard deviation of the additive noise.
    """

    def __init__(self, count: int, image_size: int = 16, classes: int = 10, seed: int = 0,
                 noise: float = 0.5) -> None:
        self.count = count
        self.image_size = image_size
        self.classes = classes
        self.seed = seed
        self.noise = noise
        gen = torch.Generator().manual_seed(_mix(seed, -1))
        grid = torch.randn(classes, 3, 4, 4, generator=gen)
        self.prototypes = F.interpolate(grid, size=(image_size, image_size), mode="bilinear",
                                        align_corners=False)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Item ``index``: a ``(3, S, S)`` float32 image and its integer label."""
        if not 0 <= index < self.count:
            raise IndexError(index)
        gen = torch.Generator().manual_seed(_mix(self.seed, index))
        label = int(torch.randint(self.classes, (1,), generator=gen))
        contrast = 0.7 + 0.6 * float(torch.rand((), generator=gen))
        dy, dx = (int(v) for v in torch.randint(-2, 3, (2,), generator=gen))
        image = torch.roll(self.prototypes[label] * contrast, shifts=(dy, dx), dims=(1, 2))
        image = image + self.noise * torch.randn(image.shape, generator=gen)
        return image.float(), label
