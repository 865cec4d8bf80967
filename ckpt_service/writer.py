"""Reassemble the node's full tensors, write them as one standard DCP directory, commit atomically.

Steps of :func:`write_snapshot` (each names the failure it prevents):

1. reassemble every sharded tensor from the node's ranks' local chunks and check that the chunks
   cover it completely (a missing rank never yields a silently zero-filled tensor);
2. ``dcp.save(..., no_dist=True)`` through ``FileSystemWriter`` into ``.tmp-step-N-<pid>``
   (optionally zstd-compressed by DCP's own extension, which stock ``dcp.load`` reads);
3. ``manifest.json`` with the SHA-256 and size of every file, the step, config digest and the
   loss on the fixed batch; every file and the directory fsynced (DCP writes only ``.metadata``
   atomically, shard files land in place);
4. rename to ``step-NNNNNNNNNN`` (the commit point), fsync the node directory;
5. record ``committed`` in ``state.json``.

Any ``OSError`` (a full disk) removes the temporary directory and raises
:class:`~accelpact_slurm.errors.CheckpointError` with the reason.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from typing import Any, Mapping, Sequence

from accelpact_slurm.errors import CheckpointError

from . import faults
from .compat import zstd_extensions
from .index import fsync_dir, read_json, record_state, write_json_atomic
from .layout import DEL_PREFIX, MANIFEST, STATE, TMP_PREFIX, step_dirname

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SHARD = "__shard__"


def _is_shard(v: Any) -> bool:
    return isinstance(v, dict) and v.get(SHARD) is True


def assemble(states: Sequence[Any], where: str = "") -> Any:
    """Merge the ranks' nested states: shard nodes become full tensors, the rest is taken from rank 0."""
    import torch

    first = states[0]
    if _is_shard(first):
        shape = list(first["global"])
        chunks = [c for s in states for c in s["chunks"]]
        dtype = chunks[0][1].dtype if chunks else torch.float32
        full = torch.zeros(shape, dtype=dtype)
        covered = 0
        for offsets, t in chunks:
            if t.numel() == 0:
                continue
            idx = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))
            full[idx].copy_(t)
            covered += t.numel()
        if covered != full.numel():
            raise CheckpointError(f"{where}: the node's shards cover {covered} of {full.numel()} elements "
                                  f"(a rank's shard is missing)")
        return full
    if isinstance(first, dict):
        return {k: assemble([s[k] for s in states], f"{where}.{k}" if where else str(k)) for k in first}
    if isinstance(first, list):
        return [assemble([s[i] for s in states], f"{where}.{i}") for i in range(len(first))]
    return first


def sha256_file(path: str, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(bufsize)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _writer(path: str, compress: bool, ndir: str, step: int):
    from torch.distributed.checkpoint import FileSystemWriter

    class _Writer(FileSystemWriter):
        """FileSystemWriter with the ``writing`` fault point between the shard files and ``.metadata``."""

        def finish(self, metadata, results):  # noqa: D401 - DCP interface
            faults.pause_point("writing", ndir, step)
            return super().finish(metadata, results)

    return _Writer(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False,
                   _extensions=zstd_extensions(compress))


def write_snapshot(ndir: str, step: int, payloads: Sequence[Mapping[str, Any]], *, compress: bool = False,
                   node: str = "") -> tuple[str, int]:
    """Write and commit one snapshot from the node's staged payloads; return ``(path, size_bytes)``."""
    import torch.distributed.checkpoint as dcp

    from accelpact_slurm.workload.appstate import extra_to_dcp

    payloads = sorted(payloads, key=lambda p: p["local_rank"])
    meta = payloads[0]["meta"]
    state = assemble([p["state"] for p in payloads])
    state["extra"] = extra_to_dcp(meta["extra"])
    final = os.path.join(ndir, step_dirname(step))
    tmp = os.path.join(ndir, f"{TMP_PREFIX}{step_dirname(step)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        dcp.save(state, storage_writer=_writer(tmp, compress, ndir, step), no_dist=True)
        files = {}
        for name in sorted(os.listdir(tmp)):
            p = os.path.join(tmp, name)
            _fsync_file(p)
            files[name] = {"size": os.path.getsize(p), "sha256": sha256_file(p)}
        manifest = {
            "format": FORMAT_VERSION, "step": step, "node": node, "created": time.time(),
            "job_id": meta.get("job_id"), "config_digest": meta.get("config_digest"), "config": meta.get("config"),
            "eval": meta.get("eval"), "compressed": compress, "world_size": meta.get("world_size"),
            "node_ranks": [p["rank"] for p in payloads], "files": files,
        }
        write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
        fsync_dir(tmp)
        faults.pause_point("written", ndir, step)
        _make_room_for(final)
        os.rename(tmp, final)
        fsync_dir(ndir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, CheckpointError)) or _is_oserror_inside(exc) or _is_dcp_failure(exc):
            raise CheckpointError(f"step {step}: {_root_reason(exc)}") from exc
        raise
    faults.pause_point("renamed", ndir, step)
    try:
        record_state(final, "committed", None)
    except OSError:  # the rename is the commit point: an unrecorded step-N reads as committed
        log.warning("could not record the state of %s", final, exc_info=True)
    size = sum(os.path.getsize(os.path.join(final, n)) for n in os.listdir(final))
    return final, size


def _make_room_for(final: str) -> None:
    """A directory of the same step from an earlier attempt (before a restart) is moved aside, unless verified."""
    if not os.path.exists(final):
        return
    old = read_json(os.path.join(final, STATE)) or {}
    if old.get("state") == "verified":
        raise CheckpointError(f"{os.path.basename(final)} already exists and is verified; keeping it")
    aside = os.path.join(os.path.dirname(final), f"{DEL_PREFIX}{os.path.basename(final)}-{os.getpid()}")
    os.rename(final, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _is_dcp_failure(exc: BaseException) -> bool:
    """DCP's ``CheckpointException`` derives from ``BaseException``: catch it by its ``failures``."""
    return isinstance(getattr(exc, "failures", None), dict)


def _is_oserror_inside(exc: BaseException) -> bool:
    return _find_oserror(exc) is not None


def _find_oserror(exc: BaseException | None, depth: int = 0) -> OSError | None:
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError):
        return exc
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: exception}
    if isinstance(failures, dict):
        for f in failures.values():
            if isinstance(f, tuple) and f:  # (exception, stack summary)
                f = f[0]
            found = _find_oserror(f if isinstance(f, BaseException) else None, depth + 1)
            if found is not None:
                return found
    return _find_oserror(exc.__cause__ or exc.__context__, depth + 1)


def _root_reason(exc: BaseException) -> str:
    err = _find_oserror(exc)
    if err is not None:
        return f"{err.strerror or err} ({err.__class__.__name__}, errno {err.errno})"
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) and first else first
        return f"{first.__class__.__name__}: {first}"[:500]
    return f"{exc.__class__.__name__}: {exc}"[:500]


def recover_node_dir(ndir: str) -> list[str]:
    """Start-up cleanup: remove temporary and half-deleted directories; return what was removed."""
    removed = []
    try:
        names = os.listdir(ndir)
    except FileNotFoundError:
        return removed
    for name in names:
        if name.startswith((TMP_PREFIX, DEL_PREFIX)) or name.startswith(".paused-"):
            p = os.path.join(ndir, name)
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except OSError:
                    pass
            removed.append(name)
    return removed
