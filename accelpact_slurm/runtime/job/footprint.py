"""The job's memory footprint, predicted at ``job.protect``, against the memory its host can give.

When ``protect`` runs, a rank holds its shard of the weights and the framework; what it has not allocated yet is
what the first updates and the first snapshot add.  Per rank, from the bytes of its local shard of the parameters
(``W``, the element size as the model has it) and the optimizer's number of per-parameter states (``n``, AdamW 2):

- gradients ``W``; optimizer state ``n x W`` (allocated at the first ``optimizer.step``);
- with snapshots: one staging slot in shared memory, ``(1 + n) x W``, and at the job's first snapshot the capture
  proof's transient copy of the same size (``docs/checkpoints.md``).

Not counted: FSDP's all-gathered parameters and gradients of the unit that runs (one block with per-block wrapping),
activations, the daemon's write buffers, a user's ``Stateful`` objects.  The figures are a floor, not a bound.

Every rank sends its prediction with its host's and its memory cgroup's headroom (``MemAvailable``; the cgroup's
limit less its usage) over the control plane; the lead sums the ranks that share a host and a cgroup (a Slurm
job's cgroup per node; the embedded default's emulated nodes on one machine) and warns, once on the console and as
a ``warning`` event, where the sum exceeds that headroom.  The ``footprint`` event holds rank 0's prediction,
the host with the least room to spare, and every shortfall.
"""

from __future__ import annotations

import socket
from typing import Any

import torch

from accelpact_slurm.runtime.detection import oom

#: Per-parameter states of torch's optimizers (their ``state`` entries the size of the parameter).
OPTIMIZER_STATES = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Adagrad": 1,
                    "RMSprop": 1, "Rprop": 2, "ASGD": 2, "SGD": 1}
#: For an optimizer this table does not name, and no state yet to count: assume AdamW's.
UNKNOWN_STATES = 2
#: A cgroup v1 limit this large is no limit (the kernel's "unlimited" page-rounded).
NO_LIMIT = 1 << 60


def local_bytes(model: torch.nn.Module) -> int:
    """The bytes of this rank's local shard of every parameter (a DTensor's local part; FSDP1's views)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def optimizer_states(optimizer: torch.optim.Optimizer) -> tuple[int, bool]:
    """Per-parameter states of ``optimizer`` and whether the count is known (from its state or the table)."""
    for st in optimizer.state.values():  # already stepped (or loaded): count what is there
        return sum(1 for v in st.values() if torch.is_tensor(v) and v.dim() > 0), True
    name = type(optimizer).__name__
    n = OPTIMIZER_STATES.get(name)
    if name == "SGD":
        n = 1 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    if n is not None and any(g.get("amsgrad") for g in optimizer.param_groups):
        n += 1
    return (UNKNOWN_STATES, False) if n is None else (n, True)


def predict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, snapshots: bool) -> dict[str, Any]:
    """This rank's prediction: the bytes it will add after ``protect``, part by part."""
    w = local_bytes(model)
    n, known = optimizer_states(optimizer)
    parts = {"gradients": w, "optimizer": n * w}
    if snapshots:
        parts["staging"] = parts["proof"] = (1 + n) * w
    return {"weights": w, "optimizer_states": n, "states_known": known, "parts": parts,
            "adds": sum(parts.values())}


def headroom() -> dict[str, Any]:
    """Where this rank runs and what it may still allocate: its host, ``MemAvailable``, its memory cgroup's
    directory and limit less usage (None where there is no limit or none can be read)."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cg = oom.memory_cgroup()
    left = None
    if cg is not None:
        limit = oom.read_int(cg, "memory.max", "memory.limit_in_bytes")
        usage = oom.read_int(cg, "memory.current", "memory.usage_in_bytes")
        if limit is not None and limit < NO_LIMIT and usage is not None:
            left = max(0, limit - usage)
    return {"host": socket.gethostname(), "available": avail, "cgroup": cg, "cgroup_left": left}


def by_host(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (host, memory cgroup with a limit): its ranks, what they will add together, and what is left there (the
    smaller of ``MemAvailable`` and the cgroup's headroom; None where neither was read).  ``records``: per rank,
    the prediction and the headroom merged, with its ``rank``."""
    groups: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["host"], r["cgroup"] if r.get("cgroup_left") is not None else None), []).append(r)
    out = []
    for (host, cg), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        have = [min(vals) for vals in ([r[k] for r in rs if r.get(k) is not None] for k in ("available", "cgroup_left"))
                if vals]
        out.append({"host": host, "cgroup": cg, "ranks": sorted(r["rank"] for r in rs),
                    "adds": sum(r["adds"] for r in rs), "left": min(have) if have else None,
                    "weights": sum(r["weights"] for r in rs)})
    return out


def shortfalls(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups of :func:`by_host` whose ranks would add more than is left there."""
    return [g for g in groups if g["left"] is not None and g["adds"] > g["left"]]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def describe(short: dict[str, Any]) -> str:
    where = short["host"] + (f" (memory cgroup {short['cgroup']})" if short["cgroup"] else "")
    return (f"{where}: ranks {short['ranks']} will add about {_gib(short['adds'])} after their start (gradients, "
            f"optimizer state, the snapshot's staging and its first capture proof, for {_gib(short['weights'])} "
            f"of weights) but only {_gib(short['left'])} is left: expect the kernel's OOM killer at the first "
            f"updates or the first snapshot; use fewer ranks per node or more nodes, a smaller model, or more "
            f"memory (docs/checkpoints.md#memory)")


def check(model: torch.nn.Module, optimizer: torch.optim.Optimizer, job: Any, *,
          snapshots: bool) -> list[dict[str, Any]]:
    """Collective over ``job``'s ranks: predict, gather, and (on the lead) record every prediction in the
    ``footprint`` event and warn of every shortfall."""
    mine = {"rank": job.rank, **predict(model, optimizer, snapshots=snapshots), **headroom()}
    records = job._rt.control.all_gather("footprint", mine)
    if not job.is_lead:
        return []
    groups = by_host(records)
    short = shortfalls(groups)
    tightest = max(groups, key=lambda g: g["adds"] / g["left"] if g["left"] else 0.0)
    job.events.emit("footprint", rank0={k: mine[k] for k in ("weights", "optimizer_states", "states_known", "parts",
                                                             "adds")},
                    groups=len(groups), tightest=tightest, shortfalls=short)
    for g in short:
        text = describe(g)
        print(f"[accelpact] warning: {text}", file=job._out, flush=True)
        job.events.emit("warning", step=None, reason=text)
    return short
