"""An engine's decode curve from a run's `generate` spans (`planning.profile` reads it): the torch engine's decode
steps by batch size (`decode_curve_of_steps`), SGLang's requests' send and return times
(`decode_curve_of_requests`), or, for an older run, the default curve scaled to the measured generations
(`decode_scale`)."""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence

from rlinf_pipe.planning.batching import Batching, Request, prefill_share, quantile_lengths, run_batched
from rlinf_pipe.planning.costs import Costs, Curve
from rlinf_pipe.utils.tracing import Span


def lengths_like(lengths: Sequence[int], count: int, total: float) -> list[int]:
    """`count` lengths at evenly spaced quantiles of `lengths`, scaled to sum to `total`."""
    picked = quantile_lengths(lengths, count)
    scale = total / max(sum(picked), 1)
    return [max(1, round(n * scale)) for n in picked]


def decode_scale(generate: Sequence[Span], costs: Costs, group_size: int, batching: Batching) -> float | None:
    """The median over `generate` spans of simulated seconds on the default curve / measured seconds."""
    scales = []
    for span in generate:
        requests, tokens = int(span.args.get("prompts", 0)) * group_size, float(span.args.get("tokens", 0))
        if requests <= 0 or tokens <= 0 or span.duration <= 0:
            continue
        lengths = lengths_like(costs.response_lengths, requests, tokens)
        random.Random(0).shuffle(lengths)  # (sorted, a static batch would hold all the short ones)
        reqs = [Request(0, prefill_share(costs.prompt_tokens, group_size), n) for n in lengths]
        run = run_batched(reqs, 0.0, lambda n: costs.decode_rate(n, costs.rollout_parallel),
                          costs.prefill_rate(costs.rollout_parallel), batching)
        scales.append(run.end / span.duration)
    return statistics.median(scales) if scales else None


def decode_curve_of_steps(generate: Sequence[Span]) -> tuple[Curve, float, float] | None:
    """An engine's decode tokens/s against its rows decoding together, its prefill tokens/s and the hand-off of
    each of its decode calls, from the `generate` spans' `decode_steps` ([rows, steps, seconds]), `prefill`
    ([tokens, seconds]) and `decode_calls`: the rows binned by powers of two, each bin's point at its step-weighted
    rows, `rows x steps / seconds`; the spans' seconds outside their steps and prefills over their calls. None where
    no span has them (SGLang's engine records none)."""
    bins: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # bin -> [rows x steps, steps, seconds]
    prefill, outside, calls = [0.0, 0.0], 0.0, 0
    for span in generate:
        timed = 0.0
        for rows, steps, seconds in span.args.get("decode_steps", ()):
            entry = bins[int(math.log2(rows))]
            entry[0], entry[1], entry[2] = entry[0] + rows * steps, entry[1] + steps, entry[2] + seconds
            timed += seconds
        tokens, seconds = span.args.get("prefill", (0, 0.0))
        prefill[0], prefill[1] = prefill[0] + tokens, prefill[1] + seconds
        if span.args.get("decode_calls"):
            outside, calls = outside + span.duration - timed - seconds, calls + span.args["decode_calls"]
    points = tuple((work / steps, work / seconds) for work, steps, seconds in (bins[b] for b in sorted(bins))
                   if steps > 0 and seconds > 0)
    if not points or prefill[1] <= 0:
        return None
    return Curve(points), prefill[0] / prefill[1], max(0.0, outside) / max(1, calls)


def decode_curve_of_requests(generate: Sequence[Span], cap: float) -> Curve | None:
    """An engine's decode tokens/s against its requests in flight, from the `generate` spans' `requests` (SGLang's
    adapter: each sample's send and return times and tokens): between one send or return and the next the same
    requests are in flight (at most `cap` run: the rest wait in the engine's queue); each decodes at its response
    tokens over its time in flight, and the engine at their sum. Per number running (binned by powers of two, each
    point at its time-weighted number), the tokens decoded over the time. None where no span has them."""
    bins: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # bin -> [running x s, tokens, seconds]
    for span in generate:
        changes = sorted(change for a, b, _, r in span.args.get("requests", ()) if b > a
                         for change in ((a, 1, r / (b - a)), (b, -1, r / (b - a))))  # (time, +-1, its rate)
        flying, rate = 0, 0.0  # (a sweep over the sends and returns: the requests in flight, their decode rates)
        for (t, step, r), following in zip(changes, changes[1:]):
            flying, rate = flying + step, rate + step * r
            if flying and following[0] > t:  # (every change at `t` applied: [t, next change] as they stand)
                running, seconds = min(flying, cap), following[0] - t
                entry = bins[int(math.log2(running))]
                entry[0] += running * seconds
                entry[1] += rate * seconds
                entry[2] += seconds
    points = tuple((n_s / seconds, tokens / seconds) for n_s, tokens, seconds in (bins[b] for b in sorted(bins))
                   if seconds > 0 and tokens > 0)
    return Curve(points) if points else None
