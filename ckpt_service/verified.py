"""Verify what is loaded on the handle it is loaded from: the manifest, the files, and DCP's reader over them.

Authenticating ``.metadata`` on one ``open()`` and letting DCP unpickle it on a second leaves a window: whoever can
rename entries of the directory (anyone who can write the shared tier) puts her pickle in its place in between, and it
runs as the job's user.  So nothing here re-opens a file between its check and its use: :func:`read_manifest` reads
``manifest.json`` once (bounded, :mod:`.safeio`), authenticates it under the run's key and checks it was signed for
the step the directory is named after (an authentic older snapshot renamed to a newer step is refused);
:func:`open_checked` opens one listed file and checks on that descriptor that it is a regular file of the job's user
that nobody else may write, of the listed size, and hashes it there; :class:`VerifiedReader` is DCP's
``FileSystemReader`` whose ``read_metadata`` unpickles the verified bytes held in memory and whose every data stream
is a descriptor that passed :func:`open_checked`.  A file that is still the inode the node's daemon hashed when it
verified the snapshot (:mod:`.seal`) passes :func:`open_checked` without a second hash (every other check runs).

Who calls: the reload (:func:`accelpact_slurm.runtime.state.appstate.load`) and the verification
(:func:`ckpt_service.verify.verify_snapshot`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping

from accelpact_slurm.core.errors import CheckpointError
from ckpt_service import digest, seal
from ckpt_service.auth import authenticate
from ckpt_service.layout import MANIFEST, step_of
from ckpt_service.safeio import JSON_LIMIT, NotRegular, open_regular, read_fd, read_json_why

METADATA = ".metadata"
NAMES = {"sha256": "SHA-256", "blake3": "BLAKE3"}
_BUF = 4 << 20


def read_manifest(path: str, key: bytes | None) -> tuple[dict[str, Any] | None, str]:
    """``(manifest, reason)`` of the snapshot directory ``path``; ``None`` with the reason when it is refused.

    ``key=None`` skips the authentication (only a test's negative control).  The step binding is checked
    whenever the directory has a step name (``step-NNNNNNNNNN``).
    """
    manifest, bad = read_json_why(os.path.join(path, MANIFEST), JSON_LIMIT)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, f"manifest.json missing or unreadable{f' ({bad})' if bad else ''}"
    if key is not None:
        ok, why = authenticate(manifest, key)
        if not ok:
            return None, why
    named = step_of(path)
    if named is not None and manifest.get("step") != named:
        return None, (f"the manifest was signed for step {manifest.get('step')!r}, the directory is named step "
                      f"{named}: an older snapshot renamed to a newer step is refused")
    for name in manifest["files"]:
        if not isinstance(name, str) or os.sep in name or name in ("", ".", ".."):
            return None, f"the manifest's entry {name!r} is not a file name"
    why = digest.check_entries(manifest)
    if why is not None:
        return None, why
    return manifest, "manifest read"


def _hash_fd(fd: int, drop: bool, algorithm: str) -> str:
    """The digest (``algorithm``) of what ``fd`` holds from offset 0; ``drop``: the file's cached pages are dropped first, so the
    bytes come from the disk (a verification re-read), and again after (nothing else needs them)."""
    if drop and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    h = digest.new(algorithm)
    # One buffer read into again and again: a fresh 4 MiB object per read costs the kernel a fresh mapping's
    # zeroed pages each time (the development machine: 1.3 instead of 0.3 CPU-s per GiB in some runs).
    buf = bytearray(_BUF)
    view = memoryview(buf)
    offset = 0
    while True:
        n = os.preadv(fd, [buf], offset)
        if not n:
            break
        h.update(view[:n])
        offset += n
    if drop and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return h.hexdigest()


def open_checked(path: str, name: str, want: dict[str, Any], *, drop: bool = False, keep_bytes: bool = False,
                 sealed: Mapping[str, seal.Identity] | None = None,
                 hashed: dict[str, seal.Identity] | None = None) -> tuple[int, bytes | None]:
    """``(fd, bytes or None)`` of the listed file ``name`` in ``path``, checked on that descriptor.

    ``keep_bytes``: the file is read into memory once and those bytes are hashed and returned (for
    ``.metadata``, which is unpickled from exactly them).  ``sealed``: what :func:`ckpt_service.seal.read`
    returned for ``path``; a file whose descriptor shows the inode the daemon hashed, unchanged, is not hashed
    again (every other check still runs).  ``hashed``: gets ``name``'s identity when it was hashed and matched,
    and the inode did not change meanwhile (what a seal records).  The caller closes ``fd``.

    Raises:
        CheckpointError: naming the file and what is wrong with it (missing, not a regular file, not the
            job's user's, writable by others, another size, another digest).
    """
    p = os.path.join(path, name)
    try:
        fd, st = open_regular(p, int(want["size"]))
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing") from None
    except NotRegular as exc:
        raise CheckpointError(f"{name}: {exc.strerror}") from None
    except OSError as exc:
        raise CheckpointError(f"{name}: cannot open it ({exc.strerror or exc})") from None
    try:
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise CheckpointError(f"{name} belongs to uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}: only a "
                                  f"file of this user (uid {os.getuid()}) that nobody else can write is read")
        if st.st_size != want["size"]:
            raise CheckpointError(f"{name} has {st.st_size} bytes, the manifest says {want['size']} "
                                  f"(truncated or grown)")
        data = None
        if not keep_bytes and sealed and sealed.get(name) == seal.identity(st):
            return fd, None  # the inode the daemon hashed, unchanged since (ckpt_service.seal)
        algorithm, expected = digest.entry(want)
        if keep_bytes:
            data = read_fd(fd, st.st_size, p)
            got = digest.of_bytes(data, algorithm)
        else:
            got = _hash_fd(fd, drop, algorithm)
        if got != expected:
            raise CheckpointError(f"{name} fails its {NAMES.get(algorithm, algorithm)} checksum (corrupted)")
        if hashed is not None and seal.identity(os.fstat(fd)) == seal.identity(st):
            hashed[name] = seal.identity(st)
        return fd, data
    except NotRegular as exc:
        os.close(fd)
        raise CheckpointError(f"{name}: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise


#: How far one request of the read-ahead reaches.
_AHEAD = 32 << 20


@contextlib.contextmanager
def reading_ahead(fd: int, size: int) -> Iterator[None]:
    """While DCP reads the file open on ``fd`` item by item (each read waits for the disk, then the CPU copies the
    item while the disk waits), a thread asks the kernel to read the whole file ahead (``POSIX_FADV_WILLNEED``,
    :data:`_AHEAD` at a time, from the start), so the disk and the copies overlap.  On a descriptor of its own,
    stopped and joined when the stream closes; where the kernel cannot, nothing happens."""
    if not hasattr(os, "posix_fadvise"):
        yield
        return
    own = os.dup(fd)
    stop = threading.Event()

    def ahead() -> None:
        try:
            for offset in range(0, size, _AHEAD):
                if stop.is_set():
                    break
                os.posix_fadvise(own, offset, min(_AHEAD, size - offset), os.POSIX_FADV_WILLNEED)
        except OSError:  # a file system without read-ahead: the reads still read
            pass

    t = threading.Thread(target=ahead, name="ckpt-read-ahead", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        os.close(own)


def verified_metadata_bytes(path: str, key: bytes | None) -> tuple[dict[str, Any], bytes]:
    """``(manifest, the bytes of .metadata)``: authenticated, and checked on the one read they came from."""
    manifest, why = read_manifest(path, key)
    if manifest is None:
        raise CheckpointError(f"{path}: {why}")
    want = manifest["files"].get(METADATA)
    if want is None:
        raise CheckpointError(f"{path}: the manifest lists no .metadata")
    fd, data = open_checked(path, METADATA, want, keep_bytes=True)
    os.close(fd)
    assert data is not None
    return manifest, data


def unpickle_metadata(data: bytes) -> Any:
    """DCP's ``Metadata`` from the verified bytes (what ``FileSystemReader.read_metadata`` does with its own read)."""
    return pickle.loads(data)  # noqa: S301 - the bytes passed the run's HMAC'd manifest on this very read


def _verified_reader_class() -> type:
    """The class is built on first use: importing this module must not import torch (the daemon's CLI)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _CheckedFS(FileSystem):
        """DCP's file system whose read streams are descriptors checked against the manifest when opened."""

        def __init__(self, root: str, files: dict[str, Any], sealed: Mapping[str, seal.Identity] | None,
                     opened: Mapping[str, int] | None) -> None:
            self.root, self.files, self.sealed, self.opened = root, files, sealed, opened or {}

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
            if mode != "rb":
                raise CheckpointError(f"{path}: a verified snapshot is read only")
            name = Path(path).name
            if os.path.dirname(os.path.abspath(path)) != os.path.abspath(self.root) or name not in self.files:
                raise CheckpointError(f"{path}: .metadata names a file the manifest does not list")
            if name == METADATA:
                raise CheckpointError(f"{path}: .metadata is read once, from its verified bytes")
            if name in self.opened:  # checked by the caller on this descriptor already
                with os.fdopen(os.dup(self.opened[name]), "rb") as fh:
                    yield fh
                return
            fd, _ = open_checked(self.root, name, self.files[name], sealed=self.sealed)
            with os.fdopen(fd, "rb") as fh, reading_ahead(fd, int(self.files[name]["size"])):
                yield fh

    class VerifiedReader(FileSystemReader):
        """``FileSystemReader`` over a snapshot checked on the handles it is read from (see the module)."""

        def __init__(self, path: str, key: bytes | None, checked: tuple[dict[str, Any], bytes] | None = None,
                     sealed: Mapping[str, seal.Identity] | None = None, opened: Mapping[str, int] | None = None) -> None:
            super().__init__(path)
            manifest, self._metadata_bytes = checked or verified_metadata_bytes(str(path), key)
            self.fs = _CheckedFS(str(path), manifest["files"], sealed, opened)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise CheckpointError("per-rank .metadata files are not part of a snapshot of this service")
            metadata = unpickle_metadata(self._metadata_bytes)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader


_READER: type | None = None


def VerifiedReader(path: str, key: bytes | None,  # noqa: N802 - a class, built on first use
                   checked: tuple[dict[str, Any], bytes] | None = None,
                   sealed: Mapping[str, seal.Identity] | None = None, opened: Mapping[str, int] | None = None) -> Any:
    """A DCP ``StorageReader`` for the snapshot at ``path``, verified under ``key`` (see the module docstring).

    ``checked``: what :func:`verified_metadata_bytes` returned for ``path`` (several loads of one snapshot
    read ``.metadata`` once).  ``sealed``: what :func:`ckpt_service.seal.read` returned for it (a reload): a
    data file that is still the inode its daemon hashed is read without a second hash.  ``opened``: ``{name:
    descriptor}`` of data files the caller opened with :func:`open_checked` (read through a duplicate of it).

    Raises:
        CheckpointError: the manifest or ``.metadata`` does not pass (nothing was unpickled).
    """
    global _READER
    if _READER is None:
        _READER = _verified_reader_class()
    return _READER(path, key, checked, sealed, opened)
