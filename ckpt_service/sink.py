"""The write fast path of a snapshot's files: the staged bytes to the disk with the fewest copies, hashed as written.

- :class:`Sink`: where one file's bytes go, in order: past the page cache (``O_DIRECT``) through two page-aligned
  buffers, a large box straight from its staging slot, or through the page cache with its write-back started
  while it is still being written; fsynced and dropped from the page cache when finished;
- :class:`HashingFile`: the file object DCP and ``torch.save`` write into; it computes the file's digest
  (:mod:`.digest`) from the bytes as they pass (no second pass over them) and hands them to its :class:`Sink`;
- :func:`write_files`: DCP's file writing with every large tensor on a page of its file, so the :class:`Sink`
  writes it to the disk from the slot itself, without a copy.

The private torch names this needs (DCP's per-item writer, ``torch.save``'s storage alignment) come through
:mod:`.compat`.  Who calls: :mod:`.dcp_write` (the snapshot's DCP writing), :mod:`.writecheck` (``drop_cached``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import queue
import threading
import warnings
from typing import Any, Sequence

from ckpt_service import digest
from ckpt_service.compat import write_item

log = logging.getLogger(__name__)

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
    writer placed there: :func:`write_files`), goes to the disk from where it lies, its whole pages written by the
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
        """``mv``'s whole pages to the disk from where they lie, by the sink's thread, in file order, while this one
        hashes them and goes on; returns the rest, to copy.  The memory must stay as it is until :meth:`finish` (a
        staged slot does: the daemon checks the slot's stamp after the write, and the verifier re-reads the disk)."""
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


class HashingFile:
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


#: The DCP items the writer places on a page of their file (their ``torch.save`` record's data too): from this
#: size on (a smaller one would cost more padding than its copy).
PLACE_FROM = DIRECT_SPAN


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


def write_files(w: Any, planner: Any, file_queue: queue.Queue) -> Any:
    """DCP's file writing (its per-item writer, :func:`.compat.write_item`, for every item, its files from
    ``file_queue`` in ``w.thread_count`` threads), with every tensor of ``PLACE_FROM`` bytes or more on a page of its
    file: the stream is padded to the next page before the item (DCP's metadata records each item's offset, so readers
    seek past the padding) and ``torch.save`` puts the record's data on a page from there; the slot's box lies on a
    page too (:data:`.capture.ALIGN`), so the :class:`Sink` writes it to the disk from the slot, without a copy.  A
    smaller tensor keeps ``torch.save``'s own alignment (a page each would pad its records by ~24 KiB)."""
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
                    done.append(write_item(w.transforms, stream, data, item, storage_key, w.serialization_format))
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

