"""Write tensors as one ``.safetensors`` file, without the ``safetensors`` package.

The format (the one stock ``safetensors.torch.load_file`` and ``safe_open`` read):

1. 8 bytes: the header's length N, an unsigned little-endian 64-bit integer;
2. N bytes: a JSON object, UTF-8, that maps every tensor's name to ``{"dtype", "shape", "data_offsets"}``
   (``data_offsets``: ``[begin, end)`` in the byte buffer below) and may hold ``"__metadata__"``, a map of
   strings to strings; padded with spaces so that the buffer starts 8-byte aligned;
3. the byte buffer: every tensor's elements, row-major (C order), little-endian, one after the other with
   no gap and no overlap, in the order of their offsets.

Who calls: :func:`ckpt_service.export.export_snapshot` (``accelpact-ckpt export --format safetensors``), once
per export, on the login node or wherever the export runs; nothing here is collective.  The file is written
under a temporary name beside ``path``, flushed to disk and renamed into place: a reader sees the old file or
the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, Mapping

from accelpact_slurm.core.atomic import write_atomic
from accelpact_slurm.core.errors import CheckpointError

#: The header is padded to a multiple of this (the data buffer then starts aligned for every dtype).
ALIGN = 8
#: The largest header the stock reader accepts (100 MB).
MAX_HEADER = 100_000_000

#: torch dtype name -> safetensors dtype.
DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}


def dtype_name(dtype: Any) -> str:
    """The safetensors name of a torch dtype.

    Raises:
        CheckpointError: the dtype has no safetensors name (complex, quantized), naming it.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"dtype {name} has no safetensors equivalent (it stores {', '.join(sorted(DTYPES))})")
    return DTYPES[name]


def header(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[str]]:
    """``(the 8-byte length and the padded JSON header, the names in buffer order)``.  Pure.

    The tensors lie in the buffer in the order of their names (sorted), so the offsets increase with them.

    Raises:
        CheckpointError: an empty or ``__metadata__`` name, a metadata entry that is not a string, a dtype
            without a safetensors name.
    """
    doc: dict[str, Any] = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise CheckpointError(f"safetensors metadata must map strings to strings, not {bad!r}"[:300])
        doc["__metadata__"] = dict(metadata)
    names = sorted(tensors)
    offset = 0
    for name in names:
        if not name or name == "__metadata__":
            raise CheckpointError(f"tensor name {name!r} cannot be stored in a safetensors file")
        t = tensors[name]
        size = t.numel() * t.element_size()
        doc[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % ALIGN)
    if len(raw) > MAX_HEADER:
        raise CheckpointError(f"the safetensors header would have {len(raw)} bytes (at most {MAX_HEADER} are read)")
    return struct.pack("<Q", len(raw)) + raw, names


def _bytes_of(t: Any) -> memoryview:
    """The tensor's elements as little-endian bytes in C order, without a copy where it already is so."""
    import torch

    t = t.detach().to("cpu").contiguous()
    flat = t.reshape(-1).view(torch.uint8)  # any dtype, bf16 included: numpy has no bf16, uint8 it has
    if sys.byteorder != "little" and t.element_size() > 1:  # pragma: no cover - big-endian hosts only
        flat = flat.reshape(-1, t.element_size()).flip(1).reshape(-1)  # each element's bytes reversed
    return memoryview(flat.numpy())


def write(path: str, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` (name -> torch tensor) to ``path`` as a safetensors file; return its size in bytes.

    Temporary name in the same directory, fsync, rename, fsync the directory.

    Raises:
        CheckpointError: what :func:`header` refuses.
        OSError: the file could not be written (the temporary file is removed).
    """
    head, names = header(tensors, metadata)

    def body(fh) -> None:
        fh.write(head)
        for name in names:
            fh.write(_bytes_of(tensors[name]))

    write_atomic(path, body)
    return os.path.getsize(path)
