"""Where the checkpoint service keeps things (pure path arithmetic, no torch).

- node directory (emulated NVMe): ``checkpoint.local_dir`` (environment variables
  expanded, e.g. ``/nvme/$SLURM_JOB_ID``) joined with the node name, else
  ``RUN_DIR/node-local/<node>``;
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
import tempfile

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"
MANIFEST = "manifest.json"
STATE = "state.json"
LOCK = "ckptd.lock"
INDEX_DIR = "ckpt-index"
_STEP_RE = re.compile(r"^step-(\d{10})$")


def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{step:010d}"


def step_of(name: str) -> int | None:
    """The step of a committed snapshot directory name, ``None`` for anything else."""
    m = _STEP_RE.match(os.path.basename(name.rstrip("/")))
    return int(m.group(1)) if m else None


def node_dir(run_dir: str, node: str, local_dir: str | None = None) -> str:
    if local_dir:
        return os.path.abspath(os.path.join(os.path.expandvars(os.path.expanduser(local_dir)), node))
    return os.path.abspath(os.path.join(run_dir, "node-local", node))


def shared_dir(run_dir: str, configured: str | None = None) -> str:
    if configured:
        return os.path.abspath(os.path.expandvars(os.path.expanduser(configured)))
    return os.path.abspath(os.path.join(run_dir, "shared-ckpt"))


def _key(ndir: str) -> str:
    return hashlib.sha256(os.path.abspath(ndir).encode()).hexdigest()[:20]


def socket_path(ndir: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"accelpact-{os.getuid()}", f"ckptd-{_key(ndir)}.sock")


def staging_root(ndir: str) -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"accelpact-{os.getuid()}", _key(ndir))


def private_dir(path: str) -> str:
    """Create ``path`` (and parents) and make it 0700: only the job's user may enter."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path
