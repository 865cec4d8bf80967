"""Single-process unit tests of the vision example's parts (no torch.distributed).

The data set is deterministic, the model builds bit-identical weights from a
seed and learns the synthetic task, and the ``Grouped`` accumulation wrapper
yields lists of ``k`` batches and resumes exactly after a state round trip.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402

VISION = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "examples", "vision")
if VISION not in sys.path:
    sys.path.insert(0, VISION)

import train_vision  # noqa: E402
import vision_model  # noqa: E402


def _same_batches(a, b):
    """Whether two sequences of (images, labels) batches are equal element by element."""
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_dataset_is_a_pure_function_of_seed_and_index():
    a = vision_model.SyntheticImages(32, image_size=12, classes=5, seed=3)
    b = vision_model.SyntheticImages(32, image_size=12, classes=5, seed=3)
    c = vision_model.SyntheticImages(32, image_size=12, classes=5, seed=4)
    state = torch.get_rng_state()
    for i in (0, 7, 31, 7):
        (xa, ya), (xb, yb) = a[i], b[i]
        assert xa.shape == (3, 12, 12) and xa.dtype == torch.float32
        assert isinstance(ya, int) and 0 <= ya < 5
        assert torch.equal(xa, xb) and ya == yb
    assert torch.equal(torch.get_rng_state(), state), "items must not draw from the global RNG"
    assert not torch.equal(a[0][0], a[1][0])
    assert any(not torch.equal(a[i][0], c[i][0]) for i in range(4))
    assert len({a[i][1] for i in range(32)}) > 1
    with pytest.raises(IndexError):
        a[32]


def test_model_weights_are_bit_identical_from_one_seed():
    state = torch.get_rng_state()
    m1 = vision_model.VisionNet(classes=10, channels=16, seed=11)
    m2 = vision_model.VisionNet(classes=10, channels=16, seed=11)
    m3 = vision_model.VisionNet(classes=10, channels=16, seed=12)
    assert torch.equal(torch.get_rng_state(), state), "building the model must not move the global RNG"
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert list(s1) == list(s2)
    assert all(torch.equal(s1[n], s2[n]) for n in s1)
    assert any(not torch.equal(s1[n], s3[n]) for n in s1 if n.endswith("weight") and s1[n].dim() > 1)
    assert not any("running" in n for n in s1), "no BatchNorm buffers"
    assert 20_000 < sum(p.numel() for p in m1.parameters()) < 80_000
    assert all(isinstance(b, vision_model.ConvBlock) for b in m1.blocks)


def test_plain_sgd_steps_reduce_the_loss():
    torch.manual_seed(0)  # dropout
    data = vision_model.SyntheticImages(64, image_size=16, classes=10, seed=7)
    images = torch.stack([data[i][0] for i in range(len(data))])
    labels = torch.tensor([data[i][1] for i in range(len(data))])
    model = vision_model.VisionNet(classes=10, channels=16, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)

    def eval_loss():
        model.eval()
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        model.train()
        return float(loss)

    before = eval_loss()
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = eval_loss()
    assert after < before - 0.1, (before, after)


def _shuffled_loader(data):
    return StatefulDataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5),
                              num_workers=0)


def _distributed_loader(data):
    sampler = StatefulDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=9, drop_last=True)
    return StatefulDataLoader(data, batch_size=2, sampler=sampler, num_workers=0)


def test_grouped_yields_lists_of_k_batches_and_drops_a_short_tail():
    data = vision_model.SyntheticImages(10, image_size=8, classes=3, seed=1)
    loader = StatefulDataLoader(data, batch_size=2, num_workers=0)  # 5 batches
    grouped = train_vision.Grouped(loader, 2)
    groups = list(grouped)
    assert len(groups) == len(grouped) == 2
    assert all(isinstance(g, list) and len(g) == 2 for g in groups)
    assert _same_batches([b for g in groups for b in g], list(loader)[:4])
    assert grouped.sampler is loader.sampler
    with pytest.raises(ValueError):
        train_vision.Grouped(loader, 0)


@pytest.mark.parametrize("make_loader", [_shuffled_loader, _distributed_loader], ids=["shuffle", "sampler"])
@pytest.mark.parametrize("cut", [1, 3])
def test_grouped_resumes_where_it_left_off(make_loader, cut):
    data = vision_model.SyntheticImages(48, image_size=8, classes=3, seed=2)
    k = 3
    reference = list(train_vision.Grouped(make_loader(data), k))
    assert len(reference) >= 4

    first = train_vision.Grouped(make_loader(data), k)
    it = iter(first)
    for _ in range(cut):
        next(it)
    state = first.state_dict()

    resumed = train_vision.Grouped(make_loader(data), k)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(reference) - cut
    assert all(len(g) == k for g in rest)
    assert _same_batches([b for g in rest for b in g], [b for g in reference[cut:] for b in g])


def test_grouped_next_epoch_follows_set_epoch():
    data = vision_model.SyntheticImages(16, image_size=8, classes=3, seed=3)
    loader = _distributed_loader(data)
    grouped = train_vision.Grouped(loader, 2)
    grouped.sampler.set_epoch(0)
    epoch0 = list(grouped)
    grouped.sampler.set_epoch(1)
    epoch1 = list(grouped)
    assert len(epoch0) == len(epoch1) == 2
    assert not _same_batches([b for g in epoch0 for b in g], [b for g in epoch1 for b in g])


@pytest.mark.parametrize("kind", ["mobilenet", "resnet"])
def test_batch_norm_models_are_shaped_like_torchvisions_and_built_bit_identical(kind):
    """The batch-norm models hold what torchvision's do beside their weights: BatchNorm statistics and counters
    inside ``nn.Sequential`` blocks (``features.0.1.running_mean``) and outside them (``bn1.running_mean``),
    squeeze-excitation, and (ResNet) non-persistent buffers that ``state_dict()`` leaves out; one seed, one model;
    ``params.model`` picks them."""
    import bn_models

    p = {"model": kind, "classes": 5, "channels": 4, "dropout": 0.1}
    a, b = train_vision.build_model(p, 3), train_vision.build_model(p, 3)
    c = train_vision.build_model(p, 4)
    sd = a.state_dict()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in sd.items())
    assert any(not torch.equal(v, c.state_dict()[k]) for k, v in sd.items() if v.is_floating_point())
    first = "features.0.1" if kind == "mobilenet" else "bn1"
    assert {f"{first}.running_mean", f"{first}.running_var", f"{first}.num_batches_tracked"} <= set(sd)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in a.modules()) >= 8
    assert any(isinstance(m, bn_models.wrap_unit(a)) for m in a.modules())
    if kind == "mobilenet":
        assert any(isinstance(m, bn_models.SqueezeExcitation) for m in a.modules())
    else:
        assert "pixel_mean" in dict(a.named_buffers()) and "pixel_mean" not in sd  # non-persistent
    a.train()
    before = sd[f"{first}.running_mean"].clone()
    a(torch.randn(4, 3, 8, 8)).sum().backward()
    assert not torch.equal(a.state_dict()[f"{first}.running_mean"], before)  # the forward moves the statistics
    assert int(a.state_dict()[f"{first}.num_batches_tracked"]) == 1
    with pytest.raises(ValueError, match="params.model must be vision, mobilenet or resnet"):
        train_vision.build_model(dict(p, model="vgg"), 0)
