"""Every private torch and DCP name ``ckpt_service`` touches, in one place.

The snapshot path leans on names torch does not promise to keep (DCP's per-item writer and file writing hook, its
compression extension, its loader without a planner's key list, state-dict name resolution, FSDP1's flat-parameter
layout, a module's buffer table, the ShardedTensor class).  When torch moves one, the entry points here fail loudly
(``tests/ckpt_service/test_compat.py`` runs each on every supported release, ``make test-releases``, and refuses a
private torch name anywhere else in the package), and this is the only module to change.

Entry points (torch 2.13-2.15): writing, :func:`zstd_extensions`, :func:`filesystem_writer_class`
(``FileSystemWriter``'s ``_extensions`` and ``_write_data``), :func:`write_item` (``filesystem._write_item``),
:func:`can_place_items` (and ``torch.serialization._get_storage_alignment``); capture, :func:`fsdp1_flat_params`
(each unit's ``_handle``), :func:`flat_param_parts` (``_params``, ``_shard_param_infos``, ``_shapes``),
:func:`fsdp1_flat_layouts` (``_numels_with_padding``, ``_is_padding_mask``),
:func:`persistent_buffers` (``Module._buffers``, ``_non_persistent_buffers_set``), :func:`writes_own_state_dict`
(``Module._save_to_state_dict``, ``_state_dict_hooks``, ``_state_dict_pre_hooks``), :func:`canonical_fqn`
(``state_dict._get_fqns``), :func:`sharded_tensor_type`; export, :func:`load_everything` (``_load_state_dict`` with
``_EmptyStateDictLoadPlanner``); the reload in place, :func:`init_optim_state` (``state_dict._init_optim_state``),
:func:`record_reader` (``torch._C.PyTorchFileReader``).
"""

from __future__ import annotations

import inspect
from typing import Any

# ------------------------------------------------------------------ writing


def zstd_extensions(compress: bool) -> list:
    """``[ZStandard()]`` for ``FileSystemWriter(_extensions=...)`` when ``compress``; stock ``dcp.load`` reads it."""
    if not compress:
        return []
    from torch.distributed.checkpoint._extension import ZStandard

    return [ZStandard()]


_FS_WRITER: type | None = None


def filesystem_writer_class() -> type:
    """DCP's ``FileSystemWriter`` with its two private hooks under names of this package's own:

    - ``compress=True`` at construction: the files zstd-compressed by DCP's own extension (``_extensions``);
    - ``write_files(planner, file_queue)``: returns the future of the files it wrote itself, or None to let DCP
      write them (its ``_write_data``, which ``write_data`` calls with the plan's items queued by file).
    """
    global _FS_WRITER
    if _FS_WRITER is None:
        from torch.distributed.checkpoint import FileSystemWriter

        class Writer(FileSystemWriter):
            def __init__(self, path: str, *, compress: bool = False, **kwargs: Any) -> None:
                super().__init__(path, _extensions=zstd_extensions(compress), **kwargs)

            def write_files(self, planner: Any, file_queue: Any) -> Any:
                return None  # DCP's own file writing

            def _write_data(self, planner: Any, file_queue: Any) -> Any:  # noqa: D401 - DCP interface
                fut = self.write_files(planner, file_queue)
                return super()._write_data(planner, file_queue) if fut is None else fut

        _FS_WRITER = Writer
    return _FS_WRITER


#: The parameters of DCP's ``filesystem._write_item`` that :func:`write_item` passes, in order.
WRITE_ITEM_PARAMS = ["transforms", "stream", "data", "write_item", "storage_key", "serialization_format"]


def write_item(transforms: Any, stream: Any, data: Any, item: Any, storage_key: str,
               serialization_format: Any) -> Any:
    """One DCP write item serialised into ``stream`` by DCP itself (``filesystem._write_item``); its ``WriteResult``
    (the item's offset and length in the file)."""
    from torch.distributed.checkpoint.filesystem import _write_item

    return _write_item(transforms, stream, data, item, storage_key, serialization_format)


def can_place_items() -> bool:
    """Whether this torch has what :func:`ckpt_service.sink.write_files` uses: DCP's ``_write_item`` with the
    parameters :func:`write_item` passes, and ``torch.save``'s per-thread storage alignment."""
    import torch.serialization as ser
    from torch.distributed.checkpoint import filesystem

    try:
        params = list(inspect.signature(filesystem._write_item).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return params == WRITE_ITEM_PARAMS and hasattr(ser, "_get_storage_alignment")


# ------------------------------------------------------------------ capture


def _fsdp1_handles(model) -> list[tuple[Any, Any]]:
    """``(handle, flat parameter)`` of every FSDP1 unit under ``model`` (``_handle``), in module order, each flat
    parameter once; [] when none."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return []
    out, seen = [], set()
    for unit in FSDP.fsdp_modules(model):
        handle = getattr(unit, "_handle", None)
        fp = getattr(handle, "flat_param", None)
        if fp is not None and id(fp) not in seen:
            seen.add(id(fp))
            out.append((handle, fp))
    return out


def fsdp1_flat_params(model) -> list:
    """Every FSDP1 ``FlatParameter`` under ``model`` (each unit's handle), in module order; [] when none."""
    return [fp for _handle, fp in _fsdp1_handles(model)]


def flat_param_parts(fp) -> list[tuple[Any, Any, Any]] | None:
    """``(original parameter, its shard info, its unflattened shape)`` for every parameter a FSDP1
    ``FlatParameter`` holds, in its order; None when it keeps no original parameters (``use_orig_params=False``).
    The shard info's ``in_shard``, ``intra_param_start_idx`` and ``intra_param_end_idx`` say which of the
    parameter's flattened elements this rank's shard holds."""
    params = getattr(fp, "_params", None)
    if params is None:
        return None
    return list(zip(params, fp._shard_param_infos, fp._shapes))


def fsdp1_flat_layouts(model) -> list[tuple[Any, int, list[tuple[Any, list[int], int]] | None]]:
    """For every FSDP1 unit's ``FlatParameter`` under ``model`` (module order, each once): ``(flat parameter, this
    rank's index in the group it is sharded over, its unflattening layout)``; the layout lists ``(original parameter,
    its shape, the offset of its first element in the unsharded flat parameter)`` for every parameter it holds, in
    order, alignment padding skipped, or is None when it keeps no original parameters (``use_orig_params=False``).

    The layout is FSDP's own unflattening (``_numels_with_padding``, ``_is_padding_mask``, ``_shapes``, the
    handle's ``rank``): where forward finds each parameter in the unsharded flat parameter, not the per-rank shard
    info (``_shard_param_infos``) the capture plan reads."""
    out = []
    for handle, fp in _fsdp1_handles(model):
        params = getattr(fp, "_params", None)
        layout: list[tuple[Any, list[int], int]] | None = None
        if params is not None:
            starts, at = [], 0
            for numel, padding in zip(fp._numels_with_padding, fp._is_padding_mask):
                if not padding:
                    starts.append(at)
                at += numel
            if not len(starts) == len(params) == len(fp._shapes):
                raise ValueError(f"FSDP1 flat parameter: {len(starts)} unpadded entries for {len(params)} parameters")
            layout = [(p, list(shape), start) for p, shape, start in zip(params, fp._shapes, starts)]
        out.append((fp, int(handle.rank), layout))
    return out


def writes_own_state_dict(module) -> bool:
    """Whether ``module`` puts into its ``state_dict()`` what its parameters and persistent buffers alone do not give:
    its class overrides ``Module._save_to_state_dict``, or it carries state-dict hooks (``_state_dict_hooks``,
    ``_state_dict_pre_hooks``).  FSDP1's plan reads parameters and buffers directly, so such a model is planned from
    ``get_state_dict`` instead."""
    import torch

    if type(module)._save_to_state_dict is not torch.nn.Module._save_to_state_dict:
        return True
    return bool(getattr(module, "_state_dict_hooks", None)) or bool(getattr(module, "_state_dict_pre_hooks", None))


def persistent_buffers(module) -> list[tuple[str, Any]]:
    """``(name, buffer)`` of ``module``'s own buffers that its ``state_dict()`` holds (set, not registered
    ``persistent=False``), in registration order; not its children's."""
    skip = getattr(module, "_non_persistent_buffers_set", ())
    return [(name, buf) for name, buf in module._buffers.items() if buf is not None and name not in skip]


def canonical_fqn(model, name: str) -> str:
    """The name ``get_state_dict`` gives the parameter ``name`` of ``model`` (wrapper prefixes removed)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    fqns = _get_fqns(model, name)
    if len(fqns) != 1:
        raise ValueError(f"parameter {name!r} maps to {len(fqns)} names: {sorted(fqns)}")
    return next(iter(fqns))


def sharded_tensor_type() -> Any:
    """The ``ShardedTensor`` class (FSDP1's ``SHARDED_STATE_DICT`` values), which torch keeps in a private package."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return ShardedTensor


# ------------------------------------------------------------------ export


def load_everything(reader) -> dict:
    """Everything a DCP checkpoint holds, as one nested dict, read through ``reader`` in this process: what stock
    ``dcp_to_torch_save`` loads (its private ``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``; the public
    ``dcp.load`` fills only the keys its argument already has)."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


# ------------------------------------------------------------------ the reload in place


def init_optim_state(optim) -> None:
    """Create an optimizer's per-parameter state as ``get_state_dict`` does before a load: one step with zero
    gradients at learning rate 0 (``state_dict._init_optim_state``; nothing when it has state already)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optim)


def record_reader(stream) -> Any:
    """torch's reader of one ``torch.save`` archive on a seekable binary ``stream`` (``torch._C.PyTorchFileReader``):
    ``get_all_records()``, ``get_record_offset(name)`` (in the archive), ``get_record_size(name)``,
    ``get_record(name)`` (the bytes of a small record)."""
    import torch

    return torch._C.PyTorchFileReader(stream)
