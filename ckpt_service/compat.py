"""The one shim around private torch APIs this package uses (tests/test_ckpt_unit.py notices if they move)."""

from __future__ import annotations


def zstd_extensions(compress: bool) -> list:
    """``[ZStandard()]`` for ``FileSystemWriter(_extensions=...)`` when ``compress``; stock ``dcp.load`` reads it."""
    if not compress:
        return []
    from torch.distributed.checkpoint._extension import ZStandard

    return [ZStandard()]
