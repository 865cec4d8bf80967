"""What the peer workers share: the project's model at the job file's sizes, its token stream, records.

Imported by ``torchft_worker.py`` and ``nvrx_worker.py`` (each in its peer's own virtual environment, which
holds torch and PyYAML besides the peer) and by ``ours_worker.py`` (project venv).  The model is the
project's own ``CausalDecoder`` built from ``examples/tiny.yaml`` (or the file given), so every system
trains exactly the same architecture, initialisation, optimizer, schedule and data.

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

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch

from accelpact_slurm.core.config import JobConfig, load_config
from accelpact_slurm.workload.data import TokenStream
from accelpact_slurm.workload.model import build_model
from accelpact_slurm.workload.trainer import lr_lambda

DEFAULT_CONFIG = REPO / "examples" / "tiny.yaml"


class Records:
    """Append-only JSON-lines writer (one ``os.write`` per record)."""

    def __init__(self, path: str, **static: Any) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._static = static

    def emit(self, kind: str, **fields: Any) -> None:
        rec = {"t": time.time(), "ev": kind, **self._static, **fields}
        os.write(self._fd, (json.dumps(rec) + "\n").encode())


class Replica:
    """One process's model, AdamW, LR schedule and data cursor, as the project's trainer builds them.

    ``rank``/``world`` pick this process's slice of each global batch (``batch_per_rank`` sequences per
    process, as on every rank of the project's job).
    """

    def __init__(self, cfg: JobConfig, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        torch.set_num_threads(cfg.train.threads_per_rank)
        torch.manual_seed(cfg.seed * 1000 + rank + 1)  # dropout, as the project's trainer seeds it
        self.model = build_model(cfg.model, cfg.seed)
        t = cfg.train
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                           weight_decay=t.weight_decay, foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.stream = TokenStream(cfg.model.vocab, cfg.model.seq_len, cfg.seed)
        self.cursor = 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.params)

    def forward_backward(self) -> float:
        """Forward and backward on this process's batch; gradients left in ``.grad``."""
        self.optimizer.zero_grad(set_to_none=False)
        self.model.train()
        batch = self.stream.rank_batch(self.cursor, self.rank, self.world, self.cfg.train.batch_per_rank)
        loss = self.model.loss(batch)
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
        """Optimizer and schedule step; the data cursor moves by one global batch."""
        self.optimizer.step()
        self.scheduler.step()
        self.cursor = TokenStream.advance(self.cursor, self.world, self.cfg.train.batch_per_rank)

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
