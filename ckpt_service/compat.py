"""The one shim around private torch APIs this package uses (tests/ckpt_service/test_ckpt_unit.py and
tests/ckpt_service/test_ckpt_capture.py notice if they move)."""

from __future__ import annotations


def zstd_extensions(compress: bool) -> list:
    """``[ZStandard()]`` for ``FileSystemWriter(_extensions=...)`` when ``compress``; stock ``dcp.load`` reads it."""
    if not compress:
        return []
    from torch.distributed.checkpoint._extension import ZStandard

    return [ZStandard()]


def fsdp1_flat_params(model) -> list:
    """Every FSDP1 ``FlatParameter`` under ``model`` (each unit's handle), in module order; [] when none."""
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
            out.append(fp)
    return out


def canonical_fqn(model, name: str) -> str:
    """The name ``get_state_dict`` gives the parameter ``name`` of ``model`` (wrapper prefixes removed)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    fqns = _get_fqns(model, name)
    if len(fqns) != 1:
        raise ValueError(f"parameter {name!r} maps to {len(fqns)} names: {sorted(fqns)}")
    return next(iter(fqns))



def load_everything(reader) -> dict:
    """Everything a DCP checkpoint holds, as one nested dict, read through ``reader`` in this process: what stock
    ``dcp_to_torch_save`` loads (its private ``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``; the public
    ``dcp.load`` fills only the keys its argument already has)."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd
