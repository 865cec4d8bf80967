"""Where the checkpoint service keeps things (pure path arithmetic, no torch).

- node directory (emulated NVMe): ``checkpoint.local_dir`` (environment variables expanded, e.g.
  ``/nvme/$SLURM_JOB_ID``) joined with the node name, else ``RUN_DIR/node-local/<node>``;
- committed snapshots: ``<node dir>/step-NNNNNNNNNN`` (ten digits: names sort numerically);
- in progress: ``<node dir>/.tmp-step-NNNNNNNNNN-<pid>`` (never selected, removed on the next start);
- being deleted: ``<node dir>/.del-step-...`` (renamed first, so a half-deleted snapshot is never listed);
- shared tier: ``checkpoint.shared_dir`` or ``RUN_DIR/shared-ckpt``;
- socket: ``/tmp/accelpact-<uid>/ckptd-<hash of node dir>.sock`` (short: Unix socket paths are
  limited to 107 bytes; the directory is mode 0700);
- staging: ``/dev/shm/accelpact-<uid>/<hash of node dir>/step-N/rank-L.pt``.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile

from accelpact_slurm.core.errors import CheckpointError

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
MANIFEST = "manifest.json"
STATE = "state.json"
LOCK = "ckptd.lock"
INDEX_DIR = "ckpt-index"
DAEMON_FAILED_SUFFIX = ".daemon-failed.json"
#: Ten ASCII digits: ``\d`` would take other scripts' digits too, and ``int()`` reads them.
_STEP_RE = re.compile(r"^step-([0-9]{10})$")
STEP_DIGITS = 10
#: Steps the service accepts: step directory names hold ten digits.
MAX_STEP = 10**STEP_DIGITS - 1


def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{step:010d}"


def step_of(name: str) -> int | None:
    """The step of a committed snapshot directory name, ``None`` for anything else."""
    m = _STEP_RE.match(os.path.basename(name.rstrip("/")))
    return int(m.group(1)) if m else None


def step_name_problem(name: str) -> str | None:
    """Why a name that starts like a snapshot's (``step-``) is none the layout writes; ``None`` for a step name
    or a name of another kind (``.tmp-``, ``manifest.json``)."""
    base = os.path.basename(name.rstrip("/"))
    if not base.startswith(STEP_PREFIX) or step_of(base) is not None:
        return None
    tail = base[len(STEP_PREFIX):]
    if tail.isascii() and tail.isdigit():
        return f"{len(tail)} digits, the layout writes {STEP_DIGITS}: no step of this service"
    return f"not {STEP_DIGITS} ASCII digits after {STEP_PREFIX!r}: no step of this service"


def node_dir(run_dir: str, node: str, local_dir: str | None = None) -> str:
    if local_dir:
        return os.path.abspath(os.path.join(os.path.expandvars(os.path.expanduser(local_dir)), node))
    return os.path.abspath(os.path.join(run_dir, "node-local", node))


def shared_dir(run_dir: str, configured: str | None = None) -> str:
    if configured:
        return os.path.abspath(os.path.expandvars(os.path.expanduser(configured)))
    return os.path.abspath(os.path.join(run_dir, "shared-ckpt"))


def daemon_failed_marker(run_dir: str, node: str) -> str:
    """Where a node's daemon that could not start says why (on the shared run directory: the ranks read it)."""
    return os.path.join(run_dir, INDEX_DIR, f"{node}{DAEMON_FAILED_SUFFIX}")


def _key(ndir: str) -> str:
    return hashlib.sha256(os.path.abspath(ndir).encode()).hexdigest()[:20]


def socket_path(ndir: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"accelpact-{os.getuid()}", f"ckptd-{_key(ndir)}.sock")


def staging_root(ndir: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"accelpact-{os.getuid()}", _key(ndir))


def private_dir(path: str) -> str:
    """Create ``path`` 0700, from the per-user root (``accelpact-<uid>``) down, and check every level is ours.

    The roots live in shared directories (``/tmp``, ``/dev/shm``) where another local user can create
    ``accelpact-<uid>`` first: then a socket planted there could answer the ranks, or a staging directory be swapped.
    Every level from the per-user root down must be a real directory (not a link), owned by this user and writable by
    nobody else; one that is readable by others but ours is tightened to 0700 (an older version created it 0755),
    anything else is refused with :class:`CheckpointError`.
    """
    path = os.path.abspath(path)
    parts = path.split(os.sep)
    root = f"accelpact-{os.getuid()}"
    first = parts.index(root) if root in parts else len(parts) - 1
    cur = os.sep.join(parts[:first]) or os.sep
    os.makedirs(cur, exist_ok=True)  # the system's shared directory (/tmp, /dev/shm): not ours to judge
    for name in parts[first:]:
        cur = os.path.join(cur, name)
        try:
            os.mkdir(cur, 0o700)
        except FileExistsError:
            pass
        check_private(cur)
    return path


def check_private(path: str) -> None:
    """Refuse ``path`` unless it is a directory of this user that nobody else can write; tighten it to 0700."""
    st = os.lstat(path)
    fix = "remove it (or point TMPDIR elsewhere) and start again"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path} is not a plain directory (a link or a file is in the way): {fix}")
    if st.st_uid != os.getuid():
        raise CheckpointError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): another "
                              f"user may have planted it; {fix}")
    if st.st_mode & 0o022:
        raise CheckpointError(f"{path} has mode {oct(st.st_mode & 0o777)}, writable by others: its contents "
                              f"cannot be trusted; {fix}")
    if st.st_mode & 0o777 != 0o700:
        os.chmod(path, 0o700)
