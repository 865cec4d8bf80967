"""The JSONL event log: one schema, written by every part, read by status and cadence.

Each line is one JSON object with at least::

    {"ts": <unix seconds, float>, "event": <kind>, "job_id": <str|None>,
     "restart": <int>, "rank": <int|None>, "node": <int|None>}

plus the fields of its kind (see :data:`EVENT_KINDS`).  Lines are appended with a single ``write`` on an ``O_APPEND``
descriptor so that several ranks and the checkpoint daemons may share one file without interleaving partial lines.

This module must not import torch: login-node tools read it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from accelpact_slurm.core.safeopen import (  # noqa: F401 - NotRegular, open_regular: also this module's API
    NotRegular, open_regular, open_writable, read_regular)

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
SUMMARY_FILE = "summary.json"

#: Event kinds and the fields each one carries beyond the common ones: every kind the package emits
#: (``tests/test_docs_paths.py`` reads the sources for the kinds emitted and fails on one not listed).
EVENT_KINDS: dict[str, tuple[str, ...]] = {
    "job_start": ("config", "world_size", "nodes", "ranks_per_node", "hostnames", "store_port"),
    "membership": ("local_rank", "hostname", "pid"),
    # Every process of the job, once at its start (per start of the job): ``role`` is ``rank`` (``rank`` set),
    # ``store`` (the job's store, beside rank 0), ``daemon`` (a node's checkpoint daemon), ``spare`` (a spare
    # process, ``local_rank`` set), ``launcher`` or ``zygote`` (the embedded default's own, on no emulated node:
    # ``node`` null); ``node`` is the node index, ``hostname`` its name.  ``tests/node_procs.py`` finds every pid
    # of one node from these (to SIGKILL exactly one node).
    "process": ("role", "pid", "hostname"),
    "spare_ready": ("spare", "local_rank", "pid", "warm_s"),
    "spare_assigned": ("spare", "local_rank", "generation", "dead_node", "ranks", "frontier", "takes_rank"),
    "spare_end": ("spare", "local_rank", "reason", "exit_code"),
    # One rank's part of a heal of a lost node by a spare (``HealOutcome.event()``): its role (``source``,
    # ``survivor``, ``spare``), each part's seconds, the bytes moved, the certificate (``certified``,
    # ``mismatches``); a spare's also names its ``spare`` process and ``spare_node``.
    "heal": ("role", "dead_node", "generation", "frontier", "seconds", "packet_bytes"),
    "heal_failed": ("dead_node", "generation", "frontier", "error"),
    # Rank 0 (the survivors' lead): a rank was lost and no spare heals it (why), so the survivors fail stop (L2).
    "heal_refused": ("reason", "stop"),
    "step": ("step", "loss", "step_s"),
    "protected": ("platform", "profile", "fsdp", "mesh", "state"),
    "footprint": ("rank0", "groups", "tightest", "shortfalls"),
    "replay_ref": ("snapshot", "step", "loss", "fingerprints", "layout", "mac"),
    "replay_check": ("snapshot", "step", "verdict", "reason"),
    "warning": ("step", "reason"),
    "fault": ("phase", "step", "fault_rank", "error"),
    "repair": ("generation", "frontier", "ranks", "rebound", "phases", "total_s"),
    "repair_rank": ("generation", "frontier", "member", "rebound", "total_s", "rss_bytes"),
    "fail_stop": ("reason", "exit_code", "cause", "phase", "frontier", "decision_s"),
    "detector": ("bounds_s", "slow_waits", "longest_wait_s", "verdicts"),
    "requeue": ("reason", "by"),
    "restart_load": ("step", "reason", "skipped"),
    "checkpoint": ("step", "state", "size_bytes", "path", "reason"),
    "checkpoint_copy": ("step", "source", "path", "size_bytes", "copy_s", "hostname", "reason"),
    "shared_upload": ("step", "ok", "source", "path", "size_bytes", "copy_s", "reason", "pruned"),
    "snapshot": ("step", "blocking_s", "parts_s", "staging_bytes"),
    "ckptd_restarted": ("hostname", "old_pid", "exit_status", "pid", "count", "limit", "reason"),
    "saved": ("step", "trigger", "verified", "states", "reason", "wait_s"),
    "job_end": ("final_step", "final_loss", "wall_s", "final_state_digest", "exit_code"),
}


class EventLog:
    """Appends events for one writer (a rank, a daemon or the launcher).

    Thread-safe; each event is one ``os.write`` of one line.  ``static`` fields
    (job id, restart count, rank, node) are added to every event.
    """

    def __init__(self, path: str | os.PathLike[str], **static: Any) -> None:
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._static = {"job_id": None, "restart": 0, "rank": None, "node": None}
        self._static.update(static)
        self._lock = threading.Lock()
        # never through a link or into a FIFO planted at the name: created O_EXCL, or an existing regular file
        # of this user (accelpact_slurm.core.safeopen)
        self._fd, _st = open_writable(self.path, append=True, mode=0o644)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return the record written."""
        record: dict[str, Any] = {"ts": time.time(), "event": event}
        record.update(self._static)
        record.update(fields)
        line = (json.dumps(record, separators=(",", ":"), default=_json_default) + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise ValueError(f"event log {self.path} is closed")
            os.write(self._fd, line)
        return record

    def fsync(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "__fspath__"):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    return str(obj)



def lap(parts: dict[str, Any], name: str, since: float) -> float:
    """Add the seconds since ``since`` (``time.monotonic()``) to ``parts[name]`` (an event's ``parts``: where a
    rank's time went, to 0.1 ms); return now, the start of the next part."""
    now = time.monotonic()
    parts[name] = round(parts.get(name, 0.0) + now - since, 4)
    return now

@dataclass(frozen=True)
class BadLine:
    """A line of an event log that could not be read, with its 1-based number."""

    path: str
    lineno: int
    reason: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.lineno}" if self.lineno else self.path  # 0: the whole file
        return f"{where}: skipped: {self.reason}"


# --------------------------------------------------------------------------- bounded, non-blocking reads

#: What a login-node tool reads of one event log (or Slurm log): the bytes past it are not read, and that is
#: one bad line.  A gibibyte is some ten million events, tens of seconds of parsing; a log that large
#: is not read to its end by a tool that must answer.
READ_LIMIT = 1 << 30
#: The longest line read (a job_start event of thousands of hosts is a few hundred kilobytes); a longer
#: one is skipped without being held in memory.
LINE_LIMIT = 16 << 20
#: The largest JSON document read whole (``summary.json``, a node's ``ckpt-index/<node>.json``).
JSON_FILE_LIMIT = 64 << 20


def read_file(path: str, limit: int = JSON_FILE_LIMIT) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them, never through a link
    (:func:`accelpact_slurm.core.safeopen.read_regular`).

    Raises:
        NotRegular: a link, not a regular file, or more than ``limit`` bytes (``why`` says so); other OSErrors.
    """
    return read_regular(path, limit)


def read_lines(path: str | os.PathLike[str], bad: list[BadLine] | None = None, *, limit: int = READ_LIMIT,
               line_limit: int = LINE_LIMIT, follow: bool = False) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, line)`` of a log, bounded and never blocking; a missing file yields nothing.

    A path that is not a regular file (a directory, a FIFO), cannot be opened, or holds more than
    ``limit`` bytes is one :class:`BadLine` in ``bad`` (line 0 for the whole file; past ``limit`` the
    rest is not read); a line longer than ``line_limit`` bytes is one bad line, skipped without being
    held in memory.  Never raises for what the file is or holds.
    """
    path = os.fspath(path)

    def skip(lineno: int, reason: str) -> None:
        if bad is not None:
            bad.append(BadLine(path, lineno, reason))

    try:
        fd, _st = open_regular(path, follow=follow)
    except FileNotFoundError:
        return
    except NotRegular as exc:
        skip(0, exc.why)
        return
    except OSError as exc:
        skip(0, f"cannot open: {exc.strerror or exc}")
        return
    past = f"past the first {limit} bytes (the most read of one log): the rest of the file is not read"
    with os.fdopen(fd, "rb") as fh:
        consumed, lineno = 0, 0
        while True:
            room = limit - consumed
            if room <= 0:
                if fh.read(1):
                    skip(lineno + 1, past)
                return
            want = min(line_limit + 1, room)
            try:
                raw = fh.readline(want)
            except OSError as exc:
                skip(lineno + 1, f"cannot read: {exc.strerror or exc}")
                return
            if not raw:
                return
            consumed += len(raw)
            lineno += 1
            if raw.endswith(b"\n") or len(raw) < want:  # a whole line, or the file's last
                yield lineno, raw
                continue
            if want == room and room <= line_limit:  # at the limit of the file, not of a line
                if fh.read(1):
                    skip(lineno, past)
                else:  # the file's last line ends exactly there
                    yield lineno, raw
                return
            while not raw.endswith(b"\n"):  # longer than line_limit: read past it, chunk by chunk
                room = limit - consumed
                if room <= 0:
                    break
                raw = fh.readline(min(1 << 20, room))
                if not raw:
                    break
                consumed += len(raw)
            skip(lineno, f"longer than {line_limit} bytes: not read")


#: No event of ours nests deeper than a few levels (job_start's config and its params).  A deeper
#: line is refused, so that no reader recurses near Python's limit: json's decoder gives up at
#: about 1,000 levels, and ``json.dumps`` of a status document holding a 900-level value fails too.
MAX_DEPTH = 100


class TooDeep(ValueError):
    """JSON nested deeper than :data:`MAX_DEPTH` levels."""


def parse_json(data: bytes | str) -> Any:
    """``json.loads`` that refuses nesting deeper than :data:`MAX_DEPTH` levels.

    Raises:
        TooDeep: nested too deeply (from json's own RecursionError, or measured after parsing).
        ValueError: not JSON (``UnicodeDecodeError`` included).
    """
    try:
        obj = json.loads(data)
    except RecursionError:  # 200,000 [ or {: json's C decoder gives up on its own recursion
        raise TooDeep(f"nested deeper than {MAX_DEPTH} levels") from None
    # Counting brackets is a cheap upper bound of the depth: only a line with many is walked.
    square, curly = (b"[", b"{") if isinstance(data, bytes) else ("[", "{")
    if data.count(square) + data.count(curly) > MAX_DEPTH and _deeper_than(obj, MAX_DEPTH):  # type: ignore[arg-type]
        raise TooDeep(f"nested deeper than {MAX_DEPTH} levels")
    return obj


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether lists and dicts nest more than ``limit`` levels in ``obj`` (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Iterable[Any] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number, else None.

    None for NaN and infinities (Python's json reads ``NaN`` and ``1e400``), for an
    integer beyond any float (``float(10**400)`` raises), for a bool and for a non-number.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def read_events(path: str | os.PathLike[str], bad: list[BadLine] | None = None, *,
                limit: int = READ_LIMIT) -> Iterator[dict[str, Any]]:
    """Yield the events of a log in order, skipping malformed or truncated lines.

    Each skipped line is appended to ``bad`` (when given) with its line number and why (:func:`parse_event_line`); the
    reader never raises on content, nor on what the path is: a directory or a FIFO is one bad line (line 0), not a
    traceback or a hang, and no more than ``limit`` bytes are read (:func:`read_lines`).  A missing file yields
    nothing.
    """
    path = os.fspath(path)
    for lineno, raw in read_lines(path, bad, limit=limit):
        text = raw.strip()
        if not text:
            continue
        record, reason = parse_event_line(text)
        if reason is not None:
            if bad is not None:
                bad.append(BadLine(path, lineno, reason))
            continue
        yield record


def parse_event_line(text: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One line of an event log as ``(event, None)``, or ``(None, why it is no event)``.

    No event: not JSON, nested deeper than :data:`MAX_DEPTH`, not an object with a string ``event``, or a ``ts`` that
    is a number but not a finite one.  A ``ts`` of another type is left to the readers, which treat it as unknown.
    """
    try:
        record = parse_json(text)
    except TooDeep as exc:
        return None, str(exc)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        return None, f"not JSON ({exc.__class__.__name__})"
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        return None, "no 'event' field"
    ts = record.get("ts")
    # 1e400, NaN or a 400-digit integer: every reader's arithmetic on it overflows or poisons a sum.
    if isinstance(ts, (int, float)) and not isinstance(ts, bool) and finite_number(ts) is None:
        return None, "'ts' is not a finite number of seconds"
    return record, None


# --------------------------------------------------------------------------- printing event text


def printable(text: str) -> str:
    """``text`` with its non-printable characters escaped as ``repr`` does (``\\x1b``, ``\\n``, ``\\u202e``).

    Event text comes from whatever wrote the log: an escape sequence in a reason must
    not clear the operator's screen, and a newline must not forge a line of output.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def printable_tree(obj: Any) -> Any:
    """A copy of a JSON-like tree with every string, dict keys included, passed through :func:`printable`.

    Recursive: the trees are status documents, whose values from event logs
    :func:`parse_json` kept within :data:`MAX_DEPTH` levels.
    """
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, dict):
        return {printable_tree(k): printable_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [printable_tree(v) for v in obj]
    return obj


def finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None: JSON has neither (Python's json would write invalid JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
