"""What the peer workers share: the decoder example's model at the job file's sizes, its token stream, records.

Imported by ``torchft_worker.py`` and ``nvrx_worker.py`` (each in its peer's own virtual environment, which
holds torch and PyYAML besides the peer) and by ``benchmarks/parts/peers_entry.py`` (project venv).  The model
is the decoder example's ``CausalDecoder`` (``examples/decoder/``) built from the ``params`` of
``examples/decoder/job.yaml`` (or the file given), with the example's AdamW settings, schedule and data
order, so every system trains exactly the same architecture, initialisation, optimizer, schedule and data;
the workload comes from ``benchmarks/parts/workload.py``, the one module the benchmarks import it from.

Records are JSON lines appended with one ``os.write`` each to the file the harness names, so that a line
is complete even when the writer is killed right after it (the injected fault does exactly that).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
for _p in (str(REPO),):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch

from accelpact_slurm.core.config import JobConfig, load_config
from benchmarks.parts.workload import JOB_FILE, TokenStream, lm_loss, lr_schedule, model_of, rank_batch

DEFAULT_CONFIG = JOB_FILE


class Records:
    """Append-only JSON-lines writer (one ``os.write`` per record)."""

    def __init__(self, path: str, **static: Any) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._static = static

    def emit(self, kind: str, **fields: Any) -> None:
        rec = {"t": time.time(), "ev": kind, **self._static, **fields}
        os.write(self._fd, (json.dumps(rec) + "\n").encode())


class Replica:
    """One process's model, AdamW, LR schedule and data, as the decoder example's ``main`` builds them.

    ``rank``/``world`` pick this process's share of the data (``batch_per_rank`` sequences per update, in
    the order the example's ``job.sampler(data, shuffle=False)`` gives rank ``rank`` of ``world``).
    """

    def __init__(self, cfg: JobConfig, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        p = self.p = cfg.params
        torch.set_num_threads(cfg.topology.threads_per_rank)
        torch.manual_seed(cfg.seed * 1000 + rank + 1)  # dropout, as the project's Run seeds it
        self.model = model_of(p, cfg.seed)
        beta1, beta2 = p.get("betas", (0.9, 0.95))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=p["lr"], betas=(beta1, beta2),
                                           weight_decay=p["weight_decay"], foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_schedule(cfg.steps, p["warmup_steps"], p["min_lr"] / p["lr"]))
        self.data = TokenStream(p["vocab"], p["seq_len"], cfg.seed, p["sequences"])
        self.cursor = 0  # updates taken: the index of this process's next batch
        self.params = [x for x in self.model.parameters() if x.requires_grad]

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.params)

    def forward_backward(self) -> float:
        """Forward and backward on this process's batch; gradients left in ``.grad``."""
        self.optimizer.zero_grad(set_to_none=False)
        self.model.train()
        batch = rank_batch(self.data, self.cursor, self.rank, self.world, self.p["batch_per_rank"])
        loss = lm_loss(self.model, batch)
        loss.backward()
        return float(loss.detach())

    def flat_grads(self, extra: int = 0) -> torch.Tensor:
        """All gradients in one tensor (plus ``extra`` trailing zeros for small side channels)."""
        parts = [p.grad.reshape(-1) for p in self.params]
        if extra:
            parts.append(torch.zeros(extra))
        return torch.cat(parts)

    def set_grads(self, flat: torch.Tensor) -> None:
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n

    def step(self) -> None:
        """Optimizer and schedule step; the data cursor moves by one batch."""
        self.optimizer.step()
        self.scheduler.step()
        self.cursor += 1

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "sched": self.scheduler.state_dict(), "cursor": self.cursor}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.cursor = int(sd["cursor"])


def load(config: str | None) -> JobConfig:
    return load_config(config or DEFAULT_CONFIG)
