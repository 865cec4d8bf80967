"""The reload's fast path: this rank's own boxes read from the snapshot's files straight into its live tensors.

The general reload (``get_state_dict``, ``dcp.load``, ``set_state_dict``: :func:`accelpact_slurm.runtime.state.
appstate.load`) costs, with FSDP1, an unshard of every unit on the way out and again on the way in (an all-gather
of every parameter and of every optimizer state), and copies every chunk three times (``torch.load`` into a fresh
tensor, into the state dict's, into the flat parameter).  Yet a snapshot holds each rank's boxes as it captured
them (:func:`ckpt_service.capture.fsdp1_plan`: a 1-D range of every parameter and of its optimizer states, cut into
rectangular boxes that DCP stores as chunks), so a rank of the same sharding finds its own state there, chunk for
box.  :func:`load` reads each box with ``preadv`` into the live tensor the box is a view of (the flat parameter's
shard, AdamW's moments): no collective, no intermediate tensor, each file in offset order with the kernel reading
ahead.  The small rest (module buffers, the optimizer's scalars and ``param_groups``, the extra state) comes
through ``dcp.load`` and is put in place as ``set_state_dict`` puts it.

Every data file is opened once and checked on that descriptor (:func:`ckpt_service.verified.open_checked`: hashed
unless it is the inode its daemon hashed, :mod:`.seal`); every read goes through those descriptors.  Each chunk must
be one uncompressed ``torch.save`` record of exactly its box (a contiguous tensor of the box's sizes at storage
offset 0, its data record exactly the box's bytes, little-endian).  Anything else (another sharding, FSDP2, a
compressed snapshot, a box without its chunk, a tensor of the snapshot the plan lacks, other param groups) and
:func:`load` returns None before it has changed any state: the general load runs.

Who calls: :func:`accelpact_slurm.runtime.state.appstate.load`.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import math
import os
import pickle
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from accelpact_slurm.core.errors import CheckpointError
from accelpact_slurm.core.events import lap
from ckpt_service import compat
from ckpt_service.capture import Plan, fsdp1_plan, live_buffers
from ckpt_service.verified import VerifiedReader, open_checked, reading_ahead, unpickle_metadata

#: A box read into the live tensor ``dst`` from ``nbytes`` at ``at`` of the data file ``name``.
Read = tuple[torch.Tensor, str, int, int]


def load(model: Any, optimizer: Any, path: str, key: bytes | None, checked: tuple[dict[str, Any], bytes],
         sealed: Mapping[str, Any] | None, parts: dict[str, Any] | None = None,
         gather: Callable[[str], Sequence[Any]] | None = None) -> dict[str, Any] | None:
    """Restore ``model`` and ``optimizer`` from the snapshot at ``path`` in place and return its extra state
    (``{"json": ...}``), or None when the fast path does not apply (nothing changed; see the module).
    ``checked``: :func:`ckpt_service.verified.verified_metadata_bytes` of it.

    ``gather``: every rank's word on the fast path (``"ok"``, ``"no"`` or what went wrong), in one round of the job
    (the control plane).  The ranks then take the same way: in place on every rank or on none, since the general load
    is collective (FSDP's all-gathers) and a rank that took the fast path alone would leave its peers waiting there.
    Without it (one process, a test) this rank decides alone.

    Raises:
        CheckpointError: a file fails its check or ends early, here or (``gather``) on another rank (the
            environment's: the start ends on every rank).
    """
    parts = {} if parts is None else parts
    fresh = not optimizer.state  # the state _prepare makes, unwritten, goes again if the general load runs

    def declined() -> None:
        if fresh:
            optimizer.state.clear()  # get_state_dict then makes it as it always does

    with contextlib.ExitStack() as stack:
        try:
            ready = _prepare(model, optimizer, path, key, checked, sealed, parts, stack)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            declined()
            if gather is not None:  # the others must not wait for this rank's word, nor go on without it
                gather(f"{type(exc).__name__}: {exc}")
            raise
        if gather is not None:
            words = list(gather("ok" if ready is not None else "no"))
            failed = [(r, w) for r, w in enumerate(words) if w not in ("ok", "no")]
            if failed:
                declined()
                raise CheckpointError(f"the reload in place failed on rank {failed[0][0]}: {failed[0][1]}")
            if any(w != "ok" for w in words):
                declined()
                return None
        if ready is None:
            declined()
            return None
        located, small, opened = ready
        t0 = time.monotonic()
        for name, at, dst in sorted(located, key=lambda x: (x[0], x[1])):
            _read_into(opened[name], dst, at, name)
        t0 = lap(parts, "read_s", t0)
    _put_small(model, optimizer, small)
    _drop_foreign_state(model, optimizer)
    lap(parts, "put_s", t0)
    return small["extra"]


def _drop_foreign_state(model: Any, optimizer: Any) -> None:
    """No optimizer state for a parameter none of whose elements this rank holds, as after ``set_state_dict``
    (FSDP1 loads no state for it) and as in the run that saved the snapshot (such a parameter never gets a
    gradient here, so the optimizer never made state for it).  :func:`ckpt_service.compat.init_optim_state` made
    state for every parameter: the replay check's fingerprint and the final digest count it."""
    for fp in compat.fsdp1_flat_params(model):
        for p, info, _shape in compat.flat_param_parts(fp) or ():
            if not info.in_shard:
                optimizer.state.pop(p, None)


def _prepare(model: Any, optimizer: Any, path: str, key: bytes | None, checked: tuple[dict[str, Any], bytes],
             sealed: Mapping[str, Any] | None, parts: dict[str, Any], stack: contextlib.ExitStack
             ) -> tuple[list[tuple[str, int, torch.Tensor]], dict[str, Any], dict[str, int]] | None:
    """Everything :func:`load` needs before it writes a live tensor: ``(the boxes located in the files, the small
    rest loaded, the descriptors open on ``stack``)``, or None when the fast path does not apply.  Only the files
    that hold this rank's boxes or the small rest are opened (and checked)."""
    t0 = time.monotonic()
    if not compat.fsdp1_flat_params(model):
        return None
    manifest, _metadata_bytes = checked
    metadata = unpickle_metadata(checked[1])
    unwritten_optim_state(optimizer)  # AdamW's moments exist after a step only; every one of them is read below
    plan = fsdp1_plan(model, optimizer)
    reads = _reads(plan, metadata) if plan is not None else None
    if plan is None or reads is None:
        return None
    small_keys = _small_keys(plan)
    if not small_keys <= set(metadata.state_dict_metadata):
        return None
    names = sorted({name for _dst, name, _o, _n in reads} |
                   {info.relative_path for index, info in metadata.storage_data.items()
                    if index.fqn in small_keys or not index.fqn.startswith(("model.", "optim.state."))})
    if any(name not in manifest["files"] for name in names):
        return None
    opened: dict[str, int] = {}
    for name in names:
        fd, _ = open_checked(path, name, manifest["files"][name], sealed=sealed)
        stack.callback(os.close, fd)
        opened[name] = fd
    for name in names:  # the kernel reads every file ahead (all at once) while this rank does the rest
        stack.enter_context(reading_ahead(opened[name], int(manifest["files"][name]["size"])))
    t0 = lap(parts, "open_s", t0)
    located: list[tuple[str, int, torch.Tensor]] = []
    for dst, name, offset, length in sorted(reads, key=lambda r: (r[1], r[2])):  # each file front to back
        at = _payload(opened[name], offset, length, dst)
        if at is None:
            return None
        located.append((name, at, dst))
    t0 = lap(parts, "plan_s", t0)
    groups = [list(g["params"]) for g in plan.plain["optim"]["param_groups"]]
    small: dict[str, Any] = {"model": plan.plain["model"], "optim": plan.plain["optim"], "extra": {"json": ""}}
    dcp.load(small, storage_reader=VerifiedReader(path, key, checked, sealed, opened), no_dist=True)
    if [g.get("params") if isinstance(g, dict) else None for g in small["optim"]["param_groups"]] != groups:
        return None  # other parameter groups: the general load says what differs
    lap(parts, "small_s", t0)
    return located, small, opened


def unwritten_optim_state(optimizer: Any) -> None:
    """The optimizer's per-parameter state as :func:`ckpt_service.compat.init_optim_state` makes it (its keys and
    their order, dtypes, devices, scalars), its per-element tensors allocated but not written: the reload in place
    reads every element of them.  It is made by the real init on a stand-in optimizer of the same class and param
    groups whose parameters have two elements each, so it costs no step over the model (at 298M parameters the
    real init took about 3 s of a 10 s reload); a class that cannot be built from its param groups alone gets the
    real init.  Nothing when the optimizer has state already."""
    if optimizer.state:
        return
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    groups = []
    for g in optimizer.param_groups:
        stand_ins = []
        for p in g["params"]:
            q = torch.nn.Parameter(torch.zeros(2, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
            pairs.append((p, q))
            stand_ins.append(q)
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": stand_ins})
    try:
        stand_in = type(optimizer)(groups)
        compat.init_optim_state(stand_in)
    except Exception:  # its constructor wants more than param groups: the real init
        compat.init_optim_state(optimizer)
        return
    for p, q in pairs:
        if q in stand_in.state:
            optimizer.state[p] = {k: torch.empty_like(p, dtype=v.dtype) if isinstance(v, torch.Tensor) and
                                  v.shape == q.shape else (v.clone() if isinstance(v, torch.Tensor) else v)
                                  for k, v in stand_in.state[q].items()}


def _reads(plan: Plan, metadata: Any) -> list[Read] | None:
    """Every non-empty box of the plan with the file, offset and length of its chunk; None when one has none, or the
    snapshot holds a sharded tensor (optimizer state included) the plan does not."""
    out: list[Read] = []
    keys = set()
    for e in plan.entries:
        fqn = ".".join(e.key)
        keys.add(fqn)
        item = metadata.state_dict_metadata.get(fqn)
        if not isinstance(item, TensorStorageMetadata) or list(item.size) != list(e.shape) or \
                item.properties.dtype != e.dtype:
            return None
        chunks = {tuple(c.offsets): list(c.sizes) for c in item.chunks}
        for b in e.boxes:
            if not math.prod(b.sizes):
                continue
            if b.src is None:
                return None
            if chunks.get(tuple(b.offsets)) != list(b.sizes):
                return None
            info = metadata.storage_data.get(MetadataIndex(fqn, torch.Size(b.offsets)))
            if info is None or info.transform_descriptors:  # compressed (DCP's extension): the general load
                return None
            out.append((b.src, info.relative_path, int(info.offset), int(info.length)))
    small = _small_keys(plan)
    # a parameter this rank holds no element of gets no optimizer state here (as set_state_dict gives it none):
    # the node's other ranks' scalars of it (AdamW's step) are theirs
    foreign = {e.key[1] for e in plan.entries if e.key[0] == "model" and not any(math.prod(b.sizes) for b in e.boxes)}
    for fqn, item in metadata.state_dict_metadata.items():
        if fqn.startswith(("model.", "optim.state.")) and isinstance(item, TensorStorageMetadata) and \
                fqn not in keys and fqn not in small and \
                not (fqn.startswith("optim.state.") and fqn[len("optim.state."):].rpartition(".")[0] in foreign):
            return None
    return out


def _small_keys(plan: Plan) -> set[str]:
    """The flattened keys of the plan's plain tensors (module buffers, per-parameter optimizer scalars)."""
    out = {f"model.{k}" for k in plan.plain["model"]}
    for fqn, per in plan.plain["optim"]["state"].items():
        out |= {f"optim.state.{fqn}.{k}" for k, v in per.items() if isinstance(v, torch.Tensor)}
    return out


class _Slice(io.RawIOBase):
    """``length`` bytes at ``offset`` of ``fd`` as a seekable binary stream (one chunk's record), read with pread."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")[:max(0, self.length - self.pos)]
        n = os.preadv(self.fd, [view], self.offset + self.pos) if len(view) else 0
        self.pos += n
        return n


class _Peek(pickle.Unpickler):
    """The arguments of the one tensor a chunk's ``data.pkl`` rebuilds; refuses any other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_rest: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor's record")

    def persistent_load(self, pid: Any) -> Any:
        return tuple(pid)


def _payload(fd: int, offset: int, length: int, dst: torch.Tensor) -> int | None:
    """Where in the file the bytes of the chunk stored at ``offset`` begin, when its record holds exactly ``dst``'s
    box (a contiguous tensor of its sizes at storage offset 0, little-endian); else None."""
    try:
        reader = compat.record_reader(_Slice(fd, offset, length))
        records = set(reader.get_all_records())
        if "byteorder" in records and bytes(reader.get_record("byteorder")) != b"little":
            return None
        storage, start, size, stride = _Peek(io.BytesIO(bytes(reader.get_record("data.pkl")))).load()
        _tag, _kind, name, _where, numel = storage
        nbytes = dst.numel() * dst.element_size()
        want = tuple(math.prod(size[i + 1:]) for i in range(len(size)))
        if start != 0 or numel != dst.numel() or math.prod(size) != dst.numel() or \
                any(n > 1 and s != w for n, s, w in zip(size, stride, want)) or \
                reader.get_record_size(f"data/{name}") != nbytes:
            return None
        return offset + int(reader.get_record_offset(f"data/{name}"))
    except (RuntimeError, ValueError, TypeError, pickle.UnpicklingError, EOFError, OSError):
        return None


def _read_into(fd: int, dst: torch.Tensor, at: int, name: str) -> None:
    """``dst``'s bytes from ``at`` of ``fd`` (through a host buffer when ``dst`` is not contiguous CPU memory)."""
    nbytes = dst.numel() * dst.element_size()
    host = dst if dst.device.type == "cpu" and dst.is_contiguous() else torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview((ctypes.c_char * nbytes).from_address(host.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], at + done)
        if n <= 0:
            raise CheckpointError(f"{name} ends at {at + done}, inside a chunk of {nbytes} bytes (truncated)")
        done += n
    if host is not dst:
        dst.copy_(host.view(dst.dtype).view(dst.shape))


def _put_small(model: Any, optimizer: Any, small: dict[str, Any]) -> None:
    """Module buffers, per-parameter optimizer scalars and param-group values in place, as ``set_state_dict`` and
    ``Optimizer.load_state_dict`` put them (a tensor state keeps the dtype and device the optimizer gave it)."""
    params = {compat.canonical_fqn(model, n): p for n, p in model.named_parameters()}
    with torch.no_grad():
        buffers = small["model"]
        for fqn, buf in live_buffers(model):
            if fqn in buffers:
                buf.copy_(buffers[fqn])
        for fqn, per in small["optim"]["state"].items():
            state = optimizer.state[params[fqn]]
            for k, v in per.items():
                cur = state.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) and cur.shape == v.shape:
                    cur.copy_(v)
                else:
                    state[k] = v
    for group, saved in zip(optimizer.param_groups, small["optim"]["param_groups"]):
        for k, v in saved.items():
            if k != "params":
                group[k] = v
