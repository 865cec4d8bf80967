"""The shared-memory staging format: one file per rank per step under ``/dev/shm``.

A rank writes ``rank-L.pt`` under a temporary name and renames it, so the daemon
never reads half a payload; the payload is a plain ``torch.save`` of dicts,
lists and tensors (loadable with ``weights_only=True``)::

    {"step": N, "rank": r, "local_rank": l, "meta": "<json>", "state": <appstate.capture()>}

Who calls: :mod:`.client` writes (in the rank's staging thread), :mod:`.daemon`
reads and removes once the snapshot is committed or abandoned.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from .layout import private_dir


def step_stage_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:010d}")


def write_payload(root: str, step: int, rank: int, local_rank: int, meta: dict[str, Any], state: Any) -> str:
    import torch

    d = step_stage_dir(root, step)
    private_dir(root)
    os.makedirs(d, mode=0o700, exist_ok=True)
    path = os.path.join(d, f"rank-{local_rank}.pt")
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"step": step, "rank": rank, "local_rank": local_rank, "meta": json.dumps(meta),
                "state": state}, tmp)
    os.replace(tmp, path)
    return path


def read_payload(path: str) -> dict[str, Any]:
    import torch

    data = torch.load(path, weights_only=True)
    data["meta"] = json.loads(data["meta"])
    return data


def drop_step(root: str, step: int) -> None:
    shutil.rmtree(step_stage_dir(root, step), ignore_errors=True)


def drop_all(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
