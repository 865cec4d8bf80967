"""Who may load what: a per-run key, and manifests authenticated with it before anything else is read.

DCP reads a snapshot's ``.metadata`` with ``pickle``: reading it runs code chosen by whoever wrote the file.  So
nothing of a snapshot directory but its ``manifest.json`` (plain JSON) is read until the manifest is authenticated as
written by this run: the writer adds an HMAC-SHA256 of the manifest under the run's key, and every reader (the
daemon's verification, the reload, ``accelpact-ckpt verify`` and ``export``) checks it first.  The manifest lists
every file's size and SHA-256, so an authenticated manifest whose checksums pass covers every byte of the snapshot.

The key lives in the run directory (``.accelpact-key``, 32 random bytes as hex, mode 0600, owned by the job's user):
whoever can read it is the job's user, who may load the run's snapshots anyway.  A snapshot directory planted in the
shared tier, or copied in from another run, fails authentication and is rejected unread.  Torch-free.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
import time
from typing import Any

from accelpact_slurm.core.errors import CheckpointError
from accelpact_slurm.core.safeopen import NotRegular, create_new, read_regular
from ckpt_service.layout import step_of

KEY_FILE = ".accelpact-key"
FIELD = "hmac"


def key_path(run_dir: str) -> str:
    return os.path.join(run_dir, KEY_FILE)


def load_or_create_key(run_dir: str) -> bytes:
    """The run's key; the first caller creates it (0600, exclusive create: concurrent first callers agree).

    No key is created in a run directory that already holds snapshots (in ``node-local/*`` or
    ``shared-ckpt``): the key was lost, and a new one would reject every snapshot and retrain from 0 without
    a word.  :class:`CheckpointError` instead (``accelpact-run``'s start-up check names the fix).
    """
    path = key_path(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    if not os.path.lexists(path):
        planted = _snapshot_names(run_dir)
        if planted:
            raise CheckpointError(f"{path} is missing while {planted} holds snapshots: refusing to create a new key "
                                  f"(it would reject all of them); restore the key file, or move the snapshots "
                                  f"away to start afresh")
    try:
        fd = create_new(path, 0o600)  # O_EXCL | O_NOFOLLOW: a link or FIFO at the name fails the create
    except FileExistsError:
        return load_key(run_dir)
    try:
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return load_key(run_dir)


def load_key(run_dir: str) -> bytes:
    """Read the run's key; refuse one that another user owns or others may read (it could be forged or known)."""
    path = key_path(run_dir)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: this run directory has no key, so none of its snapshots can be "
                              f"authenticated") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CheckpointError(f"{path} must be a regular file of this user with mode 0600 (it has uid {st.st_uid}, "
                              f"mode {oct(st.st_mode & 0o777)}): remove the run directory's key only if you "
                              f"trust every snapshot in it")
    deadline = time.monotonic() + 5.0
    while True:  # a concurrent first caller may not have written it yet (bounded)
        try:  # the same checks on the descriptor read (the name may have been replaced since the lstat)
            text = read_regular(path, 4096, owner=os.getuid()).strip()
        except NotRegular as exc:
            if exc.errno in (errno.EFBIG, errno.EIO) and time.monotonic() <= deadline:
                threading.Event().wait(0.01)  # a concurrent first caller writing it between our open and read
                continue
            raise CheckpointError(f"{exc.strerror}: remove the run directory's key only if you trust every "
                                  f"snapshot in it") from None
        if len(text) == 64:
            return bytes.fromhex(text.decode())
        if time.monotonic() > deadline:
            break
        threading.Event().wait(0.01)
    raise CheckpointError(f"{path} does not hold a key (64 hex digits)")


def _snapshot_names(run_dir: str) -> str | None:
    """The first folder of the run directory's default layout that holds a snapshot (``step-N`` with a
    ``manifest.json``), if any."""
    candidates = [os.path.join(run_dir, "shared-ckpt")]
    try:
        local = os.path.join(run_dir, "node-local")
        candidates += [os.path.join(local, n) for n in sorted(os.listdir(local))]
    except OSError:
        pass
    for d in candidates:
        try:
            if any(step_of(n) is not None and os.path.lexists(os.path.join(d, n, "manifest.json"))
                   for n in os.listdir(d)):
                return d
        except OSError:
            continue
    return None


def find_run_dir(path: str) -> str | None:
    """The nearest directory at or above ``path`` that holds a run key (for the CLI given a snapshot path)."""
    cur = os.path.abspath(path)
    while True:
        if os.path.isfile(key_path(cur)):
            return cur
        parent = os.path.dirname(cur)
        if parent == cur:
            return None
        cur = parent


def _mac(key: bytes, manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != FIELD}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, blob, hashlib.sha256).hexdigest()


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """``manifest`` with its HMAC added."""
    return {**manifest, FIELD: _mac(key, manifest)}


def authenticate(manifest: Any, key: bytes) -> tuple[bool, str]:
    """``(ok, reason)``: the manifest was written under ``key`` (pure)."""
    if not isinstance(manifest, dict):
        return False, "manifest.json missing or unreadable"
    got = manifest.get(FIELD)
    if not isinstance(got, str):
        return False, "the manifest carries no HMAC: not written by this run, nothing else of it is read"
    if not hmac.compare_digest(got, _mac(key, manifest)):
        return False, "the manifest's HMAC does not match this run's key: not written by this run, nothing else of it is read"
    return True, "manifest written by this run"
