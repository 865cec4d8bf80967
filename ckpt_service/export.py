"""A verified snapshot in a format users load elsewhere: one ``torch.save`` file or one ``.safetensors`` file.

Who calls: ``accelpact-ckpt export`` (:mod:`accelpact_slurm.cli.ckpt`), once, in one process, with no job
running; nothing here is collective and no model is built.

Only a snapshot recorded ``verified`` is exported, and only after its manifest is authenticated under the
run's key and every file matches its checksum and ``.metadata`` covers every tensor
(:func:`ckpt_service.verify.verify_snapshot`): a snapshot still ``committed``, one ``rejected`` (a replay
check's rejection passes the checksums: they compare the snapshot with itself), one another user planted
(its ``.metadata`` is a pickle: never unpickled unauthenticated) are refused with the reason.

The formats (:data:`FORMATS`):

- ``torch``: stock ``dcp_to_torch_save``: the whole snapshot (``model``, ``optim``, ``extra``) as one nested
  dict, for ``torch.load``;
- ``safetensors``: the model's state dict only (weights and persistent buffers), unsharded, under the names the
  script's model uses (the snapshot stores ``get_state_dict``'s names, with no FSDP wrapper prefix: the names of
  ``torch.save``'s ``["model"]``), each tensor with its own dtype (bf16 as ``BF16``); read through
  :func:`ckpt_service.verified.VerifiedReader`, so every byte comes from a descriptor checked against the
  manifest; written by :mod:`.safetensors_file` (no extra dependency).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from accelpact_slurm.core.errors import CheckpointError
from ckpt_service import safetensors_file
from ckpt_service.index import read_record
from ckpt_service.layout import step_of
from ckpt_service.verified import VerifiedReader, unpickle_metadata, verified_metadata_bytes
from ckpt_service.verify import verify_snapshot

log = logging.getLogger(__name__)

#: The formats of ``accelpact-ckpt export --format``: what each file holds.
FORMATS = {
    "torch": "the whole snapshot (model, optimizer state, the run's extra state) as one torch.save file "
             "(stock dcp_to_torch_save); torch.load(OUT)['model'] is the model's state dict",
    "safetensors": "the model's weights and persistent buffers only, unsharded, under the model's own parameter "
                   "names, each in its dtype (bf16 as BF16); loads with safetensors.torch.load_file(OUT) and "
                   "model.load_state_dict()",
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

    Raises:
        CheckpointError: the snapshot is refused (:func:`check_exportable`), or holds nothing the format can
            store (no model tensors, a dtype safetensors lacks).
        OSError: ``out`` could not be written.
    """
    fmt = format_for(out, fmt)
    check_exportable(path, key)
    with warnings.catch_warnings():  # one process on purpose: DCP's "assuming ... a single process" is no news
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
        if fmt == "torch":
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(path, out)
            return f"exported {path} -> {out} (torch, {os.path.getsize(out)} bytes)"
        tensors, skipped = model_state_dict(path, key)
    step = step_of(path)
    size = safetensors_file.write(out, tensors, {"format": "pt", "step": str(step),
                                                 "source": os.path.basename(os.path.abspath(path))})
    note = f"; not tensors, left out: {', '.join(skipped)}" if skipped else ""
    return f"exported {path} -> {out} (safetensors, {len(tensors)} tensors, {size} bytes{note})"


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
    try:
        dcp.load(flat, storage_reader=VerifiedReader(path, key, checked), no_dist=True)
    except BaseException as exc:  # DCP wraps what the reader raised: say what failed, as ours
        inner = [f[0] if isinstance(f, tuple) else f for f in (getattr(exc, "failures", None) or {}).values()]
        ours = next((e for e in [exc, *inner] if isinstance(e, CheckpointError)), None)
        if ours is None:
            raise
        raise CheckpointError(f"{path}: {ours}") from exc
    return {names[fqn]: t for fqn, t in flat.items()}, skipped
