"""Verification of a committed snapshot that needs no model: checksums and metadata coverage.

``verify_snapshot`` returns ``(ok, reason)``; the daemon and ``accelpact-ckpt verify`` record
``verified`` or ``rejected`` from it.  What else a snapshot must prove happens elsewhere, without
rebuilding the user's model either: the capture is proven against the live shards on the ranks
(:mod:`ckpt_service.proof`, once per job and capture plan), and the replay check runs on the user's
own training path after a restart (:mod:`accelpact_slurm.runtime.replay`).  ``docs/checkpoints.md``
states what "verified" means.
"""

from __future__ import annotations

import math
import os

from ckpt_service.auth import authenticate
from ckpt_service.layout import MANIFEST, STATE
from ckpt_service.index import read_json
from ckpt_service.writer import sha256_file

def check_checksums(path: str, key: bytes | None) -> tuple[bool, str]:
    """The manifest authenticated under the run's ``key`` first (nothing else is read before), then every file's
    size and SHA-256.  ``key=None`` skips the authentication: only for a test's negative control."""
    manifest = read_json(os.path.join(path, MANIFEST))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return False, "manifest.json missing or unreadable"
    if key is not None:
        ok, why = authenticate(manifest, key)
        if not ok:
            return False, why
    files = manifest["files"]
    if ".metadata" not in files:
        return False, "manifest lists no .metadata"
    for name, want in sorted(files.items()):
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            return False, f"{name} is missing"
        size = os.path.getsize(p)
        if size != want["size"]:
            return False, f"{name} has {size} bytes, the manifest says {want['size']} (truncated or grown)"
        if sha256_file(p, drop=True) != want["sha256"]:  # from the disk: the writer dropped its cached pages
            return False, f"{name} fails its SHA-256 checksum (corrupted)"
    extra = sorted(set(os.listdir(path)) - set(files) - {MANIFEST, STATE})
    extra = [n for n in extra if not n.startswith(STATE)]
    if extra:
        return False, f"files not in the manifest: {extra}"
    return True, f"{len(files)} file(s) match their checksums"


def check_coverage(path: str) -> tuple[bool, str]:
    """Every tensor in ``.metadata`` fully covered by chunks, every chunk stored in an existing file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = FileSystemReader(path).read_metadata()
    except Exception as exc:  # missing or corrupt .metadata
        return False, f".metadata unreadable: {exc.__class__.__name__}: {exc}"[:300]
    n = 0
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        n += 1
        total = math.prod(item.size)
        covered = 0
        for ch in item.chunks:
            if any(o + s > d for o, s, d in zip(ch.offsets, ch.sizes, item.size)):
                return False, f"{fqn}: chunk at {list(ch.offsets)} exceeds the tensor's size {list(item.size)}"
            covered += math.prod(ch.sizes)
        if covered != total:
            return False, f"{fqn}: chunks cover {covered} of {total} elements"
    files = {info.relative_path for info in (md.storage_data or {}).values()}
    for f in sorted(files):
        if not os.path.isfile(os.path.join(path, f)):
            return False, f"{f} (named by .metadata) is missing"
    return True, f"{n} tensors fully covered"


def verify_snapshot(path: str, key: bytes | None) -> tuple[bool, str]:
    """Authentication and checksums, then coverage (which unpickles ``.metadata``: only after both passed);
    ``(ok, reason)``.  Reads files only: no model, no training code."""
    ok, why = check_checksums(path, key)
    if not ok:
        return False, why
    ok, why = check_coverage(path)
    if not ok:
        return False, why
    return True, "manifest authenticated, checksums and coverage pass"
