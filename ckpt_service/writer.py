"""Write a node's staged boxes as one standard DCP directory (no reassembly) and commit it atomically.

Steps of :func:`write_snapshot` (each names the failure it prevents):

1. :func:`build_state`: map every rank's slot read-only, turn each tensor's boxes from all of the
   node's ranks into one :class:`ChunkedTensor` (DCP's checkpointable protocol: every box becomes a
   DCP chunk, saved straight from shared memory), and check that the boxes cover every tensor
   exactly (a missing rank never yields a silently zero-filled tensor);
2. a snapshot whose ranks report a failed capture proof (``meta["capture"]``, computed on the ranks
   against the live state on the first snapshot of every start) is refused;
3. ``dcp.save(..., no_dist=True)`` through ``FileSystemWriter`` into ``.tmp-step-N-<pid>``
   (optionally zstd-compressed by DCP's own extension, which stock ``dcp.load`` reads), without
   ``torch.save``'s per-record CRC-32 (the digest of step 4 covers every byte);
4. every file hashed (BLAKE3, :mod:`.digest`) as its bytes are written (:class:`_HashingFile`: no second pass over the
   bytes), written past the page cache (``O_DIRECT``: :class:`Sink`; every large box from the slot itself, on a
   page of its file, the rest through a page-aligned buffer: :func:`_write_files`) where the file system allows it, else through it with its write-back started while it is still being written, then
   fsynced and dropped from the page cache (memory nothing needs: the verifier re-reads the disk itself, so it
   checks the bytes on the disk, not a cached copy);
   the tensors go to ``WRITE_THREADS`` files written in parallel; ``manifest.json`` with the checksums,
   the step, config digest and the capture proof; the directory fsynced;
5. rename to ``step-NNNNNNNNNN`` (the commit point), fsync the node directory;
6. record ``committed`` in ``state.json``.

Any ``OSError`` (a full disk) removes the temporary directory and raises
:class:`~accelpact_slurm.core.errors.CheckpointError` with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import inspect
import logging
import math
import mmap
import os
import queue
import shutil
import threading
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

from accelpact_slurm.core.errors import CheckpointError
from accelpact_slurm.core.faults import NO_FAULTS, TestFaults
from accelpact_slurm.core.safeopen import open_regular

from ckpt_service import digest
from ckpt_service import faults as fault_points
from ckpt_service.auth import sign
from ckpt_service.compat import zstd_extensions
from ckpt_service.index import fsync_dir, read_json, record_state, write_json_atomic
from ckpt_service.layout import DEL_PREFIX, MANIFEST, STATE, TMP_PREFIX, step_dirname

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


def hash_file(path: str, algorithm: str = digest.WRITE, bufsize: int = 4 << 20, drop: bool = False) -> str:
    """The file's digest (:mod:`.digest`), read into one reused buffer; ``drop``: read it from the disk, past the page cache
    (``O_DIRECT``, where the file system allows it; else a buffered read whose pages are dropped afterwards),
    for a verification re-read that must see what the disk holds and that nothing else needs."""
    if drop:
        got = _hash_direct(path, algorithm, bufsize)
        if got is not None:
            return got
    h = digest.new(algorithm)
    buf = bytearray(bufsize)
    mv = memoryview(buf)
    with open(open_regular(path)[0], "rb", buffering=0) as fh:  # never through a link (core.safeopen)
        if drop and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
        if drop:
            drop_cached(fh.fileno())
    return h.hexdigest()


def _hash_direct(path: str, algorithm: str, bufsize: int) -> str | None:
    """The digest of a file read with ``O_DIRECT`` (the disk's bytes, no copy through the page cache); None where
    the file system refuses direct I/O (tmpfs, some network file systems): the caller reads it buffered."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | flag)
    except OSError:
        return None
    try:
        buf = mmap.mmap(-1, bufsize)  # page-aligned, as O_DIRECT wants
        mv = memoryview(buf)
        h = digest.new(algorithm)
        size = os.fstat(fd).st_size
        done = 0
        try:
            while True:
                n = os.readv(fd, [buf])
                if not n:
                    break
                h.update(mv[:n])
                done += n
        except OSError:  # EINVAL: this file system does not do direct reads after all
            return None
        finally:
            mv.release()
            buf.close()
        return h.hexdigest() if done == size else None
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_and_hash(paths: Sequence[str]) -> dict[str, str]:
    """fsync every file on one thread while hashing them on this one; ``{path: digest}`` (:data:`.digest.WRITE`)."""
    errors: list[BaseException] = []

    def sync() -> None:
        try:
            for p in paths:
                _fsync_file(p)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    t = threading.Thread(target=sync, name="ckptd-fsync", daemon=True)
    t.start()
    sums = {p: hash_file(p) for p in paths}
    t.join()
    if errors:
        raise errors[0]
    return sums


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


#: Files the tensors are split into, each written (and hashed) by its own thread: serialising and hashing are
#: what bound one thread's write, and two files keep two cores and the disk busy.
WRITE_THREADS = max(1, min(2, os.cpu_count() or 1))
#: Bytes after which a file's dirty pages are handed to the disk (write-back started, not waited for).
WRITEBACK_WINDOW = 32 << 20
_SMALL = 64 << 10  # writes below this are gathered before they reach the kernel

_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``[offset, offset + nbytes)`` of ``fd`` to the disk without waiting (``sync_file_range``,
    Linux); elsewhere nothing (the final fsync writes everything).  Durability never depends on it."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError):
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def drop_cached(fd: int) -> None:
    """Drop a file's clean pages from the page cache (after its fsync): a later read comes from the disk."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:  # advice only
            pass


#: Write snapshot files past the page cache (``O_DIRECT``) where the file system allows it.  Through the page cache,
#: the kernel copies every byte once more and later reclaims the pages, on the cores the ranks train on: measured
#: here (``make bench``, part ``ckpt``) at 0.25-1.3 CPU-s per GiB against 0.03 direct, at the same disk speed.
DIRECT_IO = True
#: The page-aligned buffer a direct file's bytes are gathered in: one direct write each time it is full.
DIRECT_CHUNK = 8 << 20
_ALIGN = 4096
#: Spans from this size on are written from where they lie when they start on a page (:class:`Sink`).
DIRECT_SPAN = 1 << 20


class Sink:
    """Where a snapshot file's bytes go, in order: straight to the disk (``O_DIRECT``) through two page-aligned
    buffers of ``DIRECT_CHUNK`` bytes, one filled while a thread of the sink writes the other (full buffers,
    then the tail's whole pages; its last partial page through the page cache), or, where the file system
    refuses direct I/O, through the page cache, the disk asked to start writing back every
    ``WRITEBACK_WINDOW`` bytes.  :meth:`finish` fsyncs and drops what the page cache holds of the file.  Also
    the bench's ceiling of the write path's shape (the same sink, without serialisation or digest).

    A span of at least ``DIRECT_SPAN`` bytes that starts on a page, in memory and in the file (a staged box the
    writer placed there: :func:`_write_files`), goes to the disk from where it lies, its whole pages written by the
    sink's thread while the caller hashes them: no copy into the buffer (0.17 CPU-s per GiB measured here);
    only its last partial page is copied.
    """

    def __init__(self, path: str, direct: bool | None = None) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        if (DIRECT_IO if direct is None else direct) and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: no direct I/O on this file system
                    raise
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        self.pos = 0  # bytes taken
        self.kicked = 0  # bytes whose write-back was started (page cache only)
        self.fill = 0  # bytes in the buffer being filled (direct only)
        self._bufs = [mmap.mmap(-1, DIRECT_CHUNK) for _ in range(2)] if self.direct else []
        self._views = [memoryview(b) for b in self._bufs]
        self._cbufs = [ctypes.c_char.from_buffer(b) for b in self._bufs]
        self._addrs = [ctypes.addressof(c) for c in self._cbufs]  # memmove into them: one thread, the GIL released
        self._cur = 0 if self.direct else -1  # the buffer being filled (-1: the page cache, no buffer)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        # to the sink's thread, in file order: (buffer, bytes of it, then a span to write from where it lies, or None)
        self._full: queue.SimpleQueue[tuple[int, int, Any] | None] = queue.SimpleQueue()
        self._free.put(1)
        self.spans = 0  # bytes written from where they lay (no copy)
        self._io: threading.Thread | None = None
        self._error: BaseException | None = None

    def put(self, mv: memoryview, hasher: Any = None) -> None:
        """Take ``mv``'s bytes; ``hasher.update`` sees each of them once, in order (from the aligned buffer
        right after the copy into it, while they are in the cache, where there is one)."""
        if self._cur < 0:
            if hasher is not None:
                hasher.update(mv)
            _write_all(self.fd, mv)
            self.pos += len(mv)
            if self.pos - self.kicked >= WRITEBACK_WINDOW:
                _start_writeback(self.fd, self.kicked, self.pos - self.kicked)
                self.kicked = self.pos
            return
        if len(mv) >= DIRECT_SPAN and self.fill % _ALIGN == 0 and self.direct and _address(mv) % _ALIGN == 0:
            mv = self._span(mv, hasher)
        at, n = 0, len(mv)
        while at < n:
            k = min(n - at, DIRECT_CHUNK - self.fill)
            ctypes.memmove(self._addrs[self._cur] + self.fill, _address(mv) + at, k)
            if hasher is not None:
                hasher.update(self._views[self._cur][self.fill:self.fill + k])
            self.fill += k
            at += k
            if self.fill == DIRECT_CHUNK:
                self._hand_off()
        self.pos += n

    def _span(self, mv: memoryview, hasher: Any) -> memoryview:
        """``mv``'s whole pages to the disk from where they lie, by the sink's thread, in file order, while this
        one hashes them and goes on; returns the rest, to copy.  The memory must stay as it is until
        :meth:`finish` (a staged slot does: the daemon checks the slot's stamp after the write, and the verifier
        re-reads the disk)."""
        whole = len(mv) // _ALIGN * _ALIGN
        self._start_io()
        # what the buffer holds (whole pages: the span starts on a page of the file) goes in the same write
        self._full.put((self._cur, self.fill, mv[:whole]))
        if hasher is not None:
            hasher.update(mv[:whole])
        self.fill = 0
        self._cur = self._free.get()
        if self._error is not None:
            raise self._error
        self.pos += whole
        self.spans += whole
        return mv[whole:]

    def _start_io(self) -> None:
        if self._io is None:  # (a thread inherits its creator's priority: a background writer's stays low)
            self._io = threading.Thread(target=self._drain, daemon=True,
                                        name=f"{threading.current_thread().name}-io")
            self._io.start()

    def _hand_off(self) -> None:
        """The buffer's bytes (whole pages) to the sink's thread; the other one, once the disk has taken it, to
        fill."""
        self._start_io()
        self._full.put((self._cur, self.fill, None))
        self.fill = 0
        self._cur = self._free.get()
        if self._error is not None:
            raise self._error

    def _drain(self) -> None:
        while True:
            job = self._full.get()
            if job is None:
                return
            i, fill, span = job
            if self._error is None:
                try:
                    if span is None:
                        self._direct_write(self._views[i][:fill])
                    elif fill:
                        self._direct_writev(self._views[i][:fill], span)
                    else:
                        self._direct_write(span)
                except BaseException as exc:  # noqa: BLE001 - raised in the filling thread
                    self._error = exc
            self._free.put(i)

    def _stop_io(self, timeout_s: float | None = None) -> None:
        if self._io is not None:
            self._full.put(None)
            self._io.join(timeout_s)
            self._io = None

    def _direct_writev(self, first: memoryview, second: memoryview) -> None:
        """Both, in one write where the kernel takes them whole (one request to the disk, not a small one before
        each span); what a short write left, one after the other."""
        try:
            done = os.writev(self.fd, [first, second])
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            done = 0  # _direct_write turns direct I/O off and writes both through the page cache
        if done < len(first):
            self._direct_write(first[done:])
            done = len(first)
        self._direct_write(second[done - len(first):])

    def _direct_write(self, mv: memoryview) -> None:
        done = 0
        while done < len(mv):
            try:
                done += os.write(self.fd, mv[done:])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                # A file system that opens files for direct I/O and then refuses the writes: the page cache
                # from here on (the file's offset is where the last write that was taken left it).
                log.warning("%s: direct writes refused (%s); writing through the page cache", self.path, exc)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False

    def finish(self) -> int:
        """The buffers written, then the tail, fsync, the file's pages dropped; returns its size."""
        if self._cur >= 0:
            self._stop_io()
            if self._error is not None:
                raise self._error
            view = self._views[self._cur]
            whole = self.fill // _ALIGN * _ALIGN if self.direct else 0
            if whole:
                self._direct_write(view[:whole])
            if self.fill > whole and self.direct:  # the last partial page through the page cache: direct I/O
                # writes whole pages only
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            if self.fill > whole:
                _write_all(self.fd, view[whole:self.fill])
            self.fill = 0
        os.fsync(self.fd)
        drop_cached(self.fd)
        return self.pos

    def close(self) -> None:
        self._stop_io(60.0)  # abandoned mid-way: its thread ends after the write it is in
        self._views, self._cbufs, self._addrs = [], [], []
        for b in self._bufs:
            with contextlib.suppress(BufferError):  # a view still held somewhere: the collector unmaps it
                b.close()
        self._bufs = []
        os.close(self.fd)


def _address(mv: memoryview) -> int:
    """The address of ``mv``'s first byte (a read-only buffer too: only read through it), for ``ctypes.memmove``
    (which releases the GIL and copies on the calling thread: torch's copy would wake its intra-op threads)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8).data_ptr()


def _write_all(fd: int, mv: memoryview) -> None:
    done = 0
    while done < len(mv):
        done += os.write(fd, mv[done:done + (1 << 30)])


class _HashingFile:
    """A write-only file that computes its digest (:data:`.digest.WRITE`) from the bytes as they are written.

    Small writes (``torch.save``'s record headers) are gathered; large ones (a tensor's bytes, straight
    from the staging slot) go to the file's :class:`Sink` as they are, which hashes them as it copies them
    into its aligned buffer (direct to the disk where the file system allows it).  ``close()`` is a flush:
    DCP closes its streams before they are finished.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.sink = Sink(path)
        self.h = digest.new()
        self.pending = bytearray()

    # the file-object interface DCP, torch.save and pickle use
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.sink.fd

    def tell(self) -> int:
        return self.sink.pos + len(self.pending)

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        if n < _SMALL:
            self.pending += mv
            if len(self.pending) >= _SMALL:
                self.flush()
            return n
        self.flush()
        self._write(mv)
        return n

    def flush(self) -> None:
        if self.pending:
            data, self.pending = bytes(self.pending), bytearray()
            self._write(memoryview(data))

    def close(self) -> None:
        self.flush()

    def _write(self, mv: memoryview) -> None:
        self.sink.put(mv, self.h)  # the hash releases the GIL: the other write threads go on meanwhile

    def finish(self) -> tuple[int, str]:
        """Flush, write the rest, fsync, drop the file's pages from the page cache; ``(size, digest)``."""
        self.flush()
        return self.sink.finish(), self.h.hexdigest()

    def abandon(self) -> None:
        self.sink.close()


def _hashing_fs(sums: dict[str, tuple[int, str]], errors: list[BaseException],
                from_slot: dict[str, int] | None = None):
    """DCP's local file system whose write streams are :class:`_HashingFile`s; ``sums[name] = (size, digest)``
    (by file name: every file of a snapshot lies in its one directory).  A stream that failed leaves its
    exception in ``errors``: DCP's extra write threads would otherwise only print it.  ``from_slot[name]``: the
    bytes of the file written to the disk from where they lay (:meth:`Sink._span`)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):  # noqa: D401 - DCP interface
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            try:
                fh = _HashingFile(os.fspath(path))
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


#: The DCP items the writer places on a page of their file (their ``torch.save`` record's data too): from this
#: size on (a smaller one would cost more padding than its copy).
PLACE_FROM = DIRECT_SPAN


def _can_place_items() -> bool:
    """Whether this torch has what :func:`_write_files` uses: DCP's ``_write_item`` and ``torch.save``'s storage
    alignment (both in torch 2.13-2.15)."""
    import torch.serialization as ser
    from torch.distributed.checkpoint import filesystem

    try:
        params = list(inspect.signature(filesystem._write_item).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return (params == ["transforms", "stream", "data", "write_item", "storage_key", "serialization_format"]
            and hasattr(ser, "_get_storage_alignment"))


@contextlib.contextmanager
def _storage_alignment(n: int):
    """``torch.save`` places each record's data on a multiple of ``n`` from the record's start, in this thread
    (torch keeps the setting per thread)."""
    from torch.utils.serialization import config

    before = config.save.storage_alignment
    config.save.storage_alignment = n
    try:
        yield
    finally:
        config.save.storage_alignment = before


def _item_bytes(item: Any) -> int:
    """The bytes of a DCP tensor item's chunk (0 for a bytes item)."""
    import torch

    td = getattr(item, "tensor_data", None)
    if td is None:
        return 0
    return math.prod(td.chunk.sizes) * torch.empty((), dtype=td.properties.dtype).element_size()


def _interleaved(items: Sequence[Any]) -> list[Any]:
    """A file's items in the order the writer takes them: the bytes items, then the tensors, the small ones
    spread evenly between the large ones: a small one's serialisation (Python, the GIL) then runs while the
    sink's thread writes a large one, not in a tail after the last large one with the disk idle."""
    plain = [i for i in items if getattr(i, "tensor_data", None) is None]
    tensors = [i for i in items if getattr(i, "tensor_data", None) is not None]
    large = [i for i in tensors if _item_bytes(i) >= PLACE_FROM]
    small = [i for i in tensors if _item_bytes(i) < PLACE_FROM]
    if not large:
        return plain + small
    out = list(plain)
    for k, item in enumerate(large):
        out.append(item)
        out += small[k * len(small) // len(large):(k + 1) * len(small) // len(large)]
    return out


def _write_files(w: Any, planner: Any, file_queue: queue.Queue) -> Any:
    """DCP's file writing (its ``_write_item`` for every item, its files from ``file_queue`` in ``w.thread_count``
    threads), with every tensor of ``PLACE_FROM`` bytes or more on a page of its file: the stream is padded to
    the next page before the item (DCP's metadata records each item's offset, so readers seek past the padding)
    and ``torch.save`` puts the record's data on a page from there; the slot's box lies on a page too
    (:data:`.capture.ALIGN`), so the :class:`Sink` writes it to the disk from the slot, without a copy.  A
    smaller tensor keeps ``torch.save``'s own alignment (a page each would pad its records by ~24 KiB)."""
    from torch.distributed.checkpoint.filesystem import _write_item
    from torch.futures import Future
    from torch.utils.serialization import config

    results: list[Any] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            with _storage_alignment(config.save.storage_alignment):  # restored as it was, in this thread
                files()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            failed.append(exc)

    def files() -> None:
        usual = config.save.storage_alignment
        while True:
            try:
                path, storage_key, items = file_queue.get_nowait()
            except queue.Empty:
                return
            done = []
            with w.fs.create_stream(path, "wb") as stream:
                for item in _interleaved(items):
                    data = planner.resolve_data(item)
                    place = _item_bytes(item) >= PLACE_FROM
                    if place:
                        pad = -stream.tell() % _ALIGN
                        if pad:
                            stream.write(bytes(pad))
                    config.save.storage_alignment = _ALIGN if place else usual
                    done.append(_write_item(w.transforms, stream, data, item, storage_key, w.serialization_format))
            results.extend(done)

    threads = [threading.Thread(target=work, name=f"{threading.current_thread().name}-w{k}", daemon=True)
               for k in range(1, w.thread_count)]
    for t in threads:
        t.start()
    work()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    fut: Future = Future()
    fut.set_result(results)
    return fut


def _writer(path: str, compress: bool, ndir: str, step: int, faults_: TestFaults = NO_FAULTS,
            sums: dict[str, tuple[int, str]] | None = None, from_slot: dict[str, int] | None = None):
    from torch.distributed.checkpoint import FileSystemWriter

    errors: list[BaseException] = []

    class _Writer(FileSystemWriter):
        """FileSystemWriter with the ``writing`` fault point between the shard files and ``.metadata``, which
        fails when any write thread failed (DCP would return the other threads' results as if complete); an
        uncompressed one through hashing streams writes its files itself (:func:`_write_files`: every large
        tensor's bytes on a page of the file)."""

        def _write_data(self, planner, file_queue):  # noqa: D401 - DCP interface (torch 2.13-2.15)
            if (compress or sums is None or not _can_place_items()
                    or getattr(self.serialization_format, "value", None) != "torch_save"):
                return super()._write_data(planner, file_queue)
            return _write_files(self, planner, file_queue)

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

    # sync_files=False: every stream fsyncs itself when it is finished (_HashingFile.finish)
    w = _Writer(path, single_file_per_rank=True, sync_files=False, thread_count=WRITE_THREADS, overwrite=False,
                _extensions=zstd_extensions(compress))
    if sums is not None:
        w.fs = _hashing_fs(sums, errors, from_slot)
    return w


def write_snapshot(ndir: str, step: int, descs: Sequence[Mapping[str, Any]], *, compress: bool = False,
                   node: str = "", timings: dict[str, float] | None = None,
                   faults: TestFaults = NO_FAULTS, key: bytes | None = None,
                   before_commit: Callable[[], None] | None = None,
                   from_slot: dict[str, int] | None = None) -> tuple[str, int]:
    """Write and commit one snapshot from the node's staged descriptors; return ``(path, size_bytes)``.

    The ranks proved their capture before handing it over (``meta["capture"]``); a snapshot whose
    descriptors say the proof failed is refused.  ``timings`` (if given) receives the seconds spent in
    ``dcp_save`` and ``fsync_hash``; ``from_slot`` (if given), by file, the bytes written to the disk straight
    from the slots (no copy: :func:`_write_files`).  ``key``: the run's key, which signs the manifest (:mod:`.auth`).
    ``before_commit``: called once every byte is written and hashed, before the manifest and the rename; what it
    raises fails the snapshot (the daemon checks there that the slots still hold this step).
    """
    timings = {} if timings is None else timings
    import torch.distributed.checkpoint as dcp

    descs = sorted(descs, key=lambda d: d["local_rank"])
    meta = descs[0]["meta"]
    bad = [d["rank"] for d in descs if (d["meta"].get("capture") or {}).get("ok") is False]
    if bad:
        why = descs[0]["meta"]["capture"].get("reason") if descs else ""
        raise CheckpointError(f"step {step}: the capture of rank(s) {bad} does not match the live state ({why}); "
                              f"snapshot not written")
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
        names = sorted(os.listdir(tmp))
        t = time.monotonic()
        files = {}
        rest = [os.path.join(tmp, n) for n in names if n not in written]
        sums = fsync_and_hash(rest) if rest else {}  # only what did not go through a hashing stream (none today)
        for n in names:
            size = os.path.getsize(os.path.join(tmp, n))
            if n in written and written[n][0] != size:
                raise CheckpointError(f"{n} has {size} bytes, {written[n][0]} were written")
            files[n] = {"size": size, digest.WRITE: written[n][1] if n in written else sums[os.path.join(tmp, n)]}
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
