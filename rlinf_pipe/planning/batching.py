"""One rollout engine's batching, simulated. SGLang batches continuously: requests decode together, each at the
engine's rate at its current concurrency divided among them, a finished request's place taken by the next waiting one
(whose prompt is prefilled first, pausing the others). The torch engine runs static batches
(`engines/rollout/torch_engine.py`): a first batch of `rollout.first_batch_size` (or the actor's micro-batch) rows
where its engines stream to an actor on other GPUs, then batches of `max_running` rows, each prefilled at once and
decoded until its last row is done before the next starts. Used by `planning.simulate` and `planning.profile`."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlinf_pipe.config.schema import Config
from rlinf_pipe.planning.engine_sizes import TORCH_MAX_RUNNING
from rlinf_pipe.planning.run_plan import RunPlan


def max_running(cfg: Config) -> float:
    """An engine's requests in flight at most: `rollout.max_running_requests`, else the torch engine's default, else
    no limit (SGLang admits what its KV cache holds)."""
    if cfg.rollout.max_running_requests:
        return cfg.rollout.max_running_requests
    return TORCH_MAX_RUNNING if cfg.rollout.backend == "torch" else math.inf


@dataclass(frozen=True)
class Batching:
    """How an engine takes its requests: continuously up to `max_running` at once, or (`static`) in batches of
    `first` rows, then `max_running` rows, each run to its end before the next."""

    max_running: float
    static: bool = False
    first: int = 0


def engine_batching(cfg: Config, plan: RunPlan) -> Batching:
    """The batching of `cfg`'s engines (the torch engine's first batch as `runner/components.py` sizes it)."""
    cap = max_running(cfg)
    if cfg.rollout.backend != "torch":
        return Batching(cap)
    first = cap if plan.engines_share_actor else cfg.rollout.first_batch_size or cfg.actor.micro_batch_size
    return Batching(cap, True, int(min(first, cap)))


def prefill_share(prompt_tokens: float, group_size: int) -> float:
    """A sample's share of its prompt's prefill: a group's samples prefill their prompt once (the torch engine's rows
    of one prompt share it within a batch, SGLang's prefix cache)."""
    return prompt_tokens / group_size


@dataclass(frozen=True)
class Request:
    """One sample to generate: its group, its share of its prompt's prefill (`prefill_share`) and its response
    tokens."""

    group: int
    prompt_tokens: float
    response_tokens: int


@dataclass(frozen=True)
class EngineRun:
    """When each request of a generation finished (in the order given) and when the engine went idle."""

    finish: tuple[float, ...]
    end: float


def run_engine(requests: Sequence[Request], start: float, decode_rate: Callable[[int], float],
               prefill_rate: float, max_running: float, finish_s: float = 0.0) -> EngineRun:
    """Simulate one engine from `start`: at most `max_running` requests run at once (the first ones admitted at
    `start` after their prefill), `decode_rate(n)` is the engine's decode tokens/s with `n` requests running,
    shared evenly among them; every moment requests finish costs `finish_s` (the torch engine hands them on)."""
    if not requests:
        return EngineRun((), start)
    most = int(min(max_running, len(requests)))
    per_request = [0.0, *(decode_rate(n) / n for n in range(1, most + 1))]  # (looked up, not computed, per event)
    t = start
    progress = 0.0  # tokens each running request has decoded since the engine started (all advance together)
    running: list[tuple[float, int]] = []  # (progress at which the request is done, its index)
    finish = [0.0] * len(requests)
    waiting = 0

    def admit(i: int) -> float:
        heapq.heappush(running, (progress + requests[i].response_tokens, i))
        return requests[i].prompt_tokens / prefill_rate

    while waiting < len(requests) and len(running) < max_running:
        t += admit(waiting)
        waiting += 1
    while running:
        done_at, i = running[0]
        if done_at > progress:  # (requests done at the same step leave in one call)
            t += (done_at - progress) / per_request[len(running)] + finish_s
        progress = done_at
        heapq.heappop(running)
        finish[i] = t
        if waiting < len(requests):
            t += admit(waiting)
            waiting += 1
    return EngineRun(tuple(finish), t)


def run_batched(requests: Sequence[Request], start: float, decode_rate: Callable[[int], float],
                prefill_rate: float, batching: Batching, finish_s: float = 0.0) -> EngineRun:
    """`run_engine` under `batching`: continuous, or static batches one after the other (each a `run_engine` of its
    rows from the end of the previous, `finish_s` at every moment rows finish)."""
    if not batching.static:
        return run_engine(requests, start, decode_rate, prefill_rate, batching.max_running)
    finish: list[float] = []
    t, i, size = start, 0, max(1, batching.first)
    while i < len(requests):
        run = run_engine(requests[i:i + size], t, decode_rate, prefill_rate, math.inf, finish_s)
        finish += run.finish
        t, i, size = run.end, i + size, max(1, int(batching.max_running))
    return EngineRun(tuple(finish), t)


def quantile_lengths(lengths: Sequence[int], count: int) -> list[int]:
    """`count` lengths at evenly spaced quantiles of `lengths`, the last of them the longest."""
    ordered = sorted(lengths)
    return [ordered[min(len(ordered) - 1, (i + 1) * len(ordered) // count - (1 if i + 1 < count else 0))]
            for i in range(count)]
