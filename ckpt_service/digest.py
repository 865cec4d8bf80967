"""The file digests of a snapshot's manifest: BLAKE3 for what is written now, SHA-256 still read.

Every file of a snapshot is listed in its manifest with its size and one collision-resistant digest, under the
algorithm's name (``{"size": N, "blake3": HEX}``); the manifest names the algorithm of all of its entries
(``"digest": "blake3"``, manifest format 3).  Manifests before format 3 name none: theirs is SHA-256, and they
still verify and load.  The manifest is authenticated under the run's key (:mod:`.auth`), so nobody who lacks
the key can change which algorithm a snapshot is checked with.

Why BLAKE3: every byte is hashed once as it is written and once when the verification re-reads it from the disk,
on the cores the ranks train on.  Measured here on one core (``make bench``, part ``ckpt``), BLAKE3 costs about
a third of SHA-256's CPU per byte; both resist collisions, so a planted snapshot fails either (tests:
``tests/ckpt_service/test_digest.py``).  One thread per hash: the daemon's threads stay few and at low priority.

Who calls: the writer (:mod:`.sink`, hashing while it writes; :mod:`.writecheck`), the verification and the reload
(:mod:`.verified`).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping

import blake3

#: What a new snapshot's files are hashed with.
WRITE = "blake3"
#: A manifest that names no algorithm (format 2 and older) was hashed with this.
LEGACY = "sha256"

_NEW: dict[str, Callable[[], Any]] = {
    "blake3": lambda: blake3.blake3(),  # single-threaded: the daemon's threads stay bounded
    "sha256": hashlib.sha256,
}
ALGORITHMS = tuple(_NEW)


def new(algorithm: str = WRITE) -> Any:
    """A fresh hasher (``update(buffer)``, ``hexdigest()``) of ``algorithm``; KeyError names a refused one."""
    try:
        return _NEW[algorithm]()
    except KeyError:
        raise KeyError(f"unknown digest {algorithm!r} (known: {', '.join(ALGORITHMS)})") from None


def of_bytes(data: bytes | memoryview, algorithm: str = WRITE) -> str:
    h = new(algorithm)
    h.update(data)
    return h.hexdigest()


def manifest_algorithm(manifest: Mapping[str, Any]) -> str | None:
    """The algorithm every file entry of ``manifest`` is hashed with, or None when it names one not known here."""
    alg = manifest.get("digest", LEGACY)
    return alg if isinstance(alg, str) and alg in _NEW else None


def entry(want: Mapping[str, Any]) -> tuple[str, str]:
    """``(algorithm, hex digest)`` of one file entry of a manifest that :func:`check_entries` accepted."""
    for alg in ALGORITHMS:
        if isinstance(want.get(alg), str):
            return alg, want[alg]
    raise KeyError("the entry has no digest")


def check_entries(manifest: Mapping[str, Any]) -> str | None:
    """Why the manifest's file entries are refused (None: each has a size and exactly the manifest's digest)."""
    alg = manifest_algorithm(manifest)
    if alg is None:
        return f"the manifest names the digest {manifest.get('digest')!r}, which is not one of {', '.join(ALGORITHMS)}"
    for name, want in manifest["files"].items():
        if not isinstance(want, dict) or not isinstance(want.get("size"), int) or not isinstance(want.get(alg), str):
            return f"the manifest's entry {name!r} is not a file name with a size and a {alg} digest"
        others = [a for a in ALGORITHMS if a != alg and a in want]
        if others:
            return f"the manifest's entry {name!r} carries a {others[0]} digest beside its {alg} one"
    return None
