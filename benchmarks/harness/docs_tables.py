"""The tables and generic blocks of ``docs/benchmarks.md`` (pure; ``benchmarks/harness/run.py`` renders with them).

Kept apart from the runner so that the renderer's pieces can be read, and tested, without it.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import common as bl


def machine_desc(m: dict[str, Any] | None) -> str:
    if not m:
        return "machine not recorded"
    if "cpu_model" in m:
        return bl.machine_line(m)
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in m.items() if v is not None and k != "loadavg_end")


def cell(x: Any) -> str:
    return "" if x is None else str(x).replace("|", "\\|").replace("\n", " ")


def ratio_text(r: dict[str, Any]) -> str:
    if r.get("ratio") is None:
        return "n/a"
    unit = r.get("unit")
    val = bl.fmt(r["ratio"])
    return val + ("x" if unit in (None, "", "x") else f" {unit}")


def rows_table(rows: list[dict[str, Any]], part_col: str | None = None) -> list[str]:
    head = "| what | baseline | ratio | spread (min–max) | n | note |"
    sep = "|---|---|---:|---:|---:|---|"
    if part_col is not None:
        head, sep = "| part " + head, "|---" + sep
    out = [head, sep]
    for r in rows:
        cells = [cell(r.get("what")), cell(r.get("baseline")), ratio_text(r), cell(r.get("spread") or "n/a"),
                 cell(r.get("n")), cell(r.get("note"))]
        out.append("| " + " | ".join(([part_col] if part_col is not None else []) + cells) + " |")
    return out


def generic_block(mark: str, title: str, res: dict[str, Any], why: str = "") -> str:
    lines = [mark, f"## {title}", ""]
    src = f" (raw data: `{res['json']}`)" if res.get("json") else ""
    lines.append(f"Run on {res.get('date', 'an unknown date')}{src}; machine: {machine_desc(res.get('machine'))}.")
    if why:
        lines += ["", why + "; its summary rows:"]
    lines.append("")
    rows = res.get("rows") or []
    lines += rows_table(rows) if rows else ["No summary rows in the result."]
    lines += ["", mark]
    return "\n".join(lines)


def gpu_block(res: dict[str, Any], mark: str, json_rel: str) -> str:
    """The GPU check's block (its result is written on another machine, by ``scripts/gpu_check.py``)."""
    intro = (f"Written by `scripts/gpu_check.py` (through `scripts/gpu-check.sh`) on {res.get('date', '?')} on a "
             f"separate machine with a GPU, not by `make bench` (raw data: `{json_rel}`). "
             f"Machine: {machine_desc(res.get('machine'))}. Ratios against a baseline measured in the same run, "
             "medians with min–max.")
    lines = [mark, "## GPU check", "", intro, ""]
    rows = res.get("rows") or []
    lines += rows_table(rows) if rows else ["No summary rows in the result."]
    if res.get("reading"):
        lines += ["", "**Reading.**", "", *[f"- {x}" for x in res["reading"]]]
    lines += ["", mark]
    return "\n".join(lines)
