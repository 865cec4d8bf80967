"""A small line chart drawn with characters, for terminals on login nodes.

No dependency beyond the standard library: ``accelpact-cadence`` prints goodput against checkpoint interval with it,
and ``--plot`` draws the same data with matplotlib when that is installed.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

#: Mark drawn where two or more series share a cell.
OVERLAP = "#"
DEFAULT_MARKS = "*o+x"


def line_chart(
    xs: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    width: int = 60,
    height: int = 14,
    log_x: bool = False,
    x_label: str = "",
    y_label: str = "",
    x_format: Callable[[float], str] = lambda v: f"{v:.3g}",
    y_format: Callable[[float], str] = lambda v: f"{v:.3g}",
    marks: str = DEFAULT_MARKS,
    vline: float | None = None,
    y_range: tuple[float, float] | None = None,
) -> str:
    """Render ``series`` (name -> y values at ``xs``) as text lines.

    Args:
        xs: the x values, increasing, shared by every series.
        series: up to ``len(marks)`` named series; NaN values are not drawn.
        width, height: size of the plotting area in characters.
        log_x: place x values on a log scale (all must be positive).
        vline: an x value to mark with ``|`` (e.g. the recommended interval).
        y_range: fix the y axis instead of fitting the data.

    Returns:
        The chart, a legend and the axis labels, joined with newlines.
    """
    if len(xs) < 2:
        raise ValueError("a chart needs at least two x values")
    if len(series) > len(marks):
        raise ValueError(f"at most {len(marks)} series")
    width, height = max(10, width), max(4, height)
    tx = (lambda v: math.log(v)) if log_x else (lambda v: v)
    x0, x1 = tx(xs[0]), tx(xs[-1])
    finite = [y for ys in series.values() for y in ys if y is not None and math.isfinite(y)]
    if y_range is not None:
        y0, y1 = y_range
    elif finite:
        y0, y1 = min(finite), max(finite)
    else:
        y0, y1 = 0.0, 1.0
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5
    grid = [[" "] * width for _ in range(height)]

    def col(x: float) -> int:
        return min(width - 1, max(0, int(round((tx(x) - x0) / (x1 - x0) * (width - 1)))))

    def row(y: float) -> int:
        return min(height - 1, max(0, int(round((y1 - y) / (y1 - y0) * (height - 1)))))

    if vline is not None and xs[0] <= vline <= xs[-1]:
        c = col(vline)
        for r in range(height):
            grid[r][c] = "|"
    for mark, ys in zip(marks, series.values()):
        for x, y in zip(xs, ys):
            if y is None or not math.isfinite(y) or not (y0 <= y <= y1):
                continue
            r, c = row(y), col(x)
            cell = grid[r][c]
            grid[r][c] = mark if cell in (" ", "|", mark) else OVERLAP

    labels = [y_format(y1), y_format((y0 + y1) / 2), y_format(y0)]
    pad = max(len(s) for s in labels)
    lines = []
    if y_label:
        lines.append(f"{'':>{pad}}  {y_label}")
    for r in range(height):
        if r == 0:
            tick = labels[0]
        elif r == height // 2:
            tick = labels[1]
        elif r == height - 1:
            tick = labels[2]
        else:
            tick = ""
        lines.append(f"{tick:>{pad}} |" + "".join(grid[r]).rstrip())
    lines.append(f"{'':>{pad}} +" + "-" * width)
    left, right = x_format(xs[0]), x_format(xs[-1])
    mid_x = math.exp((x0 + x1) / 2) if log_x else (x0 + x1) / 2
    mid = x_format(mid_x)
    gap = max(1, width - len(left) - len(right) - len(mid))
    axis = left + " " * (gap // 2) + mid + " " * (gap - gap // 2) + right
    lines.append(f"{'':>{pad}}  {axis}")
    if x_label:
        lines.append(f"{'':>{pad}}  {x_label:^{width}}".rstrip())
    legend = "   ".join(f"{m} {name}" for m, name in zip(marks, series))
    extra = f"   {OVERLAP} both" if len(series) > 1 else ""
    extra += "   | recommended" if vline is not None else ""
    lines.append(f"{'':>{pad}}  {legend}{extra}")
    return "\n".join(lines)
