"""A part's committed summary: the figures ``docs/benchmarks.md`` and the README cite from one run of the part.

A part's run writes its raw result outside git (``runs/bench/<date>/<part>.json``, or under
``$ACCELPACT_BENCH_RAW``); :func:`summarize` reduces it to what the docs show, and only that is committed, as
``benchmarks/summaries/<date>/<part>.json`` (a few kB)::

    {"part", "date",
     "rows":    [{"what", "baseline", "ratio", "spread", "n", "note", ...}],  # the overview: median, min–max, n
     "goals":   [[goal, verdict, measured], ...],                            # the goals table's lines
     "readme":  "one README bullet" | null,
     "section": [paragraph | {"table": [[cell, ...], ...]}, ...]}            # the part's own section

``benchmarks/summaries/<date>/run.json`` records the run itself (machine, wall time, each part's status, commit
and arguments).  ``docs/benchmarks.md`` and the README's figures are rendered from these files alone
(``benchmarks/harness/run.py --render``), so nothing but the summaries has to be kept.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from benchmarks.harness import figures
from benchmarks.harness.docs_tables import rows_table

REPO = Path(__file__).resolve().parents[2]
SUMMARIES = REPO / "benchmarks" / "summaries"
#: Where raw results go: never into git (``runs/`` is ignored); ``$ACCELPACT_BENCH_RAW`` overrides it.
RAW = Path(os.environ.get("ACCELPACT_BENCH_RAW") or REPO / "runs" / "bench")
GOAL = re.compile(r"^\| `([\w-]+)` \| (.*?) \| (.*?) \| (.*) \|$")


# ====================================================================== a part's section


_RULE = re.compile(r"\|(?::?-+:?\|)+")


def _cells(line: str) -> list[str] | None:
    """A table line's cells (the rule under the header: its alignments), or None when joining them again would
    not give the same line back."""
    if _RULE.fullmatch(line):
        return line[1:-1].split("|")
    if not (line.startswith("| ") and line.endswith(" |")):
        return None
    cells = line[2:-2].split(" | ")
    return cells if _row(cells) == line else None


#: Where a quoted error was raised (`` (/abs/path/file.py:161, in pre_step)``): the run's checkout, not a figure;
#: left out of the docs, whose path checks would take it for a file of this tree.
CODE_LOCATION = re.compile(r" \(/[^()\s]+\.py:\d+, in \w+\)")


def _row(cells: list[str]) -> str:
    if cells and all(re.fullmatch(r":?-+:?", c) for c in cells):
        return "|" + "|".join(cells) + "|"
    return "| " + " | ".join(CODE_LOCATION.sub("", c) for c in cells) + " |"


def section_of(block: str, mark: str) -> list[Any]:
    """The part's block (between its two ``mark`` lines) as paragraphs and tables."""
    body = block.strip()
    if body.startswith(mark + "\n"):
        body = body[len(mark) + 1:]
    if body.endswith("\n" + mark):
        body = body[:-len(mark) - 1]
    out: list[Any] = []
    for chunk in body.split("\n\n"):  # exactly: section_text gives the same block back
        lines = chunk.split("\n")
        rows = [_cells(ln) for ln in lines]
        if lines and all(r is not None for r in rows):
            out.append({"table": rows})
        else:
            out.append(chunk)
    return out


def section_text(section: list[Any], mark: str) -> str:
    """The block :func:`section_of` read, marks included."""
    chunks = ["\n".join(_row(r) for r in c["table"]) if isinstance(c, dict) else c
              for c in section]
    return "\n".join([mark, "\n\n".join(chunks), mark])


# ====================================================================== from a raw result to its summary


def goals_of(part: str, lines: list[str]) -> list[list[str]]:
    """The goals table's lines of ``part`` (``figures.goal_lines``' text) as [goal, verdict, measured]."""
    out = []
    for ln in lines:
        m = GOAL.match(ln)
        if m and m.group(1) == part:
            out.append([m.group(2), m.group(3), m.group(4)])
    return out


def readme_of(part: str, bullets: list[str]) -> str | None:
    """The README bullet that names ``part`` (unwrapped), or None."""
    tag = "(`scripts/gpu-check.sh`" if part == "gpu-check" else f"(`{part}`"
    for b in bullets:
        if b.startswith("- ") and tag in b.split(":")[0] + ":":
            return b.replace("\n  ", " ")
    return None


def summarize(part: str, res: dict[str, Any], rows: list[dict[str, Any]], block: str, mark: str,
              raw_root: Path | None = None, peer_rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The summary of one part's raw result ``res``: its overview ``rows``, its rendered ``block``, and the goals
    and README bullet that ``figures`` derives from the result (``raw_root``: where a companion result such as
    the control part's per-update run lies, ``<raw_root>/<date>/<name>.json``)."""
    stored = {part: (res, "")}
    gpu = res if part == "gpu-check" else None
    bullets = figures.readme_lines({} if gpu else stored, gpu, peer_rows)
    return {"part": part, "date": res.get("date"),
            "rows": rows,
            "goals": goals_of(part, figures.goal_lines(stored, raw_root)),
            "readme": readme_of(part, bullets),
            "section": section_of(block, mark)}


# ====================================================================== reading and writing


_STR = r'"(?:[^"\\]|\\.)*"'
_FLAT = re.compile(r"\[\n\s+(" + _STR + r"(?:,\n\s+" + _STR + r")*)\n\s+\]")


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.new")
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    # a table row on one line: a list of strings only
    text = _FLAT.sub(lambda m: "[" + re.sub(r",\n\s+", ", ", m.group(1)) + "]", text)
    tmp.write_text(text + "\n")
    tmp.replace(path)
    return path


def newest(root: Path = SUMMARIES) -> dict[str, tuple[dict[str, Any], str]]:
    """Each part's newest summary (by its run's date) and its path relative to the repository."""
    found: dict[str, tuple[dict[str, Any], str]] = {}
    for path in sorted(root.glob("20??-??-??/*.json")):
        if path.stem == "run":
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            found[path.stem] = (doc, str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path))
    return found


def last_run(root: Path = SUMMARIES) -> tuple[dict[str, Any], str]:
    """The newest run record and its path (an empty record when there is none)."""
    runs = sorted(root.glob("20??-??-??/run.json"))
    if not runs:
        return {}, ""
    return json.loads(runs[-1].read_text()), str(runs[-1].relative_to(REPO))


def overview_lines(part: str, summ: dict[str, Any], when: str = "") -> list[str]:
    out = []
    for r in summ.get("rows") or []:
        r = dict(r)
        if when:
            r["note"] = f"{when}; {r.get('note') or ''}".rstrip("; ")
        out.append(rows_table([r], part_col=f"`{part}`")[-1])
    return out
