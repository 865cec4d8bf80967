"""The JSONL event log: one schema, written by every part, read by status and cadence.

Each line is one JSON object with at least::

    {"ts": <unix seconds, float>, "event": <kind>, "job_id": <str|None>,
     "restart": <int>, "rank": <int|None>, "node": <int|None>}

plus the fields of its kind (see :data:`EVENT_KINDS`).  Lines are appended with a
single ``write`` on an ``O_APPEND`` descriptor so that several ranks and the
checkpoint daemons may share one file without interleaving partial lines.

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
from typing import Any, Iterator

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
SUMMARY_FILE = "summary.json"

#: Event kinds and the fields each one carries beyond the common ones.
EVENT_KINDS: dict[str, tuple[str, ...]] = {
    "job_start": ("config", "world_size", "nodes", "ranks_per_node", "hostnames"),
    "membership": ("local_rank", "hostname", "pid"),
    "step": ("step", "loss", "step_s"),
    "protected": ("platform", "profile", "fsdp", "mesh", "state"),
    "replay_ref": ("snapshot", "step", "loss", "fingerprints", "layout", "mac"),
    "replay_check": ("snapshot", "step", "verdict", "reason"),
    "warning": ("step", "reason"),
    "fault": ("phase", "step", "fault_rank", "error"),
    "repair": ("generation", "frontier", "ranks", "rebound", "phases", "total_s"),
    "fail_stop": ("reason", "exit_code", "cause", "phase", "frontier", "decision_s"),
    "detector": ("bounds_s", "slow_waits", "longest_wait_s", "verdicts"),
    "requeue": ("reason", "by"),
    "restart_load": ("step", "reason", "skipped"),
    "checkpoint": ("step", "state", "size_bytes", "path", "reason"),
    "shared_upload": ("step", "ok", "source", "path", "size_bytes", "copy_s", "reason", "pruned"),
    "snapshot": ("step", "blocking_s", "parts_s"),
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
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def update_static(self, **fields: Any) -> None:
        self._static.update(fields)

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


@dataclass(frozen=True)
class BadLine:
    """A line of an event log that could not be read, with its 1-based number."""

    path: str
    lineno: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.lineno}: skipped: {self.reason}"


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
    if data.count(square) + data.count(curly) > MAX_DEPTH and _deeper_than(obj, MAX_DEPTH):
        raise TooDeep(f"nested deeper than {MAX_DEPTH} levels")
    return obj


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether lists and dicts nest more than ``limit`` levels in ``obj`` (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
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


def read_events(path: str | os.PathLike[str], bad: list[BadLine] | None = None) -> Iterator[dict[str, Any]]:
    """Yield the events of a log in order, skipping malformed or truncated lines.

    Each skipped line is appended to ``bad`` (when given) with its line number and
    why (:func:`parse_event_line`); the reader never raises on content.  A missing
    file yields nothing.
    """
    path = os.fspath(path)
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        for lineno, raw in enumerate(fh, start=1):
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

    No event: not JSON, nested deeper than :data:`MAX_DEPTH`, not an object with a
    string ``event``, or a ``ts`` that is a number but not a finite one.  A ``ts`` of
    another type is left to the readers, which treat it as unknown.
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
