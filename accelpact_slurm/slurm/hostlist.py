"""Slurm's compressed list formats: node lists and per-node task counts.

:func:`expand_hostlist` turns a node list (``SLURM_JOB_NODELIST``: ``node[1-3,7]``, ``gpu[001-004],login``) into
the ordered hostnames (node ``i`` of a step is ``expand_hostlist(...)[i]``); :func:`compress_hostlist` is its
inverse and keeps the order.  :func:`parse_tasks_per_node` / :func:`format_tasks_per_node` handle
``SLURM_TASKS_PER_NODE`` (``3(x2),1``).

Syntax accepted (what Slurm produces and users write): comma-separated items; bracket groups of numbers or
``lo-hi`` ranges, the width of ``lo`` kept as zero padding (``a[01-03]`` -> ``a01 a02 a03``); several groups in one
item expanded as a product (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``); literal text of letters, digits, ``-``,
``.`` and ``_`` around them (``rack1-node[1-2].cluster``).  Anything else (unbalanced or nested brackets, empty
items, ``hi < lo``, spaces) raises :class:`~accelpact_slurm.core.errors.SlurmEnvError` naming the whole value.
No torch: login-node tools use it.
"""

from __future__ import annotations

import itertools
import logging
import re
from typing import Iterable, Sequence

from accelpact_slurm.core.errors import SlurmEnvError

log = logging.getLogger(__name__)

#: Most hostnames one list may expand to; stops ``node[1-999999999]`` from
#: exhausting memory on a typo (Slurm's own hostlist uses the same 64 Ki cap).
MAX_HOSTS = 64 * 1024

_LITERAL = re.compile(r"[A-Za-z0-9._-]*")
_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
# The last run of digits in a hostname is the part compress_hostlist brackets.
_HOST_PARTS = re.compile(r"^(.*?)(\d+)([^\d]*)$")
_HOSTNAME = re.compile(r"[A-Za-z0-9._-]+")
_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm compressed node list into hostnames, in order.

    Args:
        hostlist: A value such as ``"node[1-3,7]"`` or ``"a[01-02],login"``.
            An empty or all-blank string expands to an empty list.

    Returns:
        The hostnames, in the order the list names them (duplicates kept).

    Raises:
        SlurmEnvError: If the value is malformed or expands to more than
            :data:`MAX_HOSTS` names.  The message quotes the whole value.
    """
    text = hostlist.strip()
    if not text:
        return []
    hosts: list[str] = []
    for item in _split_top_level(text, hostlist):
        hosts.extend(_expand_item(item, hostlist))
        if len(hosts) > MAX_HOSTS:
            raise SlurmEnvError(
                f"host list {hostlist!r} expands to more than {MAX_HOSTS} hosts: "
                "check the ranges for a typo"
            )
    return hosts


def compress_hostlist(hosts: Iterable[str]) -> str:
    """Compresses hostnames into a Slurm node list, keeping their order (``["node1", "node2", "node3"]`` ->
    ``"node[1-3]"``; ``""`` for no hosts).

    Consecutive names that differ only in their last run of digits share one bracket group; ascending runs with the
    same zero padding become ``lo-hi``.  Unlike ``scontrol show hostlist`` nothing is sorted, so the result expands
    back to exactly ``hosts``.  Raises ``SlurmEnvError`` when a name is empty or holds characters outside letters,
    digits, ``-``, ``.`` and ``_``.
    """
    items: list[str] = []
    # Current bracket group: (prefix, suffix, ranges), each range [lo_str, hi_int, hi_str].
    group: tuple[str, str, list[list]] | None = None

    def flush() -> None:
        if group is None:
            return
        prefix, suffix, ranges = group
        if len(ranges) == 1 and ranges[0][0] == ranges[0][2]:
            items.append(f"{prefix}{ranges[0][0]}{suffix}")
            return
        parts = [lo if lo == hi_s else f"{lo}-{hi_s}" for lo, _, hi_s in ranges]
        items.append(f"{prefix}[{','.join(parts)}]{suffix}")

    for host in hosts:
        if not isinstance(host, str) or not _HOSTNAME.fullmatch(host):
            raise SlurmEnvError(
                f"hostname {host!r} cannot go in a Slurm host list: use letters, "
                "digits, '-', '.' and '_' only"
            )
        match = _HOST_PARTS.match(host)
        if match is None:  # no digits: a literal item of its own
            flush()
            group = None
            items.append(host)
            continue
        prefix, digits, suffix = match.groups()
        number = int(digits)
        if group is not None and group[0] == prefix and group[1] == suffix:
            last = group[2][-1]
            width = len(last[0])
            # Extend lo-hi only if expand_hostlist would print this exact string.
            if number == last[1] + 1 and str(number).zfill(width) == digits:
                last[1], last[2] = number, digits
            else:
                group[2].append([digits, number, digits])
            continue
        flush()
        group = (prefix, suffix, [[digits, number, digits]])
    flush()
    return ",".join(items)


def parse_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> tuple[int, ...]:
    """Parses Slurm's run-length task counts: ``2``, ``2(x3)``, ``3(x2),1``.

    Args:
        value: The variable's value.
        name: The variable's name, for the error message.

    Returns:
        One task count per node, e.g. ``(3, 3, 1)`` for ``"3(x2),1"``.

    Raises:
        SlurmEnvError: If the value is empty or malformed, or a count is zero.
    """
    counts: list[int] = []
    for item in value.strip().split(","):
        match = _TASKS_ITEM.fullmatch(item.strip())
        if match is None or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
            raise SlurmEnvError(
                f"{name}={value!r} is malformed: expected counts like '2', '2(x3)' "
                "or '3(x2),1'; launch the step with srun --ntasks-per-node=R"
            )
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:  # check before building a huge list
            raise SlurmEnvError(f"{name}={value!r} describes more than {MAX_HOSTS} nodes")
        counts.extend([int(match.group(1))] * repeat)
    return tuple(counts)


def format_tasks_per_node(counts: Sequence[int]) -> str:
    """Writes task counts the way Slurm does: ``(3, 3, 1)`` -> ``"3(x2),1"``."""
    items: list[str] = []
    for count, run in _runs(counts):
        items.append(f"{count}(x{run})" if run > 1 else str(count))
    return ",".join(items)


def _split_top_level(text: str, original: str) -> list[str]:
    """Splits on commas outside brackets; rejects nested or unbalanced brackets."""
    items: list[str] = []
    depth = 0
    start = 0
    for pos, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise SlurmEnvError(
                    f"host list {original!r} has nested '[' at offset {pos}: "
                    "write one bracket group per number, e.g. 'r[1-2]n[1-2]'"
                )
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(
                    f"host list {original!r} has an unmatched ']' at offset {pos}"
                )
        elif char == "," and depth == 0:
            items.append(text[start:pos])
            start = pos + 1
    if depth != 0:
        raise SlurmEnvError(f"host list {original!r} has an unclosed '['")
    items.append(text[start:])
    for item in items:
        if not item:
            raise SlurmEnvError(
                f"host list {original!r} has an empty item: remove the extra ','"
            )
    return items


def _expand_item(item: str, original: str) -> list[str]:
    """Expands one top-level item (no top-level commas) into hostnames."""
    choices: list[list[str]] = []
    pos = 0
    for match in _GROUP.finditer(item):
        choices.append([_literal(item[pos : match.start()], original)])
        choices.append(_expand_group(match.group(1), original))
        pos = match.end()
    choices.append([_literal(item[pos:], original)])
    count = 1
    for choice in choices:
        count *= len(choice)
    if count > MAX_HOSTS:
        raise SlurmEnvError(
            f"host list {original!r} expands to more than {MAX_HOSTS} hosts: "
            "check the ranges for a typo"
        )
    hosts = ["".join(parts) for parts in itertools.product(*choices)]
    if any(not host for host in hosts):
        raise SlurmEnvError(f"host list {original!r} has an empty hostname")
    return hosts


def _literal(text: str, original: str) -> str:
    if not _LITERAL.fullmatch(text):
        raise SlurmEnvError(
            f"host list {original!r} has invalid characters in {text!r}: "
            "hostnames use letters, digits, '-', '.' and '_'"
        )
    return text


def _expand_group(body: str, original: str) -> list[str]:
    """Expands the inside of one bracket group, e.g. ``01-03,7``."""
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise SlurmEnvError(
                f"host list {original!r} has an invalid range {part!r} in "
                f"'[{body}]': use numbers or lo-hi, e.g. 'node[1-4,7]'"
            )
        lo_text, hi_text = match.group(1), match.group(2)
        lo = int(lo_text)
        hi = lo if hi_text is None else int(hi_text)
        if hi < lo:
            raise SlurmEnvError(
                f"host list {original!r} has a descending range {part!r}: "
                f"write it as '{hi_text}-{lo_text}'"
            )
        if hi - lo + 1 > MAX_HOSTS:
            raise SlurmEnvError(
                f"host list {original!r} range {part!r} has more than "
                f"{MAX_HOSTS} hosts: check it for a typo"
            )
        width = len(lo_text)  # Slurm pads to the width of the low bound
        numbers.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return numbers


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """Run-length encodes ``values`` as (value, repeat) pairs."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs
