"""What the writer checks before it commits a snapshot, and the file digests it lists in the manifest.

- :func:`refuse_failed_capture`: a snapshot whose ranks report a failed capture proof (``meta["capture"]``,
  computed on the ranks against the live state on the first snapshot of every start) is never written;
- :func:`file_entries`: the manifest's entry of every file (size and digest): each file's size on the disk
  must be what its hashing stream wrote (a short write is refused), and a file that did not go through one
  is hashed here while another thread fsyncs it (:func:`fsync_and_hash`);
- :func:`hash_file`: a file's digest, read back from the disk past the page cache on request (the verification
  re-read sees the disk's bytes, not a cached copy).

Who calls: :func:`ckpt_service.dcp_write.write_snapshot`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import Any, Mapping, Sequence

from accelpact_slurm.core.errors import CheckpointError
from accelpact_slurm.core.safeopen import open_regular

from ckpt_service import digest
from ckpt_service.sink import drop_cached


def refuse_failed_capture(step: int, descs: Sequence[Mapping[str, Any]]) -> None:
    """Raise :class:`CheckpointError` when any rank's descriptor says its capture proof failed."""
    bad = [d["rank"] for d in descs if (d["meta"].get("capture") or {}).get("ok") is False]
    if bad:
        why = descs[0]["meta"]["capture"].get("reason") if descs else ""
        raise CheckpointError(f"step {step}: the capture of rank(s) {bad} does not match the live state ({why}); "
                              f"snapshot not written")


def file_entries(tmp: str, written: Mapping[str, tuple[int, str]]) -> dict[str, dict[str, Any]]:
    """``{name: {"size": N, <digest.WRITE>: HEX}}`` of every file in the directory ``tmp``; ``written[name]``:
    ``(size, digest)`` of a file its hashing stream wrote (fsynced already), which must match its size on the
    disk; any other file is fsynced and hashed here."""
    names = sorted(os.listdir(tmp))
    rest = [os.path.join(tmp, n) for n in names if n not in written]
    sums = fsync_and_hash(rest) if rest else {}  # only what did not go through a hashing stream (none today)
    files = {}
    for n in names:
        size = os.path.getsize(os.path.join(tmp, n))
        if n in written and written[n][0] != size:
            raise CheckpointError(f"{n} has {size} bytes, {written[n][0]} were written")
        files[n] = {"size": size, digest.WRITE: written[n][1] if n in written else sums[os.path.join(tmp, n)]}
    return files


def hash_file(path: str, algorithm: str = digest.WRITE, bufsize: int = 4 << 20, drop: bool = False) -> str:
    """The file's digest (:mod:`.digest`), read into one reused buffer; ``drop``: read it from the disk, past the
    page cache (``O_DIRECT``, where the file system allows it; else a buffered read whose pages are dropped
    afterwards), for a verification re-read that must see what the disk holds and that nothing else needs."""
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

