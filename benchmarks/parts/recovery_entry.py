"""Recovery benchmark, the entry point of our jobs' ranks (``benchmarks/parts/recovery.py``).

``accelpact-run JOB.yaml`` calls :func:`main` on every rank: the decoder example's model, optimizer, schedule
and data (``benchmarks.parts.workload.decoder_parts``), handed to ``job.protect`` as the example does, and the example's
update body.  Every rank appends to ``<out>/rank-R.jsonl`` (``params.bench.out``), with wall-clock times
(``time.time()``, comparable across the ranks of this machine):

    {"ev": "enter", "u": U, "t": ...}      about to enter ``with run.update()`` for update U
    {"ev": "forward", "u": U, "t": ...}    its forward returned (the backward, FSDP's all-reduces, follows)
    {"ev": "backward", "u": U, "t": ...}   its backward returned (the vote, in ``optimizer.step``, follows)
    {"ev": "commit", "u": U, "t": ...}     update U committed on this rank (the ``with`` block ended)
    {"ev": "bug", "u": U, "t": ...}        this rank's training code is about to raise (``params.bench.bug``)

``params.bench.bug: [U, R]`` makes rank R's loss raise ``ValueError`` in update U (a bug in the script).
Every record carries the start (``SLURM_RESTART_COUNT``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [p for p in (str(Path(__file__).resolve().parents[2]),) if p not in sys.path]

from benchmarks.harness import common as h  # noqa: E402


class Bug(ValueError):
    """The injected bug of the training code."""


def main(job: Any) -> None:
    from benchmarks.parts.workload import decoder_parts, lm_loss

    plan = job.params["bench"]
    h.guard_rank(plan.get("deadline_s"))
    out = Path(plan["out"])
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / f"rank-{job.rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)

    def emit(ev: str, u: int) -> None:  # one write per record: complete even if the rank is killed right after
        os.write(fd, (json.dumps({"ev": ev, "u": u, "t": time.time(), "restart": restart}) + "\n").encode())

    parts = decoder_parts(job)
    run = job.protect(parts.model, parts.optimizer, scheduler=parts.scheduler, state={"data": parts.loader})
    bug = plan.get("bug")
    for tokens in run.batches(parts.loader):
        u = run.step + 1
        emit("enter", u)
        with run.update() as update:
            if bug and u == bug[0] and job.rank == bug[1] and restart == 0:
                emit("bug", u)
                raise Bug(f"the loss's shapes disagree in update {u} (injected)")
            loss = lm_loss(parts.model, tokens)
            emit("forward", u)
            loss.backward()
            emit("backward", u)
            update.loss = loss
            parts.optimizer.step()
            parts.optimizer.zero_grad(set_to_none=True)
            parts.scheduler.step()
        if run.step == u:
            emit("commit", u)
