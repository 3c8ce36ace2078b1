"""`IntervalUnion`: the union of time intervals, and how much of a window it covers (a timeline's busy time, the
planner's overlap of work with other GPUs' work)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class IntervalUnion:
    """The union of intervals `(start, end)`, merged once (touching ones join): `covered(lo, hi)` is how much of
    [lo, hi] it holds, found by bisection."""

    def __init__(self, intervals: Iterable[tuple[float, float]]):
        merged: list[tuple[float, float]] = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self.intervals = merged
        self.starts = [start for start, _ in merged]

    def covered(self, lo: float, hi: float) -> float:
        total, i = 0.0, bisect.bisect_left(self.starts, hi) - 1
        while i >= 0 and self.intervals[i][1] > lo:
            start, end = self.intervals[i]
            total += min(hi, end) - max(lo, start)
            i -= 1
        return total
