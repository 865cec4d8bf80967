"""Reading snapshot and run-directory files that someone else may have planted: regular files only, bounded.

Anything that can write into the shared tier (or a run directory's snapshot folders) can put there,
under a name the reload reads, a FIFO (every ``open()`` blocks forever), a link to ``/dev/zero`` (a
read that never ends), or a link to ``/usr`` (a walk or a copy of a whole tree).  Every read of such
a file goes through :func:`open_regular`: ``O_NOFOLLOW`` (a link is refused, not followed),
``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a writer), then ``fstat`` on the very
descriptor: only a regular file of at most the caller's bound is read.  Directory walks use
:func:`entries`, which never follows a link and says what each entry is.  Torch-free.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any
from accelpact_slurm.core.events import TooDeep, parse_json

#: The bound of a JSON record of ours (a manifest lists a few hundred files; a state record its history).
JSON_LIMIT = 16 << 20


class NotRegular(OSError):
    """The path is not a regular file of an acceptable size (a FIFO, device, link, directory, or too large)."""


def kind(mode: int) -> str:
    """What a file is, in words, from its ``st_mode``."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def open_regular(path: str, limit: int | None = None) -> tuple[int, os.stat_result]:
    """``(fd, fstat)`` of ``path`` opened read-only; refuses a link, a FIFO, a device or a file over ``limit``.

    The descriptor is non-blocking only while it is opened (regular files ignore the flag anyway).

    Raises:
        NotRegular: naming the path and what it is instead; FileNotFoundError and other OSErrors as they come.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW on a link
            raise NotRegular(errno.ELOOP, f"{path} is a symbolic link: not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, f"{path} is {kind(st.st_mode)}, not a regular file: not read")
        if limit is not None and st.st_size > limit:
            raise NotRegular(errno.EFBIG, f"{path} has {st.st_size} bytes, more than the {limit} read here")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_fd(fd: int, size: int, path: str = "") -> bytes:
    """Exactly ``size`` bytes from ``fd`` (from its current offset); one more byte than that is an error."""
    chunks, left = [], size
    while left > 0:
        b = os.read(fd, min(left, 1 << 20))
        if not b:
            raise NotRegular(errno.EIO, f"{path} ended after {size - left} of {size} bytes (it shrank)")
        chunks.append(b)
        left -= len(b)
    if os.read(fd, 1):
        raise NotRegular(errno.EFBIG, f"{path} grew past the {size} bytes it had when opened")
    return b"".join(chunks)


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); see :func:`open_regular`."""
    fd, st = open_regular(path, limit)
    try:
        return read_fd(fd, st.st_size, path)
    finally:
        os.close(fd)


def read_json_why(path: str, limit: int = JSON_LIMIT) -> tuple[Any, str | None]:
    """``(document, None)``, or ``(None, why it cannot be read)``: missing, not a regular file, too large, not JSON."""

    try:
        data = read_regular(path, limit)
    except FileNotFoundError:
        return None, f"{os.path.basename(path)} is missing"
    except NotRegular as exc:
        return None, exc.strerror
    except OSError as exc:
        return None, f"{path}: cannot read it ({exc.strerror or exc})"
    try:
        return parse_json(data), None
    except TooDeep as exc:
        return None, f"{path}: {exc}"
    except ValueError:
        return None, f"{path} is not JSON"


def entries(path: str) -> list[tuple[str, os.stat_result]]:
    """``[(name, lstat)]`` of a directory's entries, sorted; links are reported as links, never followed."""
    out = []
    with os.scandir(path) as it:
        for e in it:
            try:
                out.append((e.name, e.stat(follow_symlinks=False)))
            except FileNotFoundError:  # removed meanwhile
                continue
    return sorted(out, key=lambda x: x[0])


def is_plain_dir(path: str) -> bool:
    """``path`` is a directory, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False

