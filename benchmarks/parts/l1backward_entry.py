"""L1 backward benchmark, the entry point of our jobs' ranks (``benchmarks/parts/l1backward.py``).

``accelpact-run JOB.yaml [--inject-fault PHASE:STEP:RANK]`` calls :func:`main` on every rank: the job file
is the decoder example's (``examples/decoder/job.yaml``) with this entry point, and its ``params.bench`` holds
the plan.  Each rank builds exactly what the example builds (``benchmarks.parts.workload.decoder_parts``: FSDP1
HYBRID_SHARD ``CausalDecoder`` on the job's mesh, AdamW, the warm-up + cosine schedule, the data loader),
hands it to ``job.protect`` with the same state, and runs the example's update body, timed:

    forward    from entering ``with run.update()`` to the loss (the forward and the loss)
    backward   ``loss.backward()``: FSDP's reduce-scatter on the shard group and all-reduce on the
               replication group run inside it (Gloo on the CPU: synchronously)
    boundary   from the end of the backward to the end of the guard's decision, which the library takes
               in its own ``optimizer.step`` pre-hook: the boundary all-reduce on the replication group and
               the world's vote over the control plane (our pre-hook is registered after it, so it runs
               once the decision is taken)
    step       the optimizer step itself (our pre-hook to our post-hook)
    after      from the end of the step to the end of the ``with`` block: ``zero_grad``, the schedule step
               and the commit (the step event, a snapshot every ``checkpoint.every_steps``)

Every rank appends one JSON line per attempt of an update to the plan's ``out`` (an attempt the vote
discarded has no ``step`` and ``after``); ``gap`` is the time outside the update before it (the next batch).

``xnode`` lists every data-plane collective of the attempt that crosses nodes (a group whose ranks sit on more
than one node: the replication group, or the default group), as ``[where, name, start, end]`` in seconds from
the attempt's start (negative: before it, in ``gap``); ``where`` is the phase it was issued in (``gap``,
``forward``, ``backward``, ``decision``, ``step``, ``after``).  They are recorded by wrapping the collectives of
``torch.distributed`` (and ``torch.distributed.distributed_c10d``, so that ``all_gather_object``'s inner
``all_gather`` is one call, not two) in this process: the call still goes to torch, with two clock reads around
it.  This is where a failed inter-node link is first seen: nothing notices it until the next such collective.
``step_fault: [U, R]`` makes rank R's optimizer step of update U raise (after the vote: every other rank steps):
a fault in the optimizer step, which the fault table leaves to L2 (``--inject-fault`` has no such phase).
``xnode_fault: [U, R]`` makes rank R withhold its part of the first cross-node collective issued after update
U's optimizer step (it raises instead of joining; its peers time out in theirs): with U the first snapshot of
a start, that is the capture proof's ``get_state_dict`` (see ``ckpt_service.client``), a collective on the
default group that ``--inject-fault`` cannot reach.
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


#: The collectives of ``torch.distributed`` that are watched, and where their ``group`` argument sits.
WATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
           "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "gather_object", "gather",
           "scatter", "barrier", "all_to_all_single", "reduce")


class StepFault(RuntimeError):
    """The injected fault inside the optimizer step."""


class CrossNodeFault(RuntimeError):
    """The injected fault in a cross-node collective after the optimizer step."""


class CrossNodeLog:
    """Wraps the watched collectives; keeps ``[where, name, start, end]`` (``perf_counter``) of each outermost
    call on a group spanning more than one node, ``where`` being :attr:`where` when it was issued."""

    def __init__(self, ranks_per_node: int, num_nodes: int) -> None:
        self.rpn, self.multi = ranks_per_node, num_nodes > 1
        self.where = "gap"
        self.u = 0
        self.calls: list[list[Any]] = []
        self.withhold: int | None = None  # this rank withholds its part after update ``withhold``'s step
        self._depth = 0

    def crosses(self, group: Any) -> bool:
        import torch.distributed as dist

        if group is None or group is dist.GroupMember.WORLD:
            return self.multi
        try:
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):  # a group this rank is not in, or already destroyed
            return False
        return len({r // self.rpn for r in ranks}) > 1

    def install(self) -> None:
        import inspect

        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name in WATCHED:
            real = getattr(c10d, name, None)
            if real is None:
                continue
            params = list(inspect.signature(real).parameters)
            wrapped = self._wrap(name, real, params.index("group") if "group" in params else None)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is real:
                    setattr(mod, name, wrapped)

    def _wrap(self, name: str, real: Any, pos: int | None) -> Any:
        import functools

        @functools.wraps(real)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return real(*args, **kwargs)
            group = kwargs["group"] if "group" in kwargs else (args[pos] if pos is not None and len(args) > pos
                                                               else None)
            if not self.crosses(group):
                return real(*args, **kwargs)
            if self.withhold is not None and self.withhold == self.u and self.where == "after":
                self.withhold = None
                raise CrossNodeFault(f"injected: this rank withheld its part of {name} on a cross-node group "
                                     f"after update {self.u}'s optimizer step")
            self._depth += 1
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self._depth -= 1
                self.calls.append([self.where, name, t, time.perf_counter()])

        return call

    def take(self, t0: float) -> list[list[Any]]:
        """The calls since the last take, relative to ``t0``."""
        out = [[w, n, round(a - t0, 6), round(b - t0, 6)] for w, n, a, b in self.calls]
        self.calls.clear()
        return out


def main(job: Any) -> None:
    from benchmarks.parts.workload import decoder_parts, lm_loss

    plan = job.params.get("bench") or {}
    h.guard_rank(plan.get("deadline_s"))
    topo = job.config.topology
    xlog = CrossNodeLog(topo.ranks_per_node, topo.nodes)
    xlog.install()
    xfault = plan.get("xnode_fault")
    if xfault and int(xfault[1]) == job.rank:
        xlog.withhold = int(xfault[0])
    parts = decoder_parts(job)
    model, opt, sched = parts.model, parts.optimizer, parts.scheduler
    run = job.protect(model, opt, scheduler=sched, state={"data": parts.loader})
    fault = tuple(plan["step_fault"]) if plan.get("step_fault") else None
    fd = os.open(plan["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)  # the emulated Slurm environment's
    marks: dict[str, float] = {}
    current = {"u": 0}

    def pre_step(*_: Any) -> None:  # registered after the library's hook: the decision has been taken
        marks["voted"] = time.perf_counter()
        xlog.where = "step"
        if fault == (current["u"], job.rank):
            raise StepFault(f"injected: rank {job.rank}'s optimizer step of update {current['u']} raised")

    def post_step(*_: Any) -> None:
        marks["stepped"] = time.perf_counter()
        xlog.where = "after"

    opt.register_step_pre_hook(pre_step)
    opt.register_step_post_hook(post_step)
    last_end = None
    for tokens in run.batches(parts.loader):
        marks.clear()
        t0 = time.perf_counter()
        xlog.where = "forward"
        with run.update() as update:
            current["u"] = xlog.u = update.step
            loss = lm_loss(model, tokens)
            marks["forward"] = time.perf_counter()
            xlog.where = "backward"
            loss.backward()
            marks["backward"] = time.perf_counter()
            xlog.where = "decision"
            update.loss = loss  # before the step: it travels in the update's vote
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        end = time.perf_counter()
        xlog.where = "gap"
        rec: dict[str, Any] = {"u": current["u"], "rank": job.rank, "restart": restart,
                               "gap": None if last_end is None else t0 - last_end, "xnode": xlog.take(t0)}
        last_end = end
        if "forward" in marks:
            rec["forward"] = marks["forward"] - t0
        if "backward" in marks:
            rec["backward"] = marks["backward"] - marks["forward"]
        if "voted" in marks:
            rec["boundary"] = marks["voted"] - marks["backward"]
        if "stepped" in marks:
            rec["step"] = marks["stepped"] - marks["voted"]
            rec["after"] = end - marks["stepped"]
        else:
            rec["discarded"] = True
            rec["until_redo"] = end - t0
        os.write(fd, (json.dumps(rec) + "\n").encode())
    os.close(fd)
