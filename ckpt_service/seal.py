"""The daemon's verification sealed to the files it hashed: a reload of those very files does not hash them again.

The daemon's verifier hashes every file of a snapshot from the disk (:func:`ckpt_service.verify.verify_snapshot`).
A reload on the same node reads the same files again; hashing them a second time costs a core per byte and, the
verifier having dropped their pages, one more read of the whole snapshot from the disk.  So, when a snapshot passes,
the verifier records a seal beside the verdict (``state.json``'s ``seal``): for every file, the identity of the inode
it hashed, taken with ``fstat`` on the descriptor it hashed, before the hash and again unchanged after it (device,
inode, size, modification and status-change times in nanoseconds), under an HMAC with the run's key over the step,
the manifest's own HMAC and those identities.

A reader that opens a listed file and finds on that very descriptor the identity the seal names reads the inode the
daemon hashed, unchanged since through the file system: a write, a truncation, a ``chmod``, a link or a rename onto
the name gives the inode a new status-change time (which no user can set back) or puts another inode there.  Such a
file is not hashed again (:func:`ckpt_service.verified.open_checked`); any other file is, as before the seal existed:
a copy in another tier (the shared tier, a copy made at a restart) is another inode, so it is always hashed, and a
seal that lacks the run's MAC, names another manifest or another state than ``verified`` is no seal.  What the
seal cannot show is a change below the file system (a disk's own corruption, a write to the raw device): the reload
of the same node then trusts the daemon's verification, and the replay check of the first update is what is left.

Torch-free.  Who calls: the verifier (:func:`make`, through :func:`ckpt_service.verify.check_checksums`), the
restore's re-check and the verified reader (:func:`read`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Mapping

from ckpt_service.auth import FIELD
from ckpt_service.layout import STATE
from ckpt_service.safeio import read_json_why

#: ``state.json``'s key of the seal.
KEY = "seal"

Identity = tuple[int, int, int, int, int]


def identity(st: os.stat_result) -> Identity:
    """The inode behind a descriptor, as the seal records it: device, inode, size, mtime and ctime (ns)."""
    return (int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns), int(st.st_ctime_ns))


def _mac(key: bytes, manifest: Mapping[str, Any], files: Mapping[str, Any]) -> str:
    body = {"step": manifest.get("step"), "manifest": manifest.get(FIELD),
            "files": {n: list(v) for n, v in sorted(files.items())}}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, b"accelpact-verified\0" + blob, hashlib.sha256).hexdigest()


def make(key: bytes, manifest: Mapping[str, Any], files: Mapping[str, Identity]) -> dict[str, Any]:
    """The seal of a verification that hashed ``files`` (``{name: identity}``) against ``manifest``."""
    return {"files": {n: list(v) for n, v in sorted(files.items())}, "mac": _mac(key, manifest, files)}


def read(path: str, key: bytes | None, manifest: Mapping[str, Any]) -> dict[str, Identity]:
    """``{name: identity}`` of the files of the snapshot ``path`` its daemon hashed, unchanged files needing no second
    hash; empty when there is no valid seal (no key, not ``verified``, no seal, a MAC that does not match the run's
    key and ``manifest``, an entry the manifest does not list)."""
    if key is None:
        return {}
    doc, _why = read_json_why(os.path.join(path, STATE))
    seal = doc.get(KEY) if isinstance(doc, dict) and doc.get("state") == "verified" else None
    files = seal.get("files") if isinstance(seal, dict) else None
    if not isinstance(files, dict) or not isinstance(seal.get("mac"), str):
        return {}
    listed = manifest.get("files") or {}
    out: dict[str, Identity] = {}
    for name, ident in files.items():
        if name not in listed or not isinstance(ident, list) or len(ident) != 5 or \
                not all(type(x) is int for x in ident):
            return {}
        out[name] = (ident[0], ident[1], ident[2], ident[3], ident[4])
    if not hmac.compare_digest(seal["mac"], _mac(key, manifest, out)):
        return {}
    return out
