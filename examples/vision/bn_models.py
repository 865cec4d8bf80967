"""Two small batch-norm classifiers shaped like torchvision's MobileNetV3-small and ResNet (no torchvision needed).

They exist so that the jobs and the tests exercise what real vision models hold beside their weights: many
BatchNorm2d layers (running mean, running variance and a ``num_batches_tracked`` counter each, a buffer per
rank since each rank sees its own batches), some inside ``nn.Sequential`` blocks (``features.0.1.running_mean``,
as torchvision names them) and some not (``bn1.running_mean``), squeeze-excitation, and a non-persistent buffer
(:class:`TinyResNet`'s input normalisation, which ``state_dict()`` leaves out).

- :class:`TinyMobileNetV3`: Conv-BN-Hardswish stem, inverted residual blocks (expand, depthwise, optional
  squeeze-excitation, project, residual where the shape allows), a last Conv-BN-act, pooling, a two-layer head
  with dropout.  Its wrap unit is :class:`InvertedResidual`.
- :class:`TinyResNet`: conv, bn, ReLU stem, basic blocks (two 3x3 Conv-BN, a 1x1 Conv-BN down-sampling shortcut
  where the shape changes), pooling, a linear head.  Its wrap unit is :class:`BasicBlock`.

Weights are drawn from an explicit generator seeded by ``seed`` (every rank builds bit-identical weights; the
global RNG is left untouched).  ``WRAP`` names each model's FSDP wrap unit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvBNAct(nn.Sequential):
    """Conv2d, BatchNorm2d, activation (torchvision's ``Conv2dNormActivation``): indices 0, 1, 2."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                 act: type[nn.Module] | None = nn.Hardswish) -> None:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                                   nn.BatchNorm2d(cout)]
        if act is not None:
            layers.append(act())
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """Channel attention: pool, 1x1 reduce, ReLU, 1x1 expand, hard sigmoid, scale (torchvision's)."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        s = F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class InvertedResidual(nn.Module):
    """Expand (1x1 Conv-BN-act), depthwise (kxk Conv-BN-act), optional squeeze-excitation, project (1x1 Conv-BN)."""

    def __init__(self, cin: int, expand: int, cout: int, kernel: int, stride: int, se: bool,
                 act: type[nn.Module]) -> None:
        super().__init__()
        self.residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand != cin:
            layers.append(ConvBNAct(cin, expand, 1, act=act))
        layers.append(ConvBNAct(expand, expand, kernel, stride, groups=expand, act=act))
        if se:
            layers.append(SqueezeExcitation(expand, max(8, expand // 4)))
        layers.append(ConvBNAct(expand, cout, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class TinyMobileNetV3(nn.Module):
    """A MobileNetV3-small in miniature (``width`` scales every channel count).

    Args:
        classes: Number of output classes.
        width: Channels of the stem (the blocks use multiples of it).
        dropout: Dropout probability in the head.
        seed: Seed of the explicit generator every weight is drawn from.
    """

    WRAP = "InvertedResidual"

    def __init__(self, classes: int = 10, width: int = 8, dropout: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        w = width
        # (in, expand, out, kernel, stride, squeeze-excitation, activation), as MobileNetV3-small's first blocks
        spec = [(w, w, w, 3, 2, True, nn.ReLU), (w, 3 * w, 2 * w, 3, 2, False, nn.ReLU),
                (2 * w, 4 * w, 2 * w, 3, 1, False, nn.ReLU), (2 * w, 4 * w, 3 * w, 5, 1, True, nn.Hardswish)]
        with torch.random.fork_rng(devices=[]):  # module constructors draw from the global RNG
            self.features = nn.Sequential(
                ConvBNAct(3, w, 3, 2),
                *[InvertedResidual(*s) for s in spec],
                ConvBNAct(3 * w, 6 * w, 1))
            self.classifier = nn.Sequential(nn.Linear(6 * w, 8 * w), nn.Hardswish(), nn.Dropout(dropout),
                                            nn.Linear(8 * w, classes))
        init_weights(self, seed)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits ``(batch, classes)`` for images ``(batch, 3, S, S)``."""
        x = F.adaptive_avg_pool2d(self.features(images), 1).flatten(1)
        return self.classifier(x)


class BasicBlock(nn.Module):
    """ResNet's basic block: conv-bn-relu, conv-bn, plus the input (down-sampled by a 1x1 Conv-BN when needed)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(nn.Module):
    """A ResNet in miniature: stem (conv, ``bn1``, ReLU; not in a Sequential), two stages of basic blocks, head.

    The input is normalised by a fixed per-channel mean and scale held in non-persistent buffers: they are not in
    ``state_dict()`` (nor in a snapshot).

    Args:
        classes: Number of output classes.
        width: Channels of the stem and the first stage (the second uses twice that).
        dropout: Dropout probability before the head.
        seed: Seed of the explicit generator every weight is drawn from.
    """

    WRAP = "BasicBlock"

    def __init__(self, classes: int = 10, width: int = 8, dropout: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        w = width
        with torch.random.fork_rng(devices=[]):
            self.register_buffer("pixel_mean", torch.tensor([0.1, -0.1, 0.05]).view(1, 3, 1, 1), persistent=False)
            self.register_buffer("pixel_scale", torch.tensor([1.1, 0.9, 1.0]).view(1, 3, 1, 1), persistent=False)
            self.conv1 = nn.Conv2d(3, w, 3, 1, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(w)
            self.layer1 = nn.Sequential(BasicBlock(w, w), BasicBlock(w, w))
            self.layer2 = nn.Sequential(BasicBlock(w, 2 * w, 2), BasicBlock(2 * w, 2 * w))
            self.drop = nn.Dropout(dropout)
            self.fc = nn.Linear(2 * w, classes)
        init_weights(self, seed)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits ``(batch, classes)`` for images ``(batch, 3, S, S)``."""
        x = (images - self.pixel_mean) * self.pixel_scale
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(self.drop(F.adaptive_avg_pool2d(x, 1).flatten(1)))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Re-draw every parameter from ``torch.Generator().manual_seed(seed)`` in name order: He-normal weights,
    zero biases, batch-norm scales one.  Equal seeds give bit-identical models."""
    gen = torch.Generator().manual_seed(seed)
    for _name, p in sorted(model.named_parameters()):
        if p.dim() == 1:
            p.fill_(1.0 if _name.rsplit(".", 1)[-1] == "weight" else 0.0)
        else:
            fan_in = p[0].numel()
            p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / fan_in) ** 0.5)


MODELS = {"mobilenet": TinyMobileNetV3, "resnet": TinyResNet}


def build(kind: str, classes: int = 10, width: int = 8, dropout: float = 0.1, seed: int = 0) -> nn.Module:
    """``kind`` ``"mobilenet"`` or ``"resnet"`` (see :data:`MODELS`)."""
    if kind not in MODELS:
        raise ValueError(f"model {kind!r}: use one of {', '.join(MODELS)}")
    return MODELS[kind](classes=classes, width=width, dropout=dropout, seed=seed)


def wrap_unit(model: nn.Module) -> type[nn.Module]:
    """The class of ``model``'s FSDP wrap unit (:class:`InvertedResidual` or :class:`BasicBlock`)."""
    return {"InvertedResidual": InvertedResidual, "BasicBlock": BasicBlock}[model.WRAP]
