"""Verification of a committed snapshot that needs no model: checksums and metadata coverage.

``verify_snapshot`` returns ``(ok, reason)``; the daemon and ``accelpact-ckpt verify`` record ``verified`` or
``rejected`` from it.  What else a snapshot must prove happens elsewhere, without rebuilding the user's model either:
the capture is proven against the live shards on the ranks (:mod:`ckpt_service.proof`, once per job and capture plan),
and the replay check runs on the user's own training path after a restart
(:mod:`accelpact_slurm.runtime.state.replay`).  ``docs/checkpoints.md`` states what "verified" means.
"""

from __future__ import annotations

import math
import os
import stat
from typing import Any

from accelpact_slurm.core.errors import CheckpointError
from ckpt_service import seal
from ckpt_service.layout import MANIFEST, STATE
from ckpt_service.safeio import entries, kind
from ckpt_service.verified import METADATA, open_checked, read_manifest, unpickle_metadata, verified_metadata_bytes


def check_checksums(path: str, key: bytes | None, *, trust_seal: bool = False,
                    seal_out: dict[str, Any] | None = None) -> tuple[bool, str]:
    """The manifest authenticated under the run's ``key`` first (nothing else is read before), bound to the
    directory's step name, then every file's size and digest, each on the one descriptor it is read from
    (:mod:`.verified`).  Anything in the directory that is not a regular file (a link, a FIFO) refuses it.
    ``key=None`` skips the authentication: only for a test's negative control.

    ``trust_seal`` (a reload's re-check): a file that is still the inode the daemon hashed when it verified the
    snapshot (:mod:`.seal`) is not hashed again.  ``seal_out`` (the daemon's verification): gets the seal of the
    files hashed, when every listed file was hashed and matched."""
    manifest, why = read_manifest(path, key)
    if manifest is None:
        return False, why
    files = manifest["files"]
    if METADATA not in files:
        return False, "manifest lists no .metadata"
    try:
        listing = entries(path)
    except OSError as exc:
        return False, f"cannot list the snapshot: {exc.strerror or exc}"
    odd = [f"{n} is {kind(st.st_mode)}" for n, st in listing if not stat.S_ISREG(st.st_mode)]
    if odd:
        return False, f"not a regular file, not read: {'; '.join(odd)[:300]}"
    sealed = seal.read(path, key, manifest) if trust_seal else {}
    hashed: dict[str, seal.Identity] = {}
    for name, want in sorted(files.items()):
        try:  # from the disk: the writer dropped its cached pages, and this read drops them first
            fd, _ = open_checked(path, name, want, drop=True, sealed=sealed, hashed=hashed)
        except CheckpointError as exc:
            return False, str(exc)
        os.close(fd)
    extra = sorted({n for n, _st in listing} - set(files) - {MANIFEST, STATE})
    extra = [n for n in extra if not n.startswith(STATE)]
    if extra:
        return False, f"files not in the manifest: {extra}"
    if seal_out is not None and key is not None and set(hashed) == set(files):
        seal_out.update(seal.make(key, manifest, hashed))
    kept = len(files) - len(hashed)
    return True, (f"{len(files)} file(s) match their checksums" if not kept else
                  f"{len(files)} file(s) match: {len(hashed)} hashed, {kept} still the files the daemon hashed "
                  f"when it verified the snapshot")


def check_coverage(path: str, key: bytes | None) -> tuple[bool, str]:
    """Every tensor in ``.metadata`` fully covered by chunks, every chunk stored in a file the manifest lists.

    ``.metadata`` is unpickled from the bytes of the one read that checked them against the authenticated
    manifest (never re-opened: another user could rename her pickle over it between two opens)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        manifest, data = verified_metadata_bytes(path, key)
    except CheckpointError as exc:
        return False, str(exc)[:300]
    try:
        md = unpickle_metadata(data)
    except Exception as exc:  # corrupt .metadata
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
        if f not in manifest["files"]:
            return False, f"{f} (named by .metadata) is not in the manifest"
    return True, f"{n} tensors fully covered"


def verify_snapshot(path: str, key: bytes | None, seal_out: dict[str, Any] | None = None) -> tuple[bool, str]:
    """Authentication and checksums, then coverage (which unpickles ``.metadata``: only after both passed);
    ``(ok, reason)``.  Reads files only: no model, no training code.  ``seal_out``: see :func:`check_checksums`
    (cleared again when the coverage fails)."""
    ok, why = check_checksums(path, key, seal_out=seal_out)
    if not ok:
        return False, why
    ok, why = check_coverage(path, key)
    if not ok:
        if seal_out is not None:
            seal_out.clear()
        return False, why
    return True, "manifest authenticated, checksums and coverage pass"
