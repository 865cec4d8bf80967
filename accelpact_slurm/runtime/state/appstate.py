"""The non-tensor part of a rank's application state, and the load path of a snapshot.

The tensors (weights, optimizer state) are captured by :mod:`ckpt_service.capture`.  Everything
else travels as one JSON document per snapshot (``{"run": ..., "ranks": {rank: ...}}``):

- ``run``: what every rank shares at a committed boundary (frontier, epoch, per-update losses);
- ``ranks[r]``: rank r's RNG states (CPU and, where present, CUDA) and the ``state_dict()`` of every
  ``Stateful`` the user passed to ``job.protect`` (scheduler, data loader, own counters).

:func:`encode` turns a state dict into JSON-able data (tensors as base64 with dtype and shape) and names the offending
object and key when something cannot be saved (:class:`UsageError`). :func:`load` (collective) restores model and
optimizer with stock ``dcp.load`` into the sharded state dict and ``set_state_dict``, then returns the JSON document.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import random
import time
from typing import Any, Mapping

import torch

from accelpact_slurm.core.errors import CheckpointError, UsageError
from accelpact_slurm.core.events import lap
from accelpact_slurm.core.torch_warnings import quiet_state_dict_calls
from accelpact_slurm.runtime.state.buffers import buffer_items
from ckpt_service import inplace, seal
from ckpt_service.verified import VerifiedReader, unpickle_metadata, verified_metadata_bytes
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)

EXTRA = "extra"
_TENSOR = "__tensor__"


def encode(value: Any, where: str) -> Any:
    """JSON-able copy of ``value`` (a state dict); raises :class:`UsageError` naming ``where`` and the key."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        return {_TENSOR: base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes()).decode(),
                "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise UsageError(where, f"key {k!r} of type {type(k).__name__}", "use str or int keys in state_dict()")
            out[("i:" if isinstance(k, int) else "s:") + str(k)] = encode(v, f"{where}.{k}")
        return {"__dict__": out}
    if isinstance(value, (list, tuple)):
        if all(type(v) is int for v in value):  # the same, at once: an RNG state is a list of 625 ints
            return {"__list__": list(value), "tuple": isinstance(value, tuple)}
        return {"__list__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)],
                "tuple": isinstance(value, tuple)}
    raise UsageError(where, type(value).__name__,
                     "state_dict() must hold only numbers, strings, booleans, None, tensors, lists and dicts; "
                     "keep functions and other objects out of it (a LambdaLR's lambda is dropped by torch itself)")


def decode(value: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(value, dict):
        if _TENSOR in value:
            raw = bytearray(base64.b64decode(value[_TENSOR]))
            dtype = getattr(torch, value["dtype"])
            flat = torch.frombuffer(raw, dtype=torch.uint8).clone() if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(value["shape"])
        if "__float__" in value:
            return float(value["__float__"])
        if "__dict__" in value:
            return {(int(k[2:]) if k.startswith("i:") else k[2:]): decode(v) for k, v in value["__dict__"].items()}
        if "__list__" in value:
            items = [decode(v) for v in value["__list__"]]
            return tuple(items) if value.get("tuple") else items
    return value


def statefuls(scheduler: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """Every object ``job.protect`` was given to save beside the tensors (``scheduler=`` and ``state=``) by name,
    checked now so that a bad one fails at start, not at a snapshot.

    Raises:
        UsageError: naming the object (``scheduler``, ``state['NAME']``) and the fix.
    """
    out: dict[str, Any] = {}
    if scheduler is not None:
        if "scheduler" in state:
            raise UsageError("state['scheduler']", "given twice", "pass the scheduler once: scheduler= or in state")
        out["scheduler"] = scheduler
    for name, obj in state.items():
        if not isinstance(name, str):
            raise UsageError("state", repr(name), "name every Stateful with a string key")
        out[name] = obj
    for name, obj in out.items():
        what = "scheduler" if name == "scheduler" and obj is scheduler else f"state[{name!r}]"
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UsageError(what, type(obj).__name__,
                             "pass an object with state_dict() and load_state_dict() (DCP's Stateful protocol), "
                             "e.g. torchdata's StatefulDataLoader")
        try:
            encode(obj.state_dict(), what)
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(what, type(obj).__name__, f"its state_dict() cannot be saved: {exc}") from exc
    return out


def seed_all(seed: int) -> None:
    """Seed every generator a training step may draw from: torch (CPU and CUDA), Python's, NumPy's."""
    torch.manual_seed(seed)
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)


def rng_state() -> dict[str, Any]:
    """This rank's RNG states (torch CPU and CUDA, Python's ``random``, NumPy's global), JSON-able."""
    out = {"cpu": encode(torch.get_rng_state(), "rng.cpu"), "python": encode(random.getstate(), "rng.python")}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # pragma: no cover - GPU only
        out["cuda"] = [encode(torch.cuda.get_rng_state(), "rng.cuda")]  # this rank's GPU only
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]  # uint32: Python ints
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(decode(state["cpu"]))
    if "python" in state:
        random.setstate(decode(state["python"]))
    if "cuda" in state and torch.cuda.is_available():  # pragma: no cover - GPU only
        torch.cuda.set_rng_state(decode(state["cuda"][0]))
    np = _numpy()
    if "numpy" in state and np is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def rng_snapshot() -> tuple[Any, ...]:
    """This rank's RNG states as live objects (cheap; no encoding): taken as every update begins, so that an
    update discarded by an L1 repair runs again with the random numbers it first drew (dropout masks)."""
    np = _numpy()
    # The rank's own GPU only: the *_all variants would create a context on every GPU the rank can see.
    cuda = (torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None)  # pragma: no branch - GPU only
    return (torch.get_rng_state(), random.getstate(), np.random.get_state() if np is not None else None, cuda)


def rng_equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two :func:`rng_snapshot` results are the same states (no random number drawn between them)."""
    (cpu, py, npy, cuda), (cpu2, py2, npy2, cuda2) = a, b
    if not torch.equal(cpu, cpu2) or py != py2 or (npy is None) != (npy2 is None) or (cuda is None) != (cuda2 is None):
        return False
    if npy is not None and (npy[0] != npy2[0] or tuple(npy[2:]) != tuple(npy2[2:]) or
                            not (npy[1] == npy2[1]).all()):
        return False
    return cuda is None or torch.equal(cuda, cuda2)


def keep_rng(snap: Any) -> None:
    """Test-only (``ACCELPACT_TEST_SKIP_REDO_RNG``): a redo draws on from where the discarded attempt left the RNG."""


def loss_value(loss: Any) -> float | None:
    """``update.loss`` as one number (None when not set)."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise UsageError("update.loss", f"a tensor of shape {tuple(loss.shape)}", "report one number (a 0-d tensor)")
        return float(loss.detach())
    return None if loss is None else float(loss)


def rng_restore(snap: tuple[Any, ...]) -> None:
    """Inverse of :func:`rng_snapshot`."""
    cpu, py, npy, cuda = snap
    torch.set_rng_state(cpu)
    random.setstate(py)
    np = _numpy()
    if npy is not None and np is not None:
        np.random.set_state(npy)
    if cuda is not None:  # pragma: no cover - GPU only
        torch.cuda.set_rng_state(cuda)


def rank_state(ranks: dict[str, Any], rank: int, seed: int, frontier: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(saved state, RNG state)`` rank ``rank`` resumes with, on any allocation.  Pure but for the seeding.

    The rule for a resume on another allocation (fewer or more nodes, other ranks per node):

    - a rank that existed when the snapshot was taken (``rank < saved world``) takes its own saved
      RNG states and ``Stateful`` states, as on the same allocation;
    - a rank that did not exist takes the ``Stateful`` states of rank ``rank % saved world`` (a
      scheduler and a data loader's position in the pass are the same on every rank) and fresh RNG
      states seeded from ``(seed, rank, frontier)``: reproducible, and distinct from every other
      rank's and from the streams the run drew before.
    """
    saved = ranks.get(str(rank))
    if saved is not None:
        return saved, saved["rng"]
    world = len(ranks)
    donor = ranks[str(rank % world)]
    seed_all(new_rank_seed(seed, rank, frontier))  # the caller sets the returned state right after
    return donor, rng_state()


def new_rank_seed(seed: int, rank: int, frontier: int) -> int:
    """The seed of a rank that did not exist when the snapshot was taken (documented in :func:`rank_state`)."""
    return (seed * 1_000_003 + rank * 7_919 + frontier * 104_729 + 1) % 2**63


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # the runtime's start-time check names it; here it only means nothing to save
        return None
    return numpy


def load(model: Any, optimizer: Any, path: str, key: bytes | None = None, *, verified: bool = True,
         parts: dict[str, Any] | None = None, control: Any = None) -> dict[str, Any]:
    """Collective: restore model and optimizer from the DCP directory ``path``; return the extra document.

    DCP reads through :func:`ckpt_service.verified.VerifiedReader`: the manifest authenticated under the
    run's ``key``, ``.metadata`` unpickled from the very bytes checked against it, every data file hashed
    on the descriptor DCP then reads, but for a file that is still the inode the node's daemon hashed when it
    verified the snapshot (:mod:`ckpt_service.seal`).  Where this rank's sharding is the one that saved the
    snapshot (FSDP1), its own boxes are read straight into its live tensors (:mod:`ckpt_service.inplace`: no
    state-dict round trip, no collective; ``parts["inplace"]`` has its parts; with the job's ``control`` plane, one
    round of it makes every rank take the same way: in place everywhere or nowhere).  Else one pass over the files:
    the extra state is read with the tensors (first, on its own, only for a snapshot whose model state lacks some
    of the model's keys).
    ``verified=False`` (test-only: the negative control of the corruption test, with
    ``TestFaults.skip_reload_check``) reads with stock ``FileSystemReader``.  ``parts`` gets the seconds of
    each part (``metadata_s``, ``state_dict_s``, ``extra_s``, ``read_s``, ``set_state_dict_s``).

    Raises:
        CheckpointError: the snapshot does not pass on the handles it was read from (e.g. replaced after the
            re-check): the start ends and the next one re-checks it.
    """
    parts = {} if parts is None else parts
    t0 = time.monotonic()
    checked = verified_metadata_bytes(path, key) if verified else None  # .metadata read once, for both loads
    sealed = seal.read(path, key, checked[0]) if checked is not None else None
    t0 = lap(parts, "metadata_s", t0)

    def reader() -> Any:
        return VerifiedReader(path, key, checked, sealed) if verified else dcp.FileSystemReader(path)

    def run(state: dict[str, Any]) -> None:
        try:
            dcp.load(state, storage_reader=reader(), no_dist=True)
        except BaseException as exc:  # DCP wraps what its reader raised (in a BaseException): say what failed, as ours
            ours = _checkpoint_error(exc)
            if ours is None:
                raise
            raise CheckpointError(f"{path}: {ours}") from exc

    if checked is not None:  # this rank's own boxes straight into its live tensors, where the sharding is the same
        fast: dict[str, Any] = {}
        gather = None if control is None else lambda word: control.all_gather("reload-inplace", word)
        extra = inplace.load(model, optimizer, path, key, checked, sealed, fast, gather)
        parts["inplace"] = fast
        if extra is not None:
            return json.loads(extra["json"])
        t0 = time.monotonic()
    with quiet_state_dict_calls():  # torch's deprecation noise on a group pair's ShardedTensors, on every rank
        msd, osd = get_state_dict(model, optimizer)
        t0 = lap(parts, "state_dict_s", t0)
        saved = _saved_keys(path, checked, verified)
        ex: dict[str, Any] = {EXTRA: {"json": ""}}
        kept: dict[str, Any] = {}
        if any(f"model.{k}" not in saved for k in msd):  # the extra state first: it may hold what the model lacks
            run(ex)
            kept = _buffers_from_ranks(model, msd, saved, json.loads(ex[EXTRA]["json"]), path)
            t0 = lap(parts, "extra_s", t0)
        sd = {"model": {k: v for k, v in msd.items() if k not in kept}, "optim": osd}
        run(sd if ex[EXTRA]["json"] else {**sd, **ex})  # one pass over the files, the extra state with the tensors
        doc = json.loads(ex[EXTRA]["json"])
        t0 = lap(parts, "read_s", t0)
        sd["model"].update(kept)  # as they are: every rank's own copy is put in place after this load
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        lap(parts, "set_state_dict_s", t0)
    return doc


def _saved_keys(path: str, checked: Any, verified: bool) -> set[str]:
    """The flattened keys the snapshot holds (``model.<fqn>``, ...), from its verified ``.metadata``."""
    if verified:
        metadata = unpickle_metadata(checked[1])
    else:  # test-only: the stock reader's own read
        metadata = dcp.FileSystemReader(path).read_metadata()
    return set(metadata.state_dict_metadata)


def _buffers_from_ranks(model: Any, msd: dict[str, Any], saved: set[str], doc: dict[str, Any],
                        path: str) -> dict[str, Any]:
    """The buffers of ``msd`` the snapshot's model state lacks but every saved rank's own part holds, by name:
    left out of the load (each rank's own copy is put back after it).

    A snapshot taken by FSDP1's capture with ``use_orig_params=True`` before it captured module buffers holds
    none in its model state; every buffer the training changed is in every rank's part, so such a snapshot
    still restores exactly.  A missing key that is not such a buffer is left to the load, which names it.
    """
    absent = [k for k in msd if f"model.{k}" not in saved]
    if not absent:
        return {}
    persistent = {name for name, _buf in buffer_items(model)}
    ranks = [(r.get("buffers") or {}).get("__dict__") or {} for r in (doc.get("ranks") or {}).values()]
    covered = [k for k in absent if k in persistent and ranks and all(f"s:{k}" in own for own in ranks)]
    if len(covered) != len(absent):
        return {}  # the load raises, naming a key the snapshot lacks
    log.warning("snapshot %s holds no shared copy of %d buffer(s) (%s, ...: taken before FSDP1's capture saved "
                "module buffers); every rank's own copy is in it and is put back", path, len(covered), covered[0])
    return {k: msd[k] for k in covered}


def _checkpoint_error(exc: BaseException) -> BaseException | None:
    """The :class:`CheckpointError` inside what ``dcp.load`` raised (its ``CheckpointException`` keeps each
    rank's exception in ``failures``, as the exception or as ``(exception, traceback)``)."""
    if isinstance(exc, CheckpointError):
        return exc
    for failure in (getattr(exc, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, CheckpointError):
            return inner
    return None


def skip_extra(path: str, mine: Any, rng: Any) -> None:
    """Test-only (``ACCELPACT_TEST_SKIP_EXTRA_RESTORE``): the extra state of a snapshot is not restored."""
    log.warning("extra state not restored (test-only fault injection)")
