"""Exact loss normalisation over micro-batches: losses are returned as a numerator and a count.

A loss aggregated over a global batch is `sum(numerators) / sum(denominators)`, where each micro-batch contributes
its token-sum (or sequence-sum) numerator and its count of tokens (or sequences). Micro-batches split the batch
along whole sequences. A streaming trainer backpropagates each numerator as it comes, sums the denominators (and
all-reduces them over data-parallel ranks), and divides the accumulated gradient once: the result equals the loss
of the whole batch computed at once, whatever the split. Metrics follow the same rule: `Stat` keeps sums and
counts (or extremes), so they merge exactly too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import torch
from torch import Tensor

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)
Reduce = Literal["sum", "mean", "min", "max"]

_F64 = torch.float64


@dataclass(frozen=True)
class Stat:
    """A metric that merges exactly over micro-batches and ranks.

    `value` is the sum of the elements (reduce `sum` / `mean`) or their min / max; `count` is how many elements
    were seen. The final metric is `value` (sum, min, max) or `value / count` (mean); none when `count` is 0.
    """

    value: Tensor  # float64 scalar, detached
    count: Tensor  # float64 scalar
    reduce: Reduce

    @staticmethod
    def of(values: Tensor, valid: Tensor, reduce: Reduce) -> Stat:
        """The stat of `values` at the positions where `valid` is True."""
        v = values.detach().to(_F64)
        valid = valid.expand_as(v)
        count = valid.sum(dtype=_F64)
        if reduce in ("sum", "mean"):
            return Stat(torch.where(valid, v, 0.0).sum(), count, reduce)
        fill = float("inf") if reduce == "min" else float("-inf")
        extreme = torch.where(valid, v, fill).flatten()
        extreme = torch.cat([extreme, extreme.new_full((1,), fill)])
        return Stat(extreme.amin() if reduce == "min" else extreme.amax(), count, reduce)

    @staticmethod
    def scalar(value: Tensor, count: Tensor, reduce: Reduce = "mean") -> Stat:
        """A stat from an already reduced `value` (a sum, or an extreme) over `count` elements."""
        return Stat(value.detach().to(_F64), count.detach().to(_F64), reduce)

    def merge(self, other: Stat) -> Stat:
        if other.reduce != self.reduce:
            raise ValueError(f"cannot merge a {self.reduce!r} stat with a {other.reduce!r} stat")
        if self.reduce == "min":
            value = torch.minimum(self.value, other.value)
        elif self.reduce == "max":
            value = torch.maximum(self.value, other.value)
        else:
            value = self.value + other.value
        return Stat(value, self.count + other.count, self.reduce)

    def result(self) -> float | None:
        """The metric value, or None if no element was seen (sums are 0 then)."""
        if self.reduce == "sum":
            return float(self.value)
        if float(self.count) <= 0:
            return None
        return float(self.value / self.count) if self.reduce == "mean" else float(self.value)


@dataclass(frozen=True)
class LossTerms:
    """A loss over one micro-batch, in the form that sums exactly over micro-batches.

    `numerator`: differentiable scalar, the sum over this micro-batch of what the aggregation mode averages.
    `denominator`: float64 scalar count of what it averages over, `unit` "tokens" or "sequences".
    `metrics`: name -> `Stat`. The loss of any set of micro-batches is `finalize(merge(them))`.
    """

    numerator: Tensor
    denominator: Tensor
    unit: str
    metrics: dict[str, Stat] = field(default_factory=dict)

    def detach(self) -> LossTerms:
        """The same terms without the autograd graph (to keep for logging after backward)."""
        return replace(self, numerator=self.numerator.detach())


def check_loss_agg(loss_agg: str) -> None:
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg {loss_agg!r} (algorithm.loss_agg); expected one of {LOSS_AGG_MODES}")


def aggregate(values: Tensor, mask: Tensor, loss_agg: LossAgg) -> tuple[Tensor, Tensor, str]:
    """Numerator, denominator and unit that aggregate per-token `values` `[batch, seq]` over `mask`.

    - `token-mean`: sum of valid token values / number of valid tokens.
    - `seq-mean-token-sum`: sum of valid token values / number of sequences.
    - `seq-mean-token-mean`: sum over sequences of (their token mean) / number of sequences.

    A sequence with no valid token (a padding row) counts in no denominator. Padding positions of `values` are
    ignored even when they hold NaN or inf.
    """
    check_loss_agg(loss_agg)
    valid = mask.bool()
    values = torch.where(valid, values, torch.zeros_like(values))
    tokens_per_seq = valid.sum(-1)
    if loss_agg == "token-mean":
        return values.sum(), valid.sum(dtype=_F64), "tokens"
    sequences = (tokens_per_seq > 0).sum(dtype=_F64)
    if loss_agg == "seq-mean-token-sum":
        return values.sum(), sequences, "sequences"
    per_seq_mean = values.sum(-1) / tokens_per_seq.clamp(min=1).to(values.dtype)
    return per_seq_mean.sum(), sequences, "sequences"


def merge(terms: Iterable[LossTerms]) -> LossTerms:
    """Sum the terms of several micro-batches (of the same global batch): numerators, denominators, metrics."""
    terms = list(terms)
    if not terms:
        raise ValueError("merge() needs at least one LossTerms")
    first, rest = terms[0], terms[1:]
    numerator, denominator, metrics = first.numerator, first.denominator, dict(first.metrics)
    for t in rest:
        if t.unit != first.unit:
            raise ValueError(f"cannot merge losses normalised by {first.unit!r} and by {t.unit!r}")
        numerator = numerator + t.numerator
        denominator = denominator + t.denominator
        for name, stat in t.metrics.items():
            metrics[name] = metrics[name].merge(stat) if name in metrics else stat
    return LossTerms(numerator, denominator, first.unit, metrics)


def finalize(terms: LossTerms | Iterable[LossTerms]) -> Tensor:
    """The normalised loss `sum(numerators) / sum(denominators)`; 0 (still differentiable) when nothing counted."""
    t = terms if isinstance(terms, LossTerms) else merge(terms)
    den = t.denominator.to(t.numerator.dtype)
    return t.numerator / torch.where(den > 0, den, torch.ones_like(den))


def finalize_metrics(terms: LossTerms | Iterable[LossTerms]) -> dict[str, float]:
    """Metric values as floats; metrics that saw no element are left out."""
    t = terms if isinstance(terms, LossTerms) else merge(terms)
    out = {name: stat.result() for name, stat in sorted(t.metrics.items())}
    return {name: value for name, value in out.items() if value is not None}


def all_reduce_terms(terms: LossTerms, group: object = None) -> LossTerms:
    """Detached terms summed (metrics min- / max-reduced) over the ranks of a torch.distributed `group`.

    Three collectives: one SUM over numerator, denominator, sums and counts; one MIN; one MAX. Every rank must
    hold the same metric names.
    """
    import torch.distributed as dist

    names = sorted(terms.metrics)
    stats = [terms.metrics[n] for n in names]
    extremes = {r: [i for i, s in enumerate(stats) if s.reduce == r] for r in ("min", "max")}
    summed = [terms.numerator.detach().to(_F64), terms.denominator.to(_F64)]
    summed += [s.count for s in stats] + [s.value for s in stats if s.reduce in ("sum", "mean")]
    packed = torch.stack(summed)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    reduced = {}
    for reduce, op in (("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
        if extremes[reduce]:
            t = torch.stack([stats[i].value for i in extremes[reduce]])
            dist.all_reduce(t, op=op, group=group)
            reduced.update(zip(extremes[reduce], t.unbind(), strict=True))
    counts = packed[2 : 2 + len(stats)]
    sums = iter(packed[2 + len(stats) :].unbind())
    metrics = {
        n: Stat(reduced[i] if s.reduce in ("min", "max") else next(sums), counts[i], s.reduce)
        for i, (n, s) in enumerate(zip(names, stats, strict=True))
    }
    return LossTerms(packed[0].to(terms.numerator.dtype), packed[1], terms.unit, metrics)
