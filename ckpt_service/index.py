"""Snapshot records on disk, pure selection, and the login-node index (no torch).

A snapshot's state lives beside its data: ``step-N/state.json``.  The rename of the temporary directory to ``step-N``
is the commit point, so a ``step-N`` with a manifest but no state record (the writer died between rename and record)
is *committed* and will be verified.  The index ``RUN_DIR/ckpt-index/<node>.json`` is derived from the records and
rewritten atomically after every transition; ``accelpact-status`` reads exactly this file, and every daemon reads the
other nodes' before it deletes anything (:func:`read_indexes`: the newest step verified on every node is kept).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Sequence

from accelpact_slurm.core.atomic import fsync_dir, write_json_atomic  # noqa: F401  (re-exported)
from accelpact_slurm.core.events import finite_number
from accelpact_slurm.core.safeopen import open_writable

from ckpt_service.layout import DAEMON_FAILED_SUFFIX, INDEX_DIR, MANIFEST, STATE, step_name_problem, step_of
from ckpt_service.retention import is_milestone
from ckpt_service.safeio import is_plain_dir, read_json_why

log = logging.getLogger(__name__)

STATES = ("committed", "verified", "rejected")
#: The source name of the shared tier in :func:`restart_source` (node names are host names: no spaces).
SHARED_SOURCE = "shared tier"


def read_json(path: str) -> Any:
    """The JSON document at ``path``, ``None`` when it is missing, unreadable, not JSON, or not a regular file
    of at most 16 MiB (a FIFO planted as ``manifest.json`` must not block the reader: :mod:`.safeio`)."""
    return read_json_why(path)[0]


@dataclass
class SnapshotRecord:
    step: int
    state: str
    size_bytes: int
    created: float
    path: str
    milestone: bool = False
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def dir_size(path: str) -> int:
    """Bytes of the regular files in the tree at ``path``; links are neither followed nor counted (a link to
    ``/usr`` planted in a snapshot must not make every listing walk the system's tree)."""
    total = 0
    for root, _dirs, files in os.walk(path):  # os.walk does not descend into links to directories
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def read_record(path: str, milestone_every: int = 0) -> SnapshotRecord | None:
    """The record of one committed directory, ``None`` when ``path`` is not a snapshot name."""
    step = step_of(path)
    if step is None:
        return None
    manifest, bad = read_json_why(os.path.join(path, MANIFEST))
    rec = read_json(os.path.join(path, STATE))
    rec = rec if isinstance(rec, dict) else {}
    state = rec.get("state") if rec.get("state") in STATES else "committed"
    reason = rec.get("reason")
    manifest = manifest if isinstance(manifest, dict) else None
    created = (manifest or {}).get("created")
    if manifest is None and state != "rejected":
        state, reason = "rejected", f"manifest.json missing or unreadable ({bad or 'not a JSON object'})"
    if finite_number(created) is None:  # 1e400 or a 400-digit integer: float() overflows, or an age is inf
        try:
            created = os.path.getmtime(path)
        except OSError:
            created = 0.0
    return SnapshotRecord(step=step, state=state, size_bytes=dir_size(path), created=float(created),
                          path=os.path.abspath(path), milestone=is_milestone(step, milestone_every), reason=reason)


def scan(ndir: str, milestone_every: int = 0, bad: list[tuple[str, str]] | None = None) -> list[SnapshotRecord]:
    """Every committed snapshot of a node directory, by step (temporary and deleted ones never appear).

    ``bad`` (when given) gets ``(path, why)`` for each entry named like a snapshot that is left out: a ``step-``
    name of another form (eleven digits, other scripts' digits), or a step name that is a link or a file.
    """
    try:
        names = sorted(os.listdir(ndir))
    except (FileNotFoundError, NotADirectoryError, PermissionError):  # no usable node directory: nothing to list
        return []
    out = []
    for n in names:
        path = os.path.join(ndir, n)
        if step_of(n) is None:
            why = step_name_problem(n)
            if why is not None and bad is not None:
                bad.append((path, why))
            continue
        # A step name that is a link (to another user's folder, to /usr) or a file is no snapshot of this run.
        if not is_plain_dir(path):
            if bad is not None:
                bad.append((path, "not a directory (a link or a file)"))
            continue
        rec = read_record(path, milestone_every)
        if rec is not None:
            out.append(rec)
    return sorted(out, key=lambda r: r.step)


def record_state(path: str, state: str, reason: str | None = None, **extra: Any) -> None:
    """Write ``state.json`` beside the data (atomically), keeping the history of transitions."""
    if state not in STATES:
        raise ValueError(f"unknown snapshot state {state!r}")
    spath = os.path.join(path, STATE)
    old = read_json(spath) or {}
    history = list(old.get("history", []))
    now = time.time()
    history.append({"state": state, "ts": now, "reason": reason})
    write_json_atomic(spath, {"state": state, "reason": reason, "updated": now, "history": history, **extra})


# --------------------------------------------------------------------------- pure selection


def newest_verified(snaps: Iterable[Any]) -> tuple[Any | None, str]:
    """The snapshot a restart loads: the highest step whose state is ``verified``.  Pure."""
    best = None
    seen = 0
    for s in snaps:
        seen += 1
        state = s["state"] if isinstance(s, dict) else s.state
        step = s["step"] if isinstance(s, dict) else s.step
        if state != "verified":
            continue
        if best is None or step > (best["step"] if isinstance(best, dict) else best.step):
            best = s
    if best is None:
        return None, ("no snapshot at all" if seen == 0 else f"none of {seen} snapshot(s) is verified")
    step = best["step"] if isinstance(best, dict) else best.step
    return best, f"step {step} is the newest of {seen} snapshot(s) in state verified"


def common_step(available: Sequence[Iterable[int]]) -> tuple[int | None, str]:
    """The newest step every rank can load (each rank lists the verified steps it can reach).  Pure."""
    if not available:
        return None, "no ranks"
    sets = [set(a) for a in available]
    common = set.intersection(*sets)
    if not common:
        empty = [i for i, s in enumerate(sets) if not s]
        if empty:
            return None, f"rank(s) {empty} can reach no verified snapshot"
        return None, "no verified step is reachable by every rank"
    best = max(common)
    newer = max(max(s) for s in sets if s)
    why = f"step {best} is the newest verified step every rank can load"
    if newer > best:
        why += f" (step {newer} is verified on some nodes only)"
    return best, why


def restart_source(per_source: Mapping[str, Iterable[Any]]) -> tuple[int | None, str | None, str]:
    """The step a restart loads and where from: ``(step, source, reason)``.  Pure.

    The rule of the restore (:mod:`accelpact_slurm.runtime.state.restore`): the newest step that is ``verified`` on at
    least one node's copy or in the shared tier; a node lacking it loads it through the shared tier (the restore
    copies it there first when the tier does not hold it yet). ``per_source`` maps each node's name, and
    :data:`SHARED_SOURCE`, to its records (dicts or :class:`SnapshotRecord`).  ``source`` is the first holder: a node
    (by name) before the shared tier, as the restore prefers a node's own copy.  Who calls: ``accelpact-status``.
    """
    holders: dict[int, list[str]] = {}
    nodes = sorted(src for src in per_source if src != SHARED_SOURCE)
    order = nodes + ([SHARED_SOURCE] if SHARED_SOURCE in per_source else [])
    seen = 0
    for src in order:
        for rec in per_source[src]:
            seen += 1
            if _field(rec, "state") == "verified" and isinstance(_field(rec, "step"), int):
                holders.setdefault(_field(rec, "step"), [])
                if src not in holders[_field(rec, "step")]:
                    holders[_field(rec, "step")].append(src)
    if not holders:
        if seen == 0:
            return None, None, "no snapshot on any node or in the shared tier"
        return None, None, f"none of {seen} snapshot(s) on the nodes or in the shared tier is verified"
    step = max(holders)
    have = holders[step]
    lacking = [n for n in nodes if n not in have]
    on = [f"on {', '.join(n for n in have if n != SHARED_SOURCE)}"] if any(n != SHARED_SOURCE for n in have) else []
    where = " and ".join(on + (["in the shared tier"] if SHARED_SOURCE in have else []))
    why = f"step {step} is the newest step verified anywhere ({where})"
    if lacking:
        via = ("the shared tier's copy" if SHARED_SOURCE in have
               else f"a copy {have[0]} makes in the shared tier at the restart")
        why += f"; {', '.join(lacking)} load{'s' if len(lacking) == 1 else ''} it through {via}"
    elif nodes:
        why += "; every node loads its own copy"
    return step, have[0], why


def _field(rec: Any, name: str) -> Any:
    return rec.get(name) if isinstance(rec, dict) else getattr(rec, name, None)


# --------------------------------------------------------------------------- login-node index


def read_indexes(run_dir: str, exclude: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every node's published index: ``{node: [snapshot dicts]}`` (``exclude``: leave this node out).

    Who calls: the daemon before each retention pass (the newest common step).  The
    ``<node>.daemon-failed.json`` markers are no index; an unreadable or half-written file is skipped
    (each is replaced atomically, so that is a file of something else).
    """
    d = os.path.join(run_dir, INDEX_DIR)
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.endswith(DAEMON_FAILED_SUFFIX))
    except OSError:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        doc = read_json(os.path.join(d, name))
        if not isinstance(doc, dict) or not isinstance(doc.get("snapshots"), list):
            continue
        node = str(doc.get("node") or name[:-len(".json")])
        if node == exclude:
            continue
        out[node] = [s for s in doc["snapshots"] if isinstance(s, dict)]
    return out



INDEX_LOCK_TIMEOUT_S = 10.0


def publish_index(run_dir: str, node: str, records: Sequence[SnapshotRecord]) -> str:
    """Rewrite ``RUN_DIR/ckpt-index/<node>.json`` atomically and return its path.

    Two writers publish a node's index: its daemon after every transition, and the restorer after it rejects a
    snapshot at restart (while the daemon may be running).  Each scans before it publishes, so a slower writer could
    overwrite a newer index with an older scan.  Under an ``flock`` on ``ckpt-index/.<node>.lock`` every record's
    state is re-read from its ``state.json`` (the source of truth beside the data) just before the rename, so the file
    written last is never older than the states on disk.  Without the lock (it timed out) the index is written anyway:
    it is derived data, and the next transition rewrites it.
    """
    d = os.path.join(run_dir, INDEX_DIR)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{node}.json")
    with _index_lock(os.path.join(d, f".{node}.lock")):
        fresh = [refresh_state(r) for r in records]
        write_json_atomic(path, {"node": node, "updated": time.time(), "snapshots": [r.to_json() for r in fresh]})
    return path


def refresh_state(rec: SnapshotRecord) -> SnapshotRecord:
    """``rec`` with the state and reason its directory records now (as :func:`scan` would read them).

    A directory that is gone (deleted meanwhile) or a record of no real directory is returned unchanged.
    """
    if not os.path.isdir(rec.path):
        return rec
    cur = read_record(rec.path)
    if cur is None or (cur.state, cur.reason) == (rec.state, rec.reason):
        return rec
    return SnapshotRecord(**{**asdict(rec), "state": cur.state, "reason": cur.reason})


class _index_lock:
    """``flock`` with a deadline (a stuck writer must not stop the other one for good)."""

    def __init__(self, path: str, timeout_s: float = INDEX_LOCK_TIMEOUT_S) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.fd: int | None = None

    def __enter__(self) -> "_index_lock":
        try:
            fd, _st = open_writable(self.path, mode=0o644)  # never through a link (core.safeopen)
        except OSError:
            log.warning("cannot open %s; publishing the index unlocked", self.path)
            return self
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.fd = fd
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    log.warning("index lock %s still held after %g s; publishing unlocked", self.path, self.timeout_s)
                    return self
                time.sleep(0.01)  # polling interval against the deadline above
            except OSError:  # a file system without flock
                os.close(fd)
                return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None
