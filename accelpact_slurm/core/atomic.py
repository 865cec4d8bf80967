"""Durable, atomic small-file writes: readers see the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
from typing import IO, Any, Callable

from accelpact_slurm.core.safeopen import create_new


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable (the directory's own metadata)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, write: Callable[[IO[bytes]], object]) -> None:
    """``write`` the file's bytes under a temporary name, fsync, rename over ``path``, fsync the directory; a
    failure (a full disk) removes the temporary file and raises."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:  # a leftover of this pid (a crash) is ours to replace; a link planted at the name is removed, not followed
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    try:
        # O_EXCL | O_NOFOLLOW: whatever takes the name first (a link, a FIFO) fails the create (core.safeopen)
        with os.fdopen(create_new(tmp, 0o644), "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:  # a full disk must not keep the half-written file's blocks too
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path: str, data: Any, indent: int = 1) -> None:
    """Temporary name, fsync, rename, fsync the directory."""
    text = json.dumps(data, indent=indent, sort_keys=True) + "\n"
    write_atomic(path, lambda fh: fh.write(text.encode("utf-8")))
