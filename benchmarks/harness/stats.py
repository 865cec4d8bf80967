"""The benchmarks' statistics and timing: every figure is a ratio against a baseline measured in the same run, side
by side (this machine is shared and noisy).  ``abba``/``rotate`` order the paired runs, ``paired_ratios``/
``ratio_stats``/``spread`` reduce them to median (min–max) and n, ``row`` makes an overview row of them, and
``Budget`` keeps a part's repeats within its deadline.

Standard library only (``scripts/gpu_check.py`` uses it on a machine that has nothing but torch).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class Budget:
    """A part's time budget: start nothing that would not fit (``fits``) after the longest one so far."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s, self.t0, self.longest = budget_s, time.monotonic(), 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def record(self, wall_s: float) -> None:
        self.longest = max(self.longest, wall_s)

    def fits(self, factor: float = 1.15) -> bool:
        return self.elapsed() + factor * self.longest <= self.budget_s


# ====================================================================== statistics


def med(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mean(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def spread(xs: Iterable[float | None]) -> dict[str, Any]:
    """``{"median", "min", "max", "n"}`` of the values (None values dropped)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def paired_ratios(test: Mapping[Any, float | None], base: Mapping[Any, float | None]) -> list[float]:
    """``test[k] / base[k]`` for every key (round, pair) both sides measured."""
    return [test[k] / base[k] for k in test if test[k] is not None and base.get(k)]


def ratio_stats(pairs: Iterable[tuple[float, float]]) -> dict[str, Any]:
    """``spread`` of the paired ratios a/b, plus the medians of both sides (``abs_test``, ``abs_base``)."""
    pairs = list(pairs)
    s = spread([a / b for a, b in pairs if b])
    s["abs_test"] = med([a for a, _ in pairs])
    s["abs_base"] = med([b for _, b in pairs])
    return s


def fmt(x: float | None, f: str = "{:.2f}") -> str:
    return "n/a" if x is None else f.format(x)


def fmt_spread(d: dict[str, Any] | None, f: str = "{:.2f}") -> str:
    """``median (min–max)``."""
    if not d or d.get("median") is None:
        return "n/a"
    return f"{f.format(d['median'])} ({f.format(d['min'])}–{f.format(d['max'])})"


def row(what: str, baseline: str, ratio: dict[str, Any], unit: str = "x", note: str = "") -> dict[str, Any]:
    """One overview row: ``ratio`` is a ``spread()`` of paired ratios (or of one-run ratios)."""
    return {"what": what, "baseline": baseline, "ratio": ratio.get("median"),
            "spread": None if ratio.get("median") is None else f"{fmt(ratio.get('min'))}–{fmt(ratio.get('max'))}",
            "n": ratio.get("n", 0), "unit": unit, "note": note}


# ====================================================================== side by side


def abba(i: int, a: Any, b: Any) -> tuple[Any, Any]:
    """The order of pair ``i``: ``a`` first in even pairs, ``b`` first in odd ones."""
    return (a, b) if i % 2 == 0 else (b, a)


def rotate(seq: Sequence[Any], k: int) -> list[Any]:
    """``seq`` rotated by ``k``: round ``k`` of a rotated order."""
    seq = list(seq)
    if not seq:
        return seq
    k %= len(seq)
    return seq[k:] + seq[:k]
