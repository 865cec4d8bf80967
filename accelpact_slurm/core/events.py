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
    "replay_ref": ("snapshot", "step", "loss", "fingerprints", "layout"),
    "replay_check": ("snapshot", "step", "verdict", "reason"),
    "warning": ("step", "reason"),
    "fault": ("phase", "step", "fault_rank", "error"),
    "repair": ("generation", "frontier", "ranks", "rebound", "phases", "total_s"),
    "fail_stop": ("reason", "exit_code", "phase", "frontier", "decision_s"),
    "requeue": ("reason", "by"),
    "restart_load": ("step", "reason", "skipped"),
    "checkpoint": ("step", "state", "size_bytes", "path", "reason"),
    "snapshot": ("step", "blocking_s"),
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


def read_events(path: str | os.PathLike[str], bad: list[BadLine] | None = None) -> Iterator[dict[str, Any]]:
    """Yield the events of a log in order, skipping malformed or truncated lines.

    Each skipped line is appended to ``bad`` (when given) with its line number;
    the reader never raises on content.  A missing file yields nothing.
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
            try:
                record = json.loads(text)
            except (ValueError, UnicodeDecodeError) as exc:
                if bad is not None:
                    bad.append(BadLine(path, lineno, f"not JSON ({exc.__class__.__name__})"))
                continue
            if not isinstance(record, dict) or not isinstance(record.get("event"), str):
                if bad is not None:
                    bad.append(BadLine(path, lineno, "no 'event' field"))
                continue
            yield record
