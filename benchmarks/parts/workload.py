"""The reference workload as the benchmarks use it: the one module under ``scripts/`` that imports it.

The workload is the decoder example, ``examples/decoder/`` (not a package: its directory goes on
``sys.path`` here): ``decoder_model.py`` (``CausalDecoder``, ``build_model``, ``TokenStream``,
``lm_loss``), ``train_decoder.py`` (the entry point ``main(job)``: FSDP wrapping, AdamW, the LR
schedule, the data loader) and ``job.yaml`` (the job file; its free-form ``params:`` section sets the
model's shape, the batch and the optimizer).  A benchmark that needs a job of another size writes a
copy of that job file with other ``params`` (``write_job``) and, where it measures something the
example does not, names its own entry point (``benchmarks/parts/*_entry.py``, ``entry_of``).

Its users: ``bench/*_entry.py`` (the model, optimizer, schedule and data of a rank: ``decoder_parts``,
``update``), ``bench/*_setup.py``, ``bench/peers_*`` and ``benchmarks/parts/paper.py`` (job files,
model sizes), ``bench/ckpt_bandwidth.py`` (a node's state) and ``benchmarks/parts/peers_workers/common.py`` (what the peers'
workers train; they run in the peers' own virtual environments, which hold torch and PyYAML but neither
torchdata nor the library's other dependencies: only ``decoder_model`` is imported at module level, and
``lr_schedule`` reads the example's schedule from its source instead of importing ``train_decoder``).
"""

from __future__ import annotations

import ast
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "decoder"
BENCH = Path(__file__).resolve().parent

#: The reference job file: the embedded default (2 emulated nodes x 2 ranks), the model's sizes in ``params``.
JOB_FILE = EXAMPLE / "job.yaml"
#: The example's entry point, absolute (a copy of the job file elsewhere still finds it).
TRAIN_ENTRY = f"{EXAMPLE / 'train_decoder.py'}:main"
#: The ``params`` keys that are the model's shape (``build_model``'s keywords).
SHAPE = ("layers", "width", "heads", "vocab", "seq_len", "dropout")

if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from decoder_model import Block, CausalDecoder, TokenStream, build_model, lm_loss  # noqa: E402

__all__ = ["Block", "CausalDecoder", "JOB_FILE", "Parts", "SHAPE", "TRAIN_ENTRY", "TokenStream", "base_params",
           "batches_forever", "build_model", "decoder_parts", "entry_of", "lm_loss", "lr_schedule", "model_of",
           "param_count", "rank_batch", "shape_of", "train_module", "update", "write_job"]


# ====================================================================== job files


def entry_of(name: str) -> str:
    """The absolute ``entry:`` of a benchmark's own entry point ``benchmarks/parts/<name>.py:main``."""
    return f"{BENCH / name}.py:main"


def base_params() -> dict[str, Any]:
    """The reference job file's ``params`` section."""
    import yaml

    return dict(yaml.safe_load(JOB_FILE.read_text()).get("params") or {})


def write_job(path: str | Path, overrides: Mapping[str, Any] | None = None, *, entry: str = TRAIN_ENTRY,
              params: Mapping[str, Any] | None = None) -> Path:
    """A copy of the reference job file at ``path``: ``entry`` (absolute), ``params`` merged into its
    ``params`` section, then the dotted-key ``overrides`` (``{"timeouts.collective_s": 2}``)."""
    import yaml

    data = yaml.safe_load(JOB_FILE.read_text())
    data["entry"] = entry
    data["params"] = {**(data.get("params") or {}), **(params or {})}
    for dotted, value in (overrides or {}).items():
        *sections, key = dotted.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = value
    path = Path(path)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ====================================================================== the model and its data


def shape_of(params: Mapping[str, Any]) -> dict[str, Any]:
    """``build_model``'s keywords from a ``params`` section."""
    return {k: params[k] for k in SHAPE}


def model_of(params: Mapping[str, Any], seed: int = 0) -> CausalDecoder:
    """The decoder of a ``params`` section, freshly initialised, unwrapped."""
    return build_model(seed, **shape_of(params))


def param_count(params: Mapping[str, Any]) -> int:
    return sum(p.numel() for p in model_of(params).parameters())


def lr_schedule(steps: int, warmup: int, floor: float) -> Callable[[int], float]:
    """``train_decoder.schedule(steps, warmup, floor)``, compiled from the example's own source.

    Importing ``train_decoder`` needs torchdata and the library, which the peers' virtual environments
    do not hold; its ``schedule`` function is pure (``math`` only), so it is taken from the file as is.
    """
    source = EXAMPLE / "train_decoder.py"
    tree = ast.parse(source.read_text(), str(source))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "schedule")
    ns: dict[str, Any] = {"math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(source), "exec"), ns)
    return ns["schedule"](steps, warmup, floor)


def rank_batch(data: TokenStream, k: int, rank: int, world: int, batch: int) -> Any:
    """Batch ``k`` of rank ``rank`` as the example's loader yields it in its first pass
    (``job.sampler(data, shuffle=False)`` + ``batch_size=batch``): sequences ``rank + world * (k * batch + j)``."""
    import torch

    return torch.stack([data[rank + world * (k * batch + j)] for j in range(batch)])


# ====================================================================== a rank's parts (project venv)


def train_module() -> Any:
    """``examples/decoder/train_decoder.py`` (imports torchdata and the library's public API)."""
    import train_decoder

    return train_decoder


class Parts(NamedTuple):
    """What the example's ``main`` builds before ``job.protect``."""

    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    params: dict[str, Any]


def decoder_parts(job: Any, **overrides: Any) -> Parts:
    """The example's model (wrapped on ``job``'s mesh), AdamW, warm-up + cosine schedule and data loader,
    exactly as ``train_decoder.main`` builds them, from ``job.params`` with ``overrides`` applied."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    train = train_module()
    p = {**job.params, **overrides}
    model = train.wrap(build_model(job.seed, **shape_of(p)), job, p.get("fsdp", "fsdp1"), p.get("mesh", "device_mesh"))
    beta1, beta2 = p.get("betas", (0.9, 0.95))
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], betas=(beta1, beta2), weight_decay=p["weight_decay"],
                            foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train.schedule(job.steps, p["warmup_steps"], p["min_lr"] / p["lr"]))
    data = TokenStream(p["vocab"], p["seq_len"], job.seed, p["sequences"])
    loader = StatefulDataLoader(data, batch_size=p["batch_per_rank"], sampler=job.sampler(data, shuffle=False))
    return Parts(model, opt, sched, loader, p)


def update(parts: Parts, tokens: Any, before_step: Callable[[], None] | None = None, into: Any = None) -> Any:
    """The example's update body (forward, backward, optimizer step, schedule step); returns the loss.

    Inside ``with run.update() as u`` it is a guarded update (pass ``into=u``: the loss is reported before the
    step, where the vote reads it); outside, the same update without the guard.
    ``before_step`` runs right before ``optimizer.step`` (a benchmark's wait for an async copy)."""
    loss = lm_loss(parts.model, tokens)
    loss.backward()
    if into is not None:
        into.loss = loss
    if before_step is not None:
        before_step()
    parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()
    return loss


def batches_forever(loader: Any) -> Any:
    """The loader's batches, pass after pass (for updates outside ``run.batches``)."""
    while True:
        yield from loader
