"""A verified snapshot in a format users load elsewhere: one ``torch.save`` file or one ``.safetensors`` file.

Who calls: ``accelpact-ckpt export`` (:mod:`accelpact_slurm.cli.ckpt`), once, in one process, with no job running;
nothing here is collective and no model is built.

Only a snapshot recorded ``verified`` is exported, and only after its manifest is authenticated under the run's key,
every file matches its checksum and ``.metadata`` covers every tensor (:func:`ckpt_service.verify.verify_snapshot`):
one still ``committed``, one ``rejected`` (a replay check's rejection passes the checksums), one another user planted
(its ``.metadata`` is a pickle: never unpickled unauthenticated) is refused with the reason.

The formats (:data:`FORMATS`): ``torch``, the whole snapshot (``model``, ``optim``, ``extra``) as one nested dict, as
stock ``dcp_to_torch_save`` converts it (through the verified reader), plus ``export``, the metadata below;
``safetensors``, the model's state dict only (weights and persistent buffers), unsharded, under the script's model's
own names (``get_state_dict``'s, no FSDP prefix), each tensor in its own dtype (bf16 as ``BF16``), read through
:func:`ckpt_service.verified.VerifiedReader` and written by :mod:`.safetensors_file` (no extra dependency).

Buffers: a node's snapshot holds one copy of each buffer (its first rank's) plus every rank's own changed buffers in
its extra state; both formats hold rank 0's, as torch's full state dict gives, whichever node's copy is exported (the
metadata's ``buffers``, ``buffers_rank`` say so).  A fresh model loads either file with ``strict=True`` and computes
what rank 0's trained model computes.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import warnings
from typing import Any

from accelpact_slurm.core.errors import CheckpointError
from ckpt_service import safetensors_file
from ckpt_service.compat import load_everything
from ckpt_service.index import read_record
from ckpt_service.layout import step_of
from ckpt_service.verified import VerifiedReader, unpickle_metadata, verified_metadata_bytes
from ckpt_service.verify import verify_snapshot

log = logging.getLogger(__name__)

#: The formats of ``accelpact-ckpt export --format``: what each file holds.
FORMATS = {
    "torch": "the whole snapshot (model, optimizer state, the run's extra state) as one torch.save file "
             "(as stock dcp_to_torch_save converts it); torch.load(OUT)['model'] is the model's state dict, buffers "
             "rank 0's; torch.load(OUT)['export'] says so",
    "safetensors": "the model's weights and persistent buffers only (buffers rank 0's: the metadata says so), "
                   "unsharded, under the model's own parameter names, each in its dtype (bf16 as BF16); loads "
                   "with safetensors.torch.load_file(OUT) and model.load_state_dict(strict=True)",
}
#: What DCP says when it loads without a process group (as the export does, in one process).
NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
#: The top-level key of the model's state dict in a snapshot (beside ``optim`` and ``extra``).
MODEL = "model"


def format_for(out: str, requested: str | None) -> str:
    """The format to write: ``requested``, else ``safetensors`` for an ``OUT`` ending in ``.safetensors``, else
    ``torch``.  Pure.

    Raises:
        CheckpointError: ``requested`` is not one of :data:`FORMATS`.
    """
    if requested is None:
        return "safetensors" if out.endswith(".safetensors") else "torch"
    if requested not in FORMATS:
        raise CheckpointError(f"format {requested!r} is not one of {', '.join(FORMATS)}")
    return requested


def check_exportable(path: str, key: bytes | None) -> str:
    """Refuse anything but a verified snapshot that passes its checks now; return what passed.

    ``key=None`` skips the manifest's authentication (only a test's negative control).

    Raises:
        CheckpointError: naming why: not a snapshot, not recorded verified, not authenticated, a file that
            fails its checksum, a tensor not covered.
    """
    rec = read_record(path)
    if rec is None:
        raise CheckpointError(f"{path} is not a step-NNNNNNNNNN snapshot directory")
    if rec.state != "verified":
        why = f" ({rec.reason})" if rec.reason else ""
        raise CheckpointError(f"it is {rec.state}{why}, not verified: only a verified snapshot is exported; "
                              f"accelpact-ckpt verify {path} checks it and records the result")
    ok, why = verify_snapshot(path, key)  # authenticated before anything is unpickled
    if not ok:
        raise CheckpointError(why)
    return why


def export_snapshot(path: str, out: str, fmt: str, key: bytes | None) -> str:
    """Export the verified snapshot at ``path`` to the file ``out`` in format ``fmt``; return one line saying what
    was written.

    Both formats hold every key of the model's ``state_dict()``, persistent buffers included; a buffer whose
    ranks differ (batch-norm statistics) is rank 0's, whichever node's copy ``path`` is (:func:`rank0_buffers`),
    and the file says so (the safetensors metadata, the torch file's ``export`` entry: :func:`export_metadata`).

    Raises:
        CheckpointError: the snapshot is refused (:func:`check_exportable`), or holds nothing the format can
            store (no model tensors, a dtype safetensors lacks), or rank 0's buffers do not fit its model.
        OSError: ``out`` could not be written.
    """
    fmt = format_for(out, fmt)
    check_exportable(path, key)
    with warnings.catch_warnings():  # one process on purpose: DCP's "assuming ... a single process" is no news
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
        if fmt == "torch":
            return _export_torch(path, out, key)
        tensors, skipped = model_state_dict(path, key)
        extra = extra_doc(path, key)
    own = rank0_buffers(extra)
    replaced = _overlay(tensors, own, path)
    step = step_of(path)
    meta = export_metadata(path, step, replaced, extra)
    size = safetensors_file.write(out, tensors, {"format": "pt", **meta})
    note = f"; not tensors, left out: {', '.join(skipped)}" if skipped else ""
    return (f"exported {path} -> {out} (safetensors, {len(tensors)} tensors, {size} bytes, buffers rank 0's "
            f"({replaced} of its own){note})")


def _export_torch(path: str, out: str, key: bytes | None) -> str:
    """The whole snapshot as one ``torch.save`` file (what stock ``dcp_to_torch_save`` writes, read through the
    verified reader), its ``model`` buffers rank 0's, with an ``export`` entry saying so."""
    import torch

    checked = verified_metadata_bytes(path, key)
    sd: dict[str, Any] = {}
    _load(lambda: sd.update(load_everything(VerifiedReader(path, key, checked))), path)
    if not isinstance(sd.get(MODEL), dict) or not sd[MODEL]:
        raise CheckpointError(f"{path} holds no model tensors (no '{MODEL}' entry in its .metadata)")
    extra = _parse_extra((sd.get("extra") or {}).get("json"), path)
    replaced = _overlay(sd[MODEL], rank0_buffers(extra), path)
    sd["export"] = export_metadata(path, step_of(path), replaced, extra)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        torch.save(sd, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return (f"exported {path} -> {out} (torch, {os.path.getsize(out)} bytes, buffers rank 0's "
            f"({replaced} of its own))")


#: What the metadata says of the buffers (safetensors metadata ``buffers``, the torch file's ``export``).
BUFFERS_NOTE = ("rank 0's: each rank's batch-norm statistics differ, and this file holds rank 0's (as torch's full "
                "state dict gives), whichever node's copy it was exported from")


def export_metadata(path: str, step: int, replaced: int, extra: dict[str, Any]) -> dict[str, str]:
    """The file's metadata (strings, as safetensors keeps them): the step, the snapshot, whose buffers."""
    return {"step": str(step), "source": os.path.basename(os.path.abspath(path)), "buffers": BUFFERS_NOTE,
            "buffers_rank": "0", "rank_buffers": str(replaced),
            "world_size": str(len(extra.get("ranks") or {}))}


def rank0_buffers(extra: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's own buffers from the snapshot's extra document (``ranks["0"]["buffers"]``: every persistent buffer
    rank 0's training changed, :mod:`accelpact_slurm.runtime.state.buffers`), as tensors by the model's names.

    The snapshot's model state holds one copy of each buffer, the node's first rank's: rank 0's on the first
    node, another rank's on the others.  A buffer rank 0 never changed is the same on every rank and not listed.
    """
    saved = ((extra.get("ranks") or {}).get("0") or {}).get("buffers")
    return _decode(saved) if saved else {}


def _overlay(model: dict[str, Any], own: dict[str, Any], path: str) -> int:
    """Put rank 0's buffers in place of the node's copy; returns how many.  A buffer the model state lacks is
    added (a snapshot FSDP1's capture took before it saved module buffers holds them in the ranks' parts only).

    Raises:
        CheckpointError: one of them differs in shape or dtype from the model state's.
    """
    for name, value in own.items():
        have = model.get(name)
        if have is not None and (tuple(have.shape) != tuple(value.shape) or have.dtype != value.dtype):
            raise CheckpointError(f"{path}: rank 0's buffer {name!r} is {tuple(value.shape)} {value.dtype}, the model "
                                  f"state's {tuple(have.shape)} {have.dtype}: the snapshot is inconsistent")
        model[name] = value
    return len(own)


def extra_doc(path: str, key: bytes | None) -> dict[str, Any]:
    """The snapshot's extra document (``{"run": ..., "ranks": ...}``), read through the verified reader."""
    import torch.distributed.checkpoint as dcp

    checked = verified_metadata_bytes(path, key)
    ex: dict[str, Any] = {"extra": {"json": ""}}
    _load(lambda: dcp.load(ex, storage_reader=VerifiedReader(path, key, checked), no_dist=True), path)
    return _parse_extra(ex["extra"]["json"], path)


def _parse_extra(text: Any, path: str) -> dict[str, Any]:
    try:
        doc = json.loads(text) if isinstance(text, str) and text else {}
    except ValueError as exc:
        raise CheckpointError(f"{path}: its extra state is not JSON ({exc})") from exc
    return doc if isinstance(doc, dict) else {}


def _decode(value: Any) -> Any:
    """The tensors of a per-rank buffer document, as :mod:`accelpact_slurm.runtime.state.appstate` encodes them
    (``{"__dict__": {"s:name": {"__tensor__": base64, "dtype", "shape"}}}``)."""
    import torch

    if isinstance(value, dict) and "__tensor__" in value:
        raw = bytearray(base64.b64decode(value["__tensor__"]))
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"a saved buffer has the unknown dtype {value['dtype']!r}")
        flat = torch.frombuffer(raw, dtype=torch.uint8).clone() if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(value["shape"])
    if isinstance(value, dict) and "__dict__" in value:
        return {k[2:]: _decode(v) for k, v in value["__dict__"].items()}
    raise CheckpointError(f"a saved buffer is not a tensor ({type(value).__name__})")


def _load(call: Any, path: str) -> None:
    """Run a ``dcp.load``; what the verified reader raised comes out as ours (DCP wraps it in a BaseException)."""
    try:
        call()
    except BaseException as exc:  # DCP wraps what the reader raised: say what failed, as ours
        inner = [f[0] if isinstance(f, tuple) else f for f in (getattr(exc, "failures", None) or {}).values()]
        ours = next((e for e in [exc, *inner] if isinstance(e, CheckpointError)), None)
        if ours is None:
            raise
        raise CheckpointError(f"{path}: {ours}") from exc


def model_names(metadata: Any) -> tuple[dict[str, str], list[str]]:
    """``({snapshot key: the model's own name}, [model entries that are not tensors])`` from DCP's ``Metadata``.

    The snapshot flattens ``{"model": msd, "optim": ..., "extra": ...}``; its ``planner_data`` maps each
    flattened key back to its path (``("model", "layers.0.qkv.weight")``), which names the model's entries.
    Without it (not written by DCP's default planner) the ``model.`` prefix is taken off the key.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = metadata.planner_data if isinstance(getattr(metadata, "planner_data", None), dict) else {}
    names: dict[str, str] = {}
    skipped: list[str] = []
    for fqn, item in metadata.state_dict_metadata.items():
        where = paths.get(fqn)
        if isinstance(where, (tuple, list)) and len(where) >= 2:
            if where[0] != MODEL:
                continue
            name = ".".join(str(p) for p in where[1:])
        elif not paths and fqn.startswith(MODEL + "."):
            name = fqn[len(MODEL) + 1:]
        else:
            continue
        if isinstance(item, TensorStorageMetadata):
            names[fqn] = name
        else:
            skipped.append(name)
    return names, skipped


def model_state_dict(path: str, key: bytes | None) -> tuple[dict[str, Any], list[str]]:
    """``({name: full tensor}, [names left out])``: the snapshot's model state dict, unsharded, on the CPU.

    Read with stock ``dcp.load`` through the verified reader (``.metadata`` unpickled from the bytes checked
    against the authenticated manifest; every data file hashed on the descriptor it is read from).

    Raises:
        CheckpointError: the snapshot fails on the handles it is read from, or holds no model tensor.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    checked = verified_metadata_bytes(path, key)
    metadata = unpickle_metadata(checked[1])
    names, skipped = model_names(metadata)
    if not names:
        raise CheckpointError(f"{path} holds no model tensors (no '{MODEL}' entry in its .metadata)")
    items = metadata.state_dict_metadata
    flat = {fqn: torch.empty(tuple(items[fqn].size), dtype=items[fqn].properties.dtype) for fqn in names}
    _load(lambda: dcp.load(flat, storage_reader=VerifiedReader(path, key, checked), no_dist=True), path)
    return {names[fqn]: t for fqn, t in flat.items()}, skipped
