"""A pass's fixed cost: `seconds = fixed + tokens / rate`, fitted from passes of different sizes.

A log-prob or training pass pays costs that do not shrink with its tokens (the framework's per-pass work, kernel
launches, packing): on the tiny CPU model a log-prob pass of one group spends about 60% of its time there, and a
training pass of 32 rows runs about 25% slower per token than one of 128 (docs/planning.md). A run whose passes
vary in size (a streaming actor trains `actor.micro_batch_size` rows as groups arrive, larger passes when it
catches up) measures both figures; a run whose passes are all about one size measures only their ratio, the rate.
Log-prob passes (a group each: one size) take their fixed cost from the line through them and the training passes'
forwards, which are the same forward over more rows (`fixed_cost_beside`).
"""

from __future__ import annotations

from collections.abc import Sequence

SIZE_SPREAD = 2.0  # the largest pass must hold at least this many times the tokens of the smallest to fit a fixed cost


def fit_pass_cost(passes: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """`(fixed seconds, tokens/s)` of `seconds = fixed + tokens / rate` by least squares over `passes` (each
    `(tokens, seconds)`); None where their sizes vary less than `SIZE_SPREAD` or the fit is not positive."""
    kept = [(n, s) for n, s in passes if n > 0 and s > 0]
    if len(kept) < 2 or max(n for n, _ in kept) < SIZE_SPREAD * min(n for n, _ in kept):
        return None
    mean_n = sum(n for n, _ in kept) / len(kept)
    mean_s = sum(s for _, s in kept) / len(kept)
    slope = (sum((n - mean_n) * (s - mean_s) for n, s in kept) / sum((n - mean_n) ** 2 for n, _ in kept))
    fixed = mean_s - slope * mean_n
    return (fixed, 1.0 / slope) if slope > 0 and fixed > 0 else None


def fixed_cost_beside(passes: Sequence[tuple[float, float]],
                      others: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """`(fixed seconds, tokens/s)` of `passes`, all about one size, from the fixed cost of the line through them and
    `others` (the same work in passes of other sizes, `fit_pass_cost`); the rate then gives `passes` their mean
    seconds. None where that line does not fit or leaves `passes` nothing beyond its fixed cost."""
    kept = [(n, s) for n, s in passes if n > 0 and s > 0]
    line = fit_pass_cost([*kept, *others]) if kept else None
    if line is None:
        return None
    fixed, mean_n = line[0], sum(n for n, _ in kept) / len(kept)
    mean_s = sum(s for _, s in kept) / len(kept)
    return (fixed, mean_n / (mean_s - fixed)) if fixed < mean_s else None
