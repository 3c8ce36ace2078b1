"""The placements `plan --search` considers, and a quick bound on each one's step time.

A `Shape` is a split of the GPUs into contiguous ranges, in the order rollout, inference, actor, with the
components that share a range: collocated (`actor,rollout: all`), disaggregated (each its own range, with or
without inference workers), and the two hybrids (`actor,rollout` + `inference`; `rollout,inference` + `actor`).
Counts step by a unit (`split_unit`); `neighbours` refines around a shape with a finer one. Per component, the
parallel sizes tried are those the model divides into (`megatron_size_problems`) and the count holds: every
rollout TP, and the `MEGATRON_TRIED` smallest replicas of the Megatron components.

`bound` is the step time of a candidate if every stage ran with no wait: the largest stage on GPUs of its own, the
sum of those taking turns on one set, plus the weight sync where the engines wait for it. A stage's time is its
tokens over its replicas' rates, the generation's that of one engine simulated on evenly spaced quantiles of the
response lengths (ending at the longest: the slowest engine holds the longest response). The search
simulates candidates in the order of their bound and stops once the bound passes the K-th best prediction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rlinf_pipe.planning.batching import Batching, Request, prefill_share, quantile_lengths, run_batched, run_engine
from rlinf_pipe.planning.costs import Costs, Parallel, pass_tokens, scale_rate

Sizes = tuple[tuple[str, int], ...]  # (config key, value), e.g. ("actor.tensor_parallel_size", 2)
ROLLOUT_TP = (1, 2, 4, 8)
MEGATRON = ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (8, 2), (8, 4))  # (tp, pp)
# The smallest replicas are tried: a larger one only loses throughput per GPU (`costs.scale_rate`), and is needed
# only where the memory estimate refuses the smaller ones.
MEGATRON_TRIED = 3


@dataclass(frozen=True)
class Shape:
    """A split of `total` GPUs: `ranges` maps a (possibly joined) placement key to its GPU count, in GPU order."""

    mode: str
    ranges: tuple[tuple[str, int], ...]

    def counts(self) -> dict[str, int]:
        return {name: n for key, n in self.ranges for name in key.split(",")}

    def placement(self) -> dict[str, str]:
        out, first = {}, 0
        for key, n in self.ranges:
            out[key] = f"{first}-{first + n - 1}" if n > 1 else str(first)
            first += n
        return out


def split_unit(total: int, target_units: int = 32) -> int:
    """The coarse step of GPU counts: a power of two leaving at most about `target_units` steps."""
    return 1 << max(0, int(math.log2(max(1.0, total / target_units))))


def shapes(total: int, unit: int, logprob_stage: bool) -> list[Shape]:
    """Every shape with counts in multiples of `unit` (see the module docstring)."""
    units = total // unit
    out = [Shape("collocated", (("actor,rollout", total),))]
    for a in range(1, units):
        ga, gb = a * unit, total - a * unit
        out.append(Shape("disaggregated", (("rollout", ga), ("actor", gb))))
        if logprob_stage:
            out.append(Shape("hybrid", (("actor,rollout", ga), ("inference", gb))))
            out.append(Shape("hybrid", (("rollout,inference", ga), ("actor", gb))))
            out += [Shape("disaggregated", (("rollout", ga), ("inference", b * unit), ("actor", gb - b * unit)))
                    for b in range(1, units - a)]
    return out


def neighbours(shape: Shape, total: int, coarse: int, fine: int) -> list[Shape]:
    """Shapes of the same kind whose range boundaries lie within `coarse` GPUs of `shape`'s, in steps of `fine`."""
    if len(shape.ranges) == 1:
        return []
    keys = [k for k, _ in shape.ranges]
    counts = [n for _, n in shape.ranges]
    steps = range(-coarse, coarse + 1, fine)
    out = []
    for d0 in steps:
        for d1 in (steps if len(counts) == 3 else (0,)):
            new = [counts[0] + d0, *((counts[1] - d0 + d1,) if len(counts) == 3 else ()), 0]
            new[-1] = total - sum(new[:-1])
            if all(n > 0 for n in new):
                out.append(Shape(shape.mode, tuple(zip(keys, new))))
    return out


def size_options(component: str, gpus: int, per_node: int, problems: Callable[[int, int], list[str]]) -> list[Sizes]:
    """The parallel sizes `component` may take on `gpus` GPUs (`problems(tp, pp)`: why the model refuses them)."""
    if component == "rollout":
        return [(("rollout.tensor_parallel_size", tp),) for tp in ROLLOUT_TP
                if gpus % tp == 0 and tp <= per_node and not problems(tp, 1)]
    allowed = [(tp, pp) for tp, pp in MEGATRON if gpus % (tp * pp) == 0 and tp <= per_node and not problems(tp, pp)]
    smallest = sorted(allowed, key=lambda s: (s[0] * s[1], s[1]))[:MEGATRON_TRIED]
    return [((f"{component}.tensor_parallel_size", tp), (f"{component}.pipeline_parallel_size", pp))
            for tp, pp in smallest]


@dataclass(frozen=True)
class Work:
    """One step's work: prompts, samples per prompt, mini-batches, response and sequence tokens."""

    prompts: int
    group_size: int
    minibatches: int
    cp: dict[str, int]
    max_running: float  # an engine's requests in flight at most
    first_batch: int = 0  # the torch engine's first static batch where it streams to an actor (0: SGLang)
    shared: bool = False  # whether a group's rows run its prompt once (`costs.shares_prompts`)
    passes: int = 1  # forward passes of the log-prob stage (`costs.logprob_passes`)

    def samples(self) -> int:
        return self.prompts * self.group_size


def stage_bounds(costs: Costs, work: Work, component: str, gpus: int, sizes: Sizes) -> float:
    """Seconds of `component`'s stage at its peak rate on `gpus` GPUs of `sizes` (`generate`: the larger of the
    tokens over every engine's peak and the longest response at one request's rate; the others: their tokens over
    their replicas' rate, training with its optimizer steps)."""
    values = dict(sizes)
    if component == "reward":  # its processes' pools, sample by sample
        return work.samples() * costs.reward_s_per_sample / gpus
    if component == "rollout":
        par = Parallel(values["rollout.tensor_parallel_size"])
        per_engine = -(-work.samples() // (gpus // par.gpus))
        share = prefill_share(costs.prompt_tokens, work.group_size)
        requests = [Request(0, share, n) for n in quantile_lengths(costs.response_lengths, per_engine)]
        factor = scale_rate(1.0, costs.rollout_parallel, par)
        decode, prefill = (lambda n: costs.decode.at(n) * factor), costs.prefill_rate(par)
        ends = [run_engine(requests, 0.0, decode, prefill, work.max_running).end]
        if work.first_batch:  # (the torch engine's static batches, with either first batch: the least of them)
            ends += [run_batched(requests, 0.0, decode, prefill, Batching(work.max_running, True, first)).end
                     for first in (work.first_batch, int(work.max_running))]
        return min(ends)
    par = Parallel(values[f"{component}.tensor_parallel_size"], values[f"{component}.pipeline_parallel_size"],
                   work.cp.get(component, 1))
    replicas = gpus // par.gpus
    tokens = pass_tokens(work.samples() * costs.mean_response, work.samples() * costs.prompt_tokens,
                         work.group_size, work.shared) / replicas
    if component in ("inference", "actor_logprob", "inference_group", "actor_logprob_group"):
        one_group = component.endswith("_group")
        return work.passes * tokens / costs.logprob_rate(par) / (replicas * work.prompts if one_group else 1)
    if component == "actor_group":  # the last group's training and the last optimizer step
        return tokens / costs.train_rate(par) / (replicas * work.prompts) + costs.optimizer_s(par)
    return tokens / costs.train_rate(par) + work.minibatches * costs.optimizer_s(par)


def bound(shape: Shape, stage_s: dict[str, float], costs: Costs, sync_s: float, staleness: int,
          logprob_stage: bool, minibatches: int, arrival_slots: bool) -> float:
    """The candidate's step time with no stage waiting (see the module docstring); `stage_s` from `stage_bounds`
    per component (`actor_logprob`: the actor's own log-prob pass; `*_group`: one group's pass). After the last
    group is generated and scored, at least its own log-prob pass and training remain."""
    gen, train = max(stage_s["rollout"], stage_s["reward"]), stage_s["actor"]  # (scoring streams beside)
    inference = stage_s.get("inference", 0.0)
    own_logprob = stage_s.get("actor_logprob", 0.0) if logprob_stage and "inference" not in shape.counts() else 0.0
    switch = costs.switch_s
    sync = sync_s if staleness == 0 else 0.0
    keys = [k for k, _ in shape.ranges]
    if "actor,rollout" in keys:  # the engines, then the actor (log-probs, training) on one set; the scoring and
        phases = stage_s["rollout"] + switch.get("rollout", 0) + switch.get("actor", 0) + own_logprob + train
        last = (stage_s["reward"] + stage_s.get("inference_group", 0.0)  # any inference run on beside them
                + stage_s.get("actor_logprob_group", 0.0) + stage_s.get("actor_group", 0.0))
        return max(phases, last, inference + stage_s.get("actor_group", 0.0)) + sync
    last = stage_s.get("actor_group", 0.0)  # (the last group's training follows its arrival)
    if staleness:  # the next steps' generation overlaps this step's training: no stage waits for another
        side = switch.get("rollout", 0) + switch.get("inference", 0) + inference if "rollout,inference" in keys \
            else inference
        return max(gen + side if "rollout,inference" in keys else gen, side, own_logprob + train)
    if own_logprob:  # the actor's log-probs stream; it trains once they are all computed
        return max(gen + stage_s.get("actor_logprob_group", 0.0), own_logprob) + train + sync
    if "rollout,inference" in keys:
        side = switch.get("rollout", 0) + switch.get("inference", 0)
        return max(gen + side + inference + last, train) + sync
    return max(gen + stage_s.get("inference_group", 0.0) + last, inference + last, train) + sync
