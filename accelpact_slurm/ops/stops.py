"""How a start's stops read in ``accelpact-status``: the stop a rank wrote first, the others beside it, and a
frontier for each (its own, else the newest update the event log committed before it).

Pure but for :func:`last_committed_step`, which reads the end of an event log.  Torch-free: login nodes and the
ranks' fail-stop line use it.
"""

from __future__ import annotations

import os
from typing import Any

from accelpact_slurm.core.events import TooDeep, parse_json
from accelpact_slurm.core.safeopen import open_regular

#: Larger integers are no step count; a 400-digit one overflows float() in the step rate.
_MAX_COUNT = 2 ** 53


def count(value: Any) -> int | None:
    """``value`` when it is an integer a float can hold (a step number), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > _MAX_COUNT:
        return None
    return value


#: Further (cause, reason) pairs kept per start beside its first stop: other ranks' own words for the same end.
_OTHER_STOPS = 3


def add_stop(fail_stops: dict[Any, dict[str, Any]], rec: dict[str, Any], ts: float | None, restart: int,
              frontier: tuple[float, int, str] | None) -> None:
    """Fold one ``fail_stop`` event into its start's stop: the first one a rank wrote leads (the launcher writes its
    own only when no rank could, and it comes last), every other distinct cause and reason is kept beside it.

    A stop without a frontier (a restore that failed before the start committed anything) gets the newest update
    the log committed before it, so that no line says ``None``; ``frontier_source`` says where it came from.
    """
    cause = rec.get("cause") if isinstance(rec.get("cause"), str) else None
    reason = rec.get("reason") if rec.get("reason") is not None else None
    own = count(rec.get("frontier"))
    if own is not None:
        at, source = own, "event"
    elif frontier is not None:
        at, source = frontier[1], "log"
    else:
        at, source = None, None
    by_launcher = rec.get("by") == "launcher"
    entry = {"ts": ts, "restart": restart, "reason": reason, "exit_code": rec.get("exit_code"),
             "phase": rec.get("phase"), "frontier": at, "frontier_source": source, "decision": rec.get("decision"),
             "cause": cause, "culprit": rec.get("culprit") if isinstance(rec.get("culprit"), int) else None,
             "by": "launcher" if by_launcher else "rank", "others": []}
    first = fail_stops.get(restart)
    if first is None or (first["by"] == "launcher" and not by_launcher):
        if first is not None:
            entry["others"] = [{"cause": first["cause"], "reason": first["reason"]}] + first["others"]
        fail_stops[restart] = entry
        return
    if first["cause"] is None and cause is not None:
        first["cause"] = cause
    if first["frontier_source"] != "event" and own is not None:
        first["frontier"], first["frontier_source"] = own, "event"
    pair = {"cause": cause, "reason": reason}
    if (cause, reason) != (first["cause"], first["reason"]) and pair not in first["others"] \
            and len(first["others"]) < _OTHER_STOPS:
        first["others"].append(pair)


#: How much of an event log's end :func:`last_committed_step` reads: many updates' step events.
_TAIL_BYTES = 256 * 1024


def last_committed_step(path: str, tail_bytes: int = _TAIL_BYTES) -> int | None:
    """The newest update a ``step`` event in the last ``tail_bytes`` of the event log at ``path`` records as
    committed; None when there is none (or no log).  For a stop that carries no frontier of its own."""
    data, cut = read_tail(path, tail_bytes)
    lines = data.split(b"\n")
    if cut:
        lines = lines[1:]  # the first one is cut
    for raw in reversed(lines):
        if b'"step"' not in raw:
            continue
        try:
            rec = parse_json(raw)
        except (ValueError, TooDeep):
            continue
        if isinstance(rec, dict) and rec.get("event") == "step" and count(rec.get("step")) is not None:
            return rec["step"]
    return None


def read_tail(path: str, limit: int) -> tuple[bytes, bool]:
    """The last ``limit`` bytes of the regular file at ``path`` and whether its start was left out; ``b""`` for
    no file, a link or anything not a regular file (a FIFO planted there must not block the reader): opened by
    :func:`accelpact_slurm.core.safeopen.open_regular`."""
    try:
        fd, st = open_regular(path)
    except OSError:  # NotRegular included
        return b"", False
    try:
        start = max(0, st.st_size - limit)
        os.lseek(fd, start, os.SEEK_SET)
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), start > 0
    except OSError:
        return b"", False
    finally:
        os.close(fd)
