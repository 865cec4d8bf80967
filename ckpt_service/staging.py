"""Shared-memory staging between a rank and its node's daemon: reusable slots plus one descriptor per step.

Layout under the node's staging root (``/dev/shm/accelpact-<uid>/<key>/``, mode 0700)::

    rank-L.slot-S            a preallocated, memory-mapped file (S = 0, 1): the rank's boxes, raw bytes
    step-N/rank-L.desc       which slot, where every box lies in it, the plain state and the metadata

A rank copies its boxes into a free slot (a memcpy into pages touched once), then writes the descriptor under a
temporary name and renames it, so the daemon never reads half of one; the daemon maps the slot read-only and hands the
boxes to DCP as views (no copy, no reassembly).  A slot is reused only once the daemon finished writing from it
(:meth:`ckpt_service.client.SnapshotClient` asks); a second slot is made only while the first is busy.  The
descriptor records the slot's inode (a slot replaced in between, by a restarted daemon, is detected), and each slot
ends in a stamp (:data:`STAMP_BYTES`: the snapshot's step and a random token, also in the descriptor) that the rank
clears before its copy and writes after it, and the daemon checks before writing and again before the commit: a slot
rewritten in between fails the snapshot instead of committing another step's data under this step's name.

Who calls: :mod:`.client` (``Slot``, ``write_descriptor``), :mod:`.daemon` (``read_descriptor``, ``map_slot``, for
:mod:`.dcp_write`; it removes a step's descriptors once settled).  A daemon drops its staging root at its start and at
a clean exit; what a daemon killed by ``kill -9`` left, the launchers drop once the job ended (:func:`drop_unserved`,
also ``python -m ckpt_service.staging --drop NODE_DIR``).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import mmap
import os
import shutil
import struct
import sys
from typing import Any, Sequence

from accelpact_slurm.core.errors import CheckpointError
from accelpact_slurm.core.safeopen import open_regular, open_writable
from ckpt_service.layout import DEL_PREFIX, LOCK, TMP_PREFIX, check_private, private_dir, socket_path, staging_root

log = logging.getLogger(__name__)


def step_stage_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:010d}")


def slot_path(root: str, local_rank: int, slot: int) -> str:
    return os.path.join(root, f"rank-{local_rank}.slot-{slot}")


#: Bytes at the end of a slot for its stamp: magic, step, token (a multiple of the boxes' alignment).
STAMP_BYTES = 64
_STAMP_MAGIC = b"APSTAMP1"
_STAMP_FMT = "<8sQ16s"


def slot_bytes(nbytes: int) -> int:
    """The size of a slot for boxes of ``nbytes`` (aligned, as :meth:`ckpt_service.capture.Plan.layout` returns
    them): the boxes, then the stamp at offset ``nbytes``."""
    return nbytes + STAMP_BYTES


def clear_stamp(buf: Any, at: int) -> None:
    """Invalidate the slot's stamp (a uint8 tensor over the slot) before anything of a new snapshot is copied in:
    a daemon still writing the previous one then sees its stamp gone."""
    buf[at:at + STAMP_BYTES].zero_()


def write_stamp(buf: Any, at: int, step: int, token: str) -> None:
    """Stamp the slot with the snapshot it now holds (after the copy into it has completed)."""
    import torch

    raw = bytearray(STAMP_BYTES)
    struct.pack_into(_STAMP_FMT, raw, 0, _STAMP_MAGIC, step, bytes.fromhex(token))
    buf[at:at + STAMP_BYTES].copy_(torch.frombuffer(raw, dtype=torch.uint8))


def new_token() -> str:
    return os.urandom(16).hex()


def check_stamp(view: memoryview, desc: dict[str, Any]) -> str | None:
    """Why the mapped slot ``view`` does not (or no longer) hold the snapshot ``desc`` describes; None when it does.

    Who calls: the daemon's writer, before it writes a snapshot and once every byte is written, before the commit.
    """
    stamp = desc.get("stamp")
    slot = os.path.basename(str(desc.get("slot")))
    if not isinstance(stamp, dict) or not isinstance(stamp.get("at"), int) or not isinstance(stamp.get("token"), str):
        return f"the descriptor of rank {desc.get('rank')} names no stamp for {slot}"
    at = stamp["at"]
    if at < 0 or len(view) < at + STAMP_BYTES:
        return f"{slot} is too short for its stamp ({len(view)} bytes, stamp at {at})"
    magic, step, token = struct.unpack_from(_STAMP_FMT, view, at)
    if magic != _STAMP_MAGIC:
        return (f"{slot} of rank {desc.get('rank')} no longer holds snapshot {desc.get('step')}: its stamp was "
                f"cleared (the rank is staging another snapshot into it)")
    if step != desc.get("step") or token.hex() != stamp["token"]:
        return (f"{slot} of rank {desc.get('rank')} no longer holds snapshot {desc.get('step')}: it is stamped "
                f"with snapshot {step}")
    return None


def served(ndir: str) -> bool | None:
    """Whether a live daemon serves node directory ``ndir`` (holds its ``ckptd.lock``); None when it cannot be told.

    The kernel releases the lock (flock) when the holder's process ends, ``kill -9`` included, while a stopped
    (SIGSTOP) or stuck daemon keeps it: only a daemon that is gone for sure reads no slot any more.  The lock is
    tested with a shared lock, taken and dropped at once (a daemon starting at that moment retries its own,
    :func:`ckpt_service.daemon.acquire_lock`).  Works across processes of one node, on any local file system.
    """
    try:
        fd, _st = open_regular(os.path.join(ndir, LOCK))  # a FIFO or link there is no daemon's lock
    except (FileNotFoundError, NotADirectoryError):
        return False  # no daemon ever served this node directory (or it is not even a directory)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return True if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class Slot:
    """One rank's reusable staging buffer: a file in shared memory, mapped once, grown when needed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = 0
        self.ino: int | None = None
        self._mm: mmap.mmap | None = None
        self.buf = None  # torch.uint8 tensor over the mapping
        self.pinned = False  # page-locked for the CUDA driver (cudaHostRegister)

    def ensure(self, nbytes: int) -> bool:
        """Map a slot of at least ``nbytes``; (re)create it when missing, replaced or too small.

        Returns True when a new file was created (its pages are touched by the first copy).
        """
        import torch

        try:
            st = os.stat(self.path)
            same = self.ino is not None and st.st_ino == self.ino and self.size >= nbytes
        except FileNotFoundError:
            same = False
        if same:
            return False
        self.unpin()
        self.buf = None
        self._mm = None  # dropped, not closed: a tensor may still view it until collected
        private_dir(os.path.dirname(self.path))
        tmp = f"{self.path}.tmp.{os.getpid()}"
        try:  # a leftover of this pid (a reused pid's crash) is ours to replace; anything else is never followed
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        fd, _st = open_writable(tmp, mode=0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self.size = nbytes
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        return True

    def prefault(self) -> None:
        """Touch every page of the slot now (a zero-fill), so that the first copy into it does not fault them in:
        on a fresh tmpfs file that is most of a first snapshot's copy (3.5 s of 3.9 s for 110M parameters here)."""
        if self.buf is not None and self.size:
            self.buf.zero_()

    def pin(self) -> bool:
        """Page-lock the mapping for the CUDA driver (``cudaHostRegister``), once per mapping.

        A device-to-host copy into pageable memory goes through the driver's bounce buffer at a
        fraction of the link's speed (1.7 against 55 GB/s on an H200, ``benchmarks/summaries/gpu-check.json``);
        into registered memory it is one DMA and may be asynchronous.  Returns whether the slot is
        pinned: False without CUDA, or when the driver refuses (the copy then still works, pageable).
        """
        if self.pinned or self.buf is None or not self.size:
            return self.pinned
        import torch

        if not torch.cuda.is_available():
            return False
        rc = int(torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.size, 0))
        if rc != 0:
            log.warning("cannot page-lock staging slot %s (%d bytes): cudaHostRegister returned %d; "
                        "device-to-host copies into it stay pageable", self.path, self.size, rc)
            return False
        self.pinned = True
        return True

    def unpin(self) -> None:
        """Undo :meth:`pin` (before the mapping is dropped)."""
        if self.pinned and self.buf is not None:
            import torch

            rc = int(torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr()))
            if rc != 0:
                log.warning("cudaHostUnregister of staging slot %s returned %d", self.path, rc)
        self.pinned = False


def write_descriptor(root: str, step: int, local_rank: int, desc: dict[str, Any]) -> str:
    """Write ``step-N/rank-L.desc`` atomically (``torch.save``: small; loads with ``weights_only=True``)."""
    import torch

    d = step_stage_dir(root, step)
    private_dir(root)
    os.makedirs(d, mode=0o700, exist_ok=True)
    path = os.path.join(d, f"rank-{local_rank}.desc")
    tmp = f"{path}.tmp.{os.getpid()}"
    body = dict(desc)
    body["meta"] = json.dumps(desc["meta"])
    if "entries" in body:  # lists of numbers and names: JSON text, which the daemon reads back faster than the
        body["entries"] = json.dumps(body["entries"])  # weights-only unpickler (the bench's node: 25 -> 10 ms)
    torch.save(body, tmp)
    os.replace(tmp, path)
    return path


def read_descriptor(path: str) -> dict[str, Any]:
    import torch

    data = torch.load(path, weights_only=True)
    data["meta"] = json.loads(data["meta"])
    if isinstance(data.get("entries"), str):
        data["entries"] = json.loads(data["entries"])
    return data


def map_slot(path: str, ino: int, nbytes: int) -> memoryview:
    """A read-only view of a rank's slot (all of it, the stamp included); raises OSError when it is gone, replaced
    or too short."""
    fd, st = open_regular(path)
    try:
        if st.st_ino != ino:
            raise OSError(f"{path} was replaced after staging (inode {st.st_ino}, staged {ino})")
        if st.st_size < nbytes:
            raise OSError(f"{path} holds {st.st_size} bytes, the descriptor needs {nbytes}")
        if not st.st_size:
            return memoryview(b"")
        return memoryview(mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ))
    finally:
        os.close(fd)


def drop_step(root: str, step: int) -> None:
    shutil.rmtree(step_stage_dir(root, step), ignore_errors=True)


def drop_all(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)


#: What :func:`drop_unserved` did: removed the leftovers, found none, left a live daemon's alone, or failed.
REMOVED, NOTHING, SERVED, FAILED = "removed", "nothing", "served", "failed"


def drop_unserved(ndir: str) -> tuple[str, str]:
    """Remove the staging root (and the socket) that no live daemon of node directory ``ndir`` serves.

    Returns ``(REMOVED | NOTHING | SERVED | FAILED, why)``.

    Who calls: the embedded default's launcher once a start's ranks and daemons are gone
    (:mod:`accelpact_slurm.launch.local`); on Slurm the template's daemon step after its daemon exited
    (``accelpact-ckptd --drop-staging``).  A daemon killed by ``kill -9`` (or the OOM killer) cannot drop its own
    slots (each as large as a rank's share of the state, in RAM-backed ``/dev/shm``), and no daemon may come again.

    The node directory's daemon lock (``ckptd.lock``, flock) is taken non-blocking first and held while removing:
    while a live daemon holds it, nothing is touched (``SERVED``).  The kernel releases a dead daemon's lock,
    ``kill -9`` included.  Without a node directory (missing, or a file in its place) no daemon can serve it and there
    is no lock to take: what the node's ranks staged there anyway (they stage before they learn that no daemon came)
    is read by nobody and removed (``REMOVED``); else ``NOTHING``, and no directory is created.
    """
    ndir = os.path.abspath(ndir)
    root = staging_root(ndir)
    sock = socket_path(ndir)
    if not os.path.isdir(ndir):
        if not os.path.lexists(root):
            return NOTHING, f"no node directory {ndir}: no daemon served it here"
        try:
            check_private(os.path.dirname(root))  # never follow a link another user planted
            check_private(root)
            shutil.rmtree(root)
        except (OSError, CheckpointError) as exc:
            return FAILED, f"cannot remove what the ranks staged for {ndir}: {exc}"
        return REMOVED, f"removed {root}: the ranks staged for {ndir}, which no daemon could serve (no directory)"
    try:
        fd, _st = open_writable(os.path.join(ndir, LOCK), mode=0o600)
    except OSError as exc:
        return FAILED, f"cannot open the daemon lock of {ndir}: {exc.strerror or exc}"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return FAILED, f"cannot lock {os.path.join(ndir, LOCK)}: {exc.strerror or exc}"
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            return SERVED, f"a live daemon (pid {holder}) serves {ndir}: its staging is left alone"
        # The lock is ours: no daemon serves ndir now, and none can start until we close fd.
        partial = _drop_partial(ndir)
        if not os.path.lexists(root) and not os.path.lexists(sock):
            if partial:
                return REMOVED, f"removed {', '.join(partial)} in {ndir}, left by a daemon killed while writing"
            return NOTHING, f"nothing staged for {ndir}"
        try:
            if os.path.lexists(root):
                check_private(os.path.dirname(root))  # never follow a link another user planted
                check_private(root)
                shutil.rmtree(root)
            if os.path.lexists(sock):
                os.unlink(sock)
        except (OSError, CheckpointError) as exc:
            return FAILED, f"cannot remove the leftovers of {ndir}'s daemon: {exc}"
        return REMOVED, f"removed {root}, left by a daemon of {ndir} that did not exit cleanly"
    finally:
        os.close(fd)  # releases the lock


def _drop_partial(ndir: str) -> list[str]:
    """Remove the half-written (``.tmp-step-N-PID``) and half-deleted (``.del-...``) snapshot directories of
    ``ndir``, whose daemon lock the caller holds: a daemon killed while writing leaves its temporary directory,
    which only that node directory's next daemon would remove (a job that ends first keeps it for good)."""
    removed = []
    for name in sorted(os.listdir(ndir)):
        path = os.path.join(ndir, name)
        if name.startswith((TMP_PREFIX, DEL_PREFIX)) and not os.path.islink(path) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckpt_service.staging --drop NODE_DIR...``: exit 1 when some leftovers could not be removed."""
    p = argparse.ArgumentParser(
        prog="python -m ckpt_service.staging",
        description="Remove the shared-memory staging (/dev/shm/accelpact-<uid>/<key>/) and the socket that a "
                    "checkpoint daemon killed by kill -9 left behind for a node directory. A node directory "
                    "whose daemon still runs (it holds NODE_DIR/ckptd.lock) is left alone.")
    p.add_argument("--drop", nargs="+", required=True, metavar="NODE_DIR",
                   help="the node directories (checkpoint.local_dir/<node>, else RUN_DIR/node-local/<node>)")
    args = p.parse_args(argv)
    failed = False
    for ndir in args.drop:
        what, why = drop_unserved(ndir)
        print(why, file=sys.stderr if what == FAILED else sys.stdout)
        failed = failed or what == FAILED
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
