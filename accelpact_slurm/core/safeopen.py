"""The one way a file in a run or snapshot directory is opened: checked first, never followed, bounded.

Anything that could once write into a run directory (another user while it was group- or world-writable, a shared
tier's other members, a careless ``ln -s``) can leave, under a name the job or a tool opens: a symbolic link (an
``open(..., O_CREAT)`` of ``.accelpact-lock`` or ``events.jsonl`` through it truncates or appends to the file it names
with the job's rights: a root job, any file); a FIFO (a plain ``open()`` of ``summary.json`` waits for a writer
forever); a link to ``/dev/zero`` or a file of gigabytes (a read or a parse that never ends or fills memory); a file of
another user (a record the job would trust).  So every such open goes through this module, after the directory's own
check (:func:`check_dir`: a plain directory of the job's user that no one else may write):

- :func:`open_regular` (reads): ``O_NOFOLLOW`` (a link is refused), ``O_NONBLOCK`` (a FIFO opens at once), then
  ``fstat`` on the very descriptor: a regular file only, within the caller's bound (refused before a byte is read), of
  the expected owner where given;
- :func:`open_writable` (locks, logs, records): ``O_CREAT | O_EXCL | O_NOFOLLOW`` creates a new file (no link or FIFO
  can be in its place); an existing one is opened without ``O_CREAT``, with ``O_NOFOLLOW`` and ``O_NONBLOCK``, and
  must be a regular file of this process's user;
- :func:`read_regular`, :func:`read_fd`: exactly the bytes ``fstat`` announced; a file that changes size is refused.

Torch-free, and the lowest layer: ``ckpt_service.safeio`` (walks, JSON records) and the event log's readers build on it.
"""

from __future__ import annotations

import errno
import os
import stat

from accelpact_slurm.core.errors import ConfigError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class NotRegular(OSError):
    """The path is a link, a FIFO, a device, a socket, a directory, too large, or not the expected owner's.

    ``strerror`` names the path and what is wrong; :attr:`why` says the same without the path (for a line
    that names the path already).
    """

    def __init__(self, code: int, path: str, why: str) -> None:
        super().__init__(code, f"{path} {why}")
        self.path = path
        self.why = why

    def __reduce__(self):
        return (type(self), (self.errno, self.path, self.why))


def kind(mode: int) -> str:
    """What a file is, in words, from its ``st_mode``."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def check_dir(path: str, field: str = "run dir") -> os.stat_result:
    """The directory ``path`` is a plain directory of this process's user that no other user may write.

    Called before anything in a run directory is opened: in a directory another user may write, any name
    can be a link or a FIFO of theirs by the time it is opened, and the file behind it can be replaced.

    Raises:
        ConfigError: one line naming the path, what is wrong and the fix (``field`` names the setting).
    """
    path = os.path.abspath(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(field, path, "is not a plain directory (a link or a file): use a real directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(field, path, f"belongs to uid {st.st_uid}, not to the job's user (uid {os.geteuid()}): "
                                       f"its snapshots and key could be anyone's; use a run directory of your own")
    if st.st_mode & 0o022:
        raise ConfigError(field, path, f"has mode {oct(st.st_mode & 0o777)}: other users may delete its key, "
                                       f"plant snapshots or links, or forge its event log; run chmod go-w {path}")
    return st


def _checked(fd: int, path: str, limit: int | None, owner: int | None, verb: str) -> os.stat_result:
    """``fstat`` of the descriptor just opened: a regular file, of at most ``limit`` bytes, of ``owner``."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, path, f"is {kind(st.st_mode)}, not a regular file: not {verb}")
        if limit is not None and st.st_size > limit:
            raise NotRegular(errno.EFBIG, path, f"has {st.st_size} bytes, more than the {limit} read here: "
                                                f"not {verb}")
        if owner is not None and st.st_uid != owner:
            raise NotRegular(errno.EPERM, path, f"belongs to uid {st.st_uid}, not to uid {owner}: not {verb}")
    except BaseException:
        os.close(fd)
        raise
    return st


def _refuse_link(exc: OSError, path: str, verb: str) -> None:
    if exc.errno == errno.ELOOP:  # O_NOFOLLOW on a link
        raise NotRegular(errno.ELOOP, path, f"is a symbolic link: not followed, not {verb}") from None
    if exc.errno == errno.ENXIO:  # a FIFO without a reader (O_WRONLY | O_NONBLOCK), a socket
        try:
            what = kind(os.lstat(path).st_mode)
        except OSError:
            what = "a FIFO or a socket"
        raise NotRegular(errno.ENXIO, path, f"is {what}, not a regular file: not {verb}") from None


def open_regular(path: str, limit: int | None = None, *, owner: int | None = None,
                 follow: bool = False) -> tuple[int, os.stat_result]:
    """``(fd, fstat)`` of ``path`` opened read-only; refuses a link, a FIFO, a device, a directory, a file over
    ``limit`` bytes and, with ``owner``, a file of another uid.  The caller closes ``fd``.

    ``follow``: only for a file the operator names outside any run directory (a Slurm log): a link is
    followed, and what it names must still be a regular file within the bound.

    Raises:
        NotRegular: naming the path and what it is instead; FileNotFoundError and other OSErrors as they come.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        _refuse_link(exc, path, "read")
        raise
    return fd, _checked(fd, path, limit, owner, "read")


def open_writable(path: str, *, append: bool = False, create: bool = True, mode: int = 0o600,
                  owner: int | None = -1) -> tuple[int, os.stat_result]:
    """``(fd, fstat)`` of ``path`` opened read-write (``append``: write-only, appending), never through a link.

    A missing file is created with ``O_EXCL`` (whatever takes its name first, a link or a FIFO, makes the
    create fail rather than be followed); an existing one is opened without ``O_CREAT`` and must be a
    regular file of ``owner`` (default: this process's user; None: any).  The descriptor is made blocking
    again (a regular file ignores the flag; a lock's ``flock`` is unaffected).

    Raises:
        NotRegular: a link, FIFO, device, directory, or another user's file; FileNotFoundError when missing
        and not ``create``; other OSErrors as they come.
    """
    owner = os.geteuid() if owner == -1 else owner
    base = (os.O_WRONLY | os.O_APPEND if append else os.O_RDWR) | os.O_NOFOLLOW | _CLOEXEC
    for _ in range(3):  # created and removed by someone else in between: try again, a few times
        if create:
            try:
                fd = os.open(path, base | os.O_CREAT | os.O_EXCL, mode)
                return fd, os.fstat(fd)
            except FileExistsError:
                pass
            except OSError as exc:
                _refuse_link(exc, path, "opened")
                raise
        try:
            fd = os.open(path, base | os.O_NONBLOCK)
        except FileNotFoundError:
            if create:
                continue
            raise
        except OSError as exc:
            _refuse_link(exc, path, "opened")
            raise
        st = _checked(fd, path, None, owner, "opened")
        os.set_blocking(fd, True)
        return fd, st
    raise NotRegular(errno.EAGAIN, path, "keeps appearing and disappearing: not opened")


def create_new(path: str, mode: int = 0o600) -> int:
    """A new file at ``path``, opened write-only: ``O_CREAT | O_EXCL | O_NOFOLLOW`` (anything already there, a
    link included, fails the create with FileExistsError instead of being followed or truncated)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, mode)


def read_fd(fd: int, size: int, path: str = "") -> bytes:
    """Exactly ``size`` bytes from ``fd`` (from its current offset); one more byte than that is an error."""
    chunks, left = [], size
    while left > 0:
        b = os.read(fd, min(left, 1 << 20))
        if not b:
            raise NotRegular(errno.EIO, path, f"ended after {size - left} of {size} bytes (it shrank): not read")
        chunks.append(b)
        left -= len(b)
    if os.read(fd, 1):
        raise NotRegular(errno.EFBIG, path, f"grew past the {size} bytes it had when opened: not read")
    return b"".join(chunks)


def read_regular(path: str, limit: int, *, owner: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``, refused before reading); see
    :func:`open_regular`."""
    fd, st = open_regular(path, limit, owner=owner)
    try:
        return read_fd(fd, st.st_size, path)
    finally:
        os.close(fd)


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
