"""Write a node's staged boxes as one standard DCP directory (no reassembly) and commit it atomically.

Steps of :func:`write_snapshot` (each names the failure it prevents):

1. :func:`build_state`: map every rank's slot read-only, turn each tensor's boxes from all of the node's ranks into
   one :class:`ChunkedTensor` (DCP's checkpointable protocol: every box a DCP chunk, saved straight from shared
   memory), and check that the boxes cover every tensor exactly (a missing rank never yields a zero-filled tensor);
2. a snapshot whose ranks report a failed capture proof is refused (:mod:`.writecheck`);
3. ``dcp.save(..., no_dist=True)`` through ``FileSystemWriter`` into ``.tmp-step-N-<pid>`` (optionally zstd-compressed
   by DCP's own extension, which stock ``dcp.load`` reads), without ``torch.save``'s per-record CRC-32;
4. every file hashed (BLAKE3, :mod:`.digest`) as written, past the page cache where the file system allows it, every
   large box from the slot itself (:mod:`.sink`), then fsynced and dropped from the page cache (the verifier re-reads
   the disk, not a cached copy); the tensors go to ``WRITE_THREADS`` files in parallel; ``manifest.json`` with the
   checksums (each file's size checked: :mod:`.writecheck`), the step, config digest and capture proof; the
   directory fsynced;
5. rename to ``step-NNNNNNNNNN`` (the commit point), fsync the node directory;
6. record ``committed`` in ``state.json``.

Any ``OSError`` (a full disk) removes the temporary directory and raises
:class:`~accelpact_slurm.core.errors.CheckpointError` with the reason.  DCP's private hooks come through :mod:`.compat`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

from accelpact_slurm.core.errors import CheckpointError
from accelpact_slurm.core.faults import NO_FAULTS, TestFaults

from ckpt_service import digest
from ckpt_service import faults as fault_points
from ckpt_service import sink
from ckpt_service.auth import sign
from ckpt_service.compat import can_place_items, filesystem_writer_class
from ckpt_service.index import fsync_dir, read_json, record_state, write_json_atomic
from ckpt_service.layout import DEL_PREFIX, MANIFEST, STATE, TMP_PREFIX, step_dirname
from ckpt_service.sink import WRITE_THREADS, HashingFile
from ckpt_service.writecheck import file_entries, refuse_failed_capture

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: the manifest names its files' digest (:mod:`.digest`); 2 and older: SHA-256


class ChunkedTensor:
    """A tensor known only by its chunks: DCP saves each chunk as it is (``_Checkpointable`` protocol).

    ``chunks`` are ``(offsets, tensor)`` with ``tensor`` contiguous and owning exactly its bytes
    (a ``torch.frombuffer`` view of a slot region), so DCP's writer copies nothing before writing.
    """

    def __init__(self, shape: Sequence[int], dtype: Any) -> None:
        import torch

        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.chunks: list[tuple[Any, Any]] = []

    def add(self, offsets: Sequence[int], tensor: Any) -> None:
        import torch

        self.chunks.append((torch.Size(offsets), tensor))

    def covered(self) -> int:
        return sum(t.numel() for _o, t in self.chunks)

    def __create_write_items__(self, fqn: str, _obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                                                      properties=props, size=self.shape))
                for off, t in self.chunks]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self.chunks]

    def __get_tensor_shard__(self, index: Any) -> Any:
        for off, t in self.chunks:
            if off == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no chunk at {list(index.offset)}")


def _planner():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _Planner(DefaultSavePlanner):
        """DefaultSavePlanner that finds a :class:`ChunkedTensor`'s chunks by their offsets."""

        def lookup_object(self, index):  # noqa: D401 - DCP interface
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, ChunkedTensor):
                return obj.__get_tensor_shard__(index)
            return super().lookup_object(index)

    return _Planner()


def _merge_plain(plains: Sequence[Any]) -> Any:
    """The node's plain state: the first rank's, with keys only a later rank holds filled in."""
    first = plains[0]
    if isinstance(first, dict):
        keys = list(first)
        for p in plains[1:]:
            if isinstance(p, dict):
                keys += [k for k in p if k not in first and k not in keys]
        return {k: _merge_plain([p[k] for p in plains if isinstance(p, dict) and k in p]) for k in keys}
    return first


def _put(state: dict[str, Any], key: Sequence[str], value: Any) -> None:
    d = state
    for k in key[:-1]:
        d = d.setdefault(k, {})
    d[key[-1]] = value


def build_state(descs: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[tuple[str, ...], ChunkedTensor]]:
    """The node's DCP state dict from its ranks' descriptors (each with ``"buf"``: the mapped slot, a memoryview)."""
    import torch

    descs = sorted(descs, key=lambda d: d["local_rank"])
    state = _merge_plain([d["plain"] for d in descs])
    tensors: dict[tuple[str, ...], ChunkedTensor] = {}
    for d in descs:
        buf = d["buf"]
        for e in d["entries"]:
            key = tuple(e["key"])
            dtype = getattr(torch, e["dtype"])
            ct = tensors.get(key)
            if ct is None:
                ct = tensors[key] = ChunkedTensor(e["shape"], dtype)
            elif list(ct.shape) != list(e["shape"]) or ct.dtype != dtype:
                raise CheckpointError(f"{'.'.join(key)}: ranks disagree on its shape or dtype")
            item = torch.empty((), dtype=dtype).element_size()
            for offsets, sizes, byte_offset in e["boxes"]:
                n = math.prod(sizes)
                if n == 0:
                    continue
                region = buf[byte_offset:byte_offset + n * item]
                if len(region) != n * item:
                    raise CheckpointError(f"{'.'.join(key)}: a box lies outside rank {d['rank']}'s slot")
                # a tensor whose storage is exactly this region: DCP writes it without a defensive copy
                with warnings.catch_warnings():  # a read-only mapping by design: nothing writes through it
                    warnings.simplefilter("ignore", UserWarning)
                    ct.add(offsets, torch.frombuffer(region, dtype=dtype).view(sizes))
    for key, ct in tensors.items():
        if ct.covered() != math.prod(ct.shape):
            raise CheckpointError(f"{'.'.join(key)}: the node's shards cover {ct.covered()} of "
                                  f"{math.prod(ct.shape)} elements (a rank's shard is missing)")
        _put(state, key, ct)
    return state, tensors


@contextlib.contextmanager
def _no_zip_crc():
    """``torch.save`` without its per-record CRC-32 (a second pass over every byte) in this thread: every file
    is covered by the manifest's digest instead, and stock ``torch.load``/``dcp.load`` read it as is.

    torch keeps the option per thread: DCP's extra write threads start with the CRC on, so every write stream
    turns it off in the thread that writes it (:func:`_hashing_fs`), as :func:`write_snapshot` does in its own."""
    import torch.serialization as ser

    if not hasattr(ser, "set_crc32_options"):  # pragma: no cover - older torch: keep the CRC
        yield
        return
    before = ser.get_crc32_options()
    ser.set_crc32_options(False)
    try:
        yield
    finally:
        ser.set_crc32_options(before)


def _hashing_fs(sums: dict[str, tuple[int, str]], errors: list[BaseException],
                from_slot: dict[str, int] | None = None):
    """DCP's local file system whose write streams are :class:`HashingFile`s; ``sums[name] = (size, digest)``
    (by file name: every file of a snapshot lies in its one directory).  A stream that failed leaves its
    exception in ``errors``: DCP's extra write threads would otherwise only print it.  ``from_slot[name]``: the
    bytes of the file written to the disk from where they lay (:meth:`.sink.Sink._span`)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):  # noqa: D401 - DCP interface
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            try:
                fh = HashingFile(os.fspath(path))
            except BaseException as exc:
                errors.append(exc)
                raise
            try:
                with _no_zip_crc():  # this stream's thread may be one of DCP's, whose CRC option is its own
                    yield fh
                sums[os.path.basename(os.fspath(path))] = fh.finish()
                if from_slot is not None:
                    from_slot[os.path.basename(os.fspath(path))] = fh.sink.spans
            except BaseException as exc:
                errors.append(exc)
                raise
            finally:
                fh.abandon()

        def rename(self, path, new_path) -> None:  # noqa: D401 - DCP interface (.metadata.tmp -> .metadata)
            super().rename(path, new_path)
            old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
            if old in sums:
                sums[new] = sums.pop(old)

    return _HashingFileSystem()


def _writer(path: str, compress: bool, ndir: str, step: int, faults_: TestFaults = NO_FAULTS,
            sums: dict[str, tuple[int, str]] | None = None, from_slot: dict[str, int] | None = None):
    errors: list[BaseException] = []
    base: Any = filesystem_writer_class()

    class _Writer(base):
        """FileSystemWriter with the ``writing`` fault point between the shard files and ``.metadata``, which
        fails when any write thread failed (DCP would return the other threads' results as if complete); an
        uncompressed one through hashing streams writes its files itself (:func:`.sink.write_files`: every
        large tensor's bytes on a page of the file)."""

        def write_files(self, planner, file_queue):  # noqa: D401 - the compat writer's hook
            if (compress or sums is None or not can_place_items()
                    or getattr(self.serialization_format, "value", None) != "torch_save"):
                return None  # DCP writes the files
            return sink.write_files(self, planner, file_queue)

        def write_data(self, plan, planner):  # noqa: D401 - DCP interface
            fut = super().write_data(plan, planner)
            results = fut.wait()
            if errors:
                raise errors[0]
            if len(results) != len(plan.items):
                raise CheckpointError(f"{len(results)} of {len(plan.items)} items written")
            return fut

        def finish(self, metadata, results):  # noqa: D401 - DCP interface
            fault_points.pause_point("writing", ndir, step, faults_)
            return super().finish(metadata, results)

    # sync_files=False: every stream fsyncs itself when it is finished (HashingFile.finish)
    w = _Writer(path, compress=compress, single_file_per_rank=True, sync_files=False, thread_count=WRITE_THREADS,
                overwrite=False)
    if sums is not None:
        w.fs = _hashing_fs(sums, errors, from_slot)
    return w


def write_snapshot(ndir: str, step: int, descs: Sequence[Mapping[str, Any]], *, compress: bool = False,
                   node: str = "", timings: dict[str, float] | None = None,
                   faults: TestFaults = NO_FAULTS, key: bytes | None = None,
                   before_commit: Callable[[], None] | None = None,
                   from_slot: dict[str, int] | None = None) -> tuple[str, int]:
    """Write and commit one snapshot from the node's staged descriptors; return ``(path, size_bytes)``.

    The ranks proved their capture before handing it over (``meta["capture"]``); a snapshot whose descriptors say the
    proof failed is refused.  ``timings`` (if given) receives the seconds spent in ``dcp_save`` and ``fsync_hash``;
    ``from_slot`` (if given), by file, the bytes written to the disk straight from the slots (no copy:
    :func:`.sink.write_files`).  ``key``: the run's key, which signs the manifest (:mod:`.auth`). ``before_commit``:
    called once every byte is written and hashed, before the manifest and the rename; what it raises fails the
    snapshot (the daemon checks there that the slots still hold this step).
    """
    timings = {} if timings is None else timings
    import torch.distributed.checkpoint as dcp

    descs = sorted(descs, key=lambda d: d["local_rank"])
    meta = descs[0]["meta"]
    refuse_failed_capture(step, descs)
    state, _tensors = build_state(descs)
    state["extra"] = {"json": meta["extra_json"]}
    final = os.path.join(ndir, step_dirname(step))
    tmp = os.path.join(ndir, f"{TMP_PREFIX}{step_dirname(step)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        t = time.monotonic()
        written: dict[str, tuple[int, str]] = {}  # file name -> (size, digest): hashed while written, fsynced
        from_slot = {} if from_slot is None else from_slot
        with _no_zip_crc():
            dcp.save(state, storage_writer=_writer(tmp, compress, ndir, step, faults, written, from_slot),
                     planner=_planner(), no_dist=True)
        timings["dcp_save"] = time.monotonic() - t
        t = time.monotonic()
        files = file_entries(tmp, written)  # every file's size and digest (hashed while written, fsynced)
        timings["fsync_hash"] = time.monotonic() - t
        if before_commit is not None:
            before_commit()
        manifest = {
            "format": FORMAT_VERSION, "digest": digest.WRITE, "step": step, "node": node, "created": time.time(),
            "job_id": meta.get("job_id"), "config_digest": meta.get("config_digest"), "config": meta.get("config"),
            "capture": meta.get("capture"), "compressed": compress, "world_size": meta.get("world_size"),
            "node_ranks": [d["rank"] for d in descs], "files": files,
        }
        write_json_atomic(os.path.join(tmp, MANIFEST), sign(manifest, key) if key is not None else manifest)
        fsync_dir(tmp)
        fault_points.pause_point("written", ndir, step, faults)
        _make_room_for(final)
        os.rename(tmp, final)
        fsync_dir(ndir)
        fault_points.kill_point("renamed", node, step, faults)  # committed; its state and the index not updated
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, CheckpointError)) or _is_oserror_inside(exc) or _is_dcp_failure(exc):
            raise CheckpointError(f"step {step}: {_root_reason(exc)}") from exc
        raise
    fault_points.pause_point("renamed", ndir, step, faults)
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
    removed: list[str] = []
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
