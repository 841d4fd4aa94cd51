"""Side-by-side timing shared by the benchmarks: interleaved A/B rounds, medians."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def interleaved_medians(a: Callable[[], float], b: Callable[[], float], rounds: int) -> tuple[float, float]:
    """Median of `a()` and of `b()` (each returns one round's time) over `rounds` rounds, A then B in each:
    a host that speeds up or slows down in between moves both sides alike."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(a())
        tb.append(b())
    return statistics.median(ta), statistics.median(tb)
