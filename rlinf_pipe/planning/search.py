"""`search(cfg, costs)`: the placements and parallel sizes of a config's cluster, ranked by predicted step time.

Candidates come from `planning.search_space` (shapes at a coarse unit of GPUs, then neighbours of the best at a
finer one; per component the parallel sizes the model allows). They are taken in the order of their bound
(`search_space.bound`): each is turned into a config (`candidate_config`), planned (`plan_run`: the placement rules
refuse it or not), checked against the memory estimate (`estimate_memory`: any component that does not fit refuses
it) and simulated (`planning.simulate`). The result keeps the K best placements, each with its best parallel
sizes, and, where the config budgets micro-batches by tokens, the largest `actor.micro_batch_tokens` the memory
estimate fits there. Sizes whose bound passes their placement's best prediction are pruned (they cannot change its
entry); once a candidate's bound passes the K-th best placement's predicted step time, it and
every later one are pruned unsimulated; past the budget of simulated samples the rest are left too (the result
says so).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Any

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import RlinfPipeError
from rlinf_pipe.planning.batching import max_running
from rlinf_pipe.planning.costs import Costs, cut_at, logprob_passes, shares_prompts
from rlinf_pipe.planning.gpu_ids import NodeLayout, parse_gpu_ids
from rlinf_pipe.planning.micro_batch_budget import largest_micro_batch_tokens, smallest_micro_batch_tokens
from rlinf_pipe.planning.placement import CPU_ONLY
from rlinf_pipe.planning.run_plan import plan_run
from rlinf_pipe.planning.search_space import (
    Shape,
    Sizes,
    Work,
    bound,
    neighbours,
    shapes,
    size_options,
    split_unit,
    stage_bounds,
)
from rlinf_pipe.planning.simulate import Prediction, simulate


SAMPLE_BUDGET = 2_400_000
"""Samples simulated per search at most (each a request through an engine, a few microseconds): the search stays
within about 8 s on a quiet machine whatever the cluster, and gives the same answer on any machine. A search of
8,192 samples a step (two steps simulated each) simulates at most 146 candidates."""


@dataclass(frozen=True)
class Candidate:
    """A placement (`shape`) with every component's parallel sizes, and its bound."""

    shape: Shape
    sizes: Sizes
    bound: float

    def overrides(self) -> list[str]:
        """The `key=value` list that turns the searched config into this candidate."""
        entries = ", ".join(f'"{k}": {v}' if "," in k else f"{k}: {v}" for k, v in self.placement().items())
        return [f"cluster.component_placement={{{entries}}}", *(f"{k}={v}" for k, v in self.sizes)]

    def placement(self) -> dict[str, str]:
        return self.shape.placement()


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    prediction: Prediction


@dataclass
class SearchResult:
    """The best candidates (best first) and what the search did: candidates enumerated, simulated, refused by the
    placement rules or the memory estimate, pruned by their bound; seconds taken."""

    ranked: list[Ranked]
    source: str
    enumerated: int = 0
    simulated: int = 0
    refused_rules: int = 0
    refused_memory: int = 0
    pruned: int = 0
    seconds: float = 0.0
    budget_hit: bool = False  # stopped at the simulation budget: a candidate left may beat the last ones shown
    refusals: list[str] = field(default_factory=list)  # a few of the reasons, for the report


def candidate_config(cfg: Config, cand: Candidate) -> Config:
    """`cfg` with the candidate's placement and parallel sizes (the same as loading it with `overrides()`)."""
    placement: dict[str, str | int | list[int] | None] = dict(cand.placement())
    reward = cfg.cluster.component_placement.get("reward")
    if reward is not None:
        placement["reward"] = reward
    sections: dict[str, dict[str, Any]] = {}
    for key, value in cand.sizes:
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return replace(cfg, cluster=replace(cfg.cluster, component_placement=placement),
                   **{s: replace(getattr(cfg, s), **v) for s, v in sections.items()})


def _model(cfg: Config) -> tuple[Any, Any, int]:
    """The model's architecture (None when its config.json cannot be read), a `problems(tp, pp)` of it and the
    bytes of a value of its folder's weights (`dtype_bytes_of`, as `plan`'s memory estimate reads them)."""
    from rlinf_pipe.models.arch import megatron_size_problems, model_arch, model_config
    from rlinf_pipe.planning.memory import dtype_bytes_of

    arch, _ = model_arch(cfg.actor.model_path)
    config, _ = model_config(cfg.actor.model_path)
    dtype_bytes = dtype_bytes_of(config) if config is not None else 2
    return arch, (lambda tp, pp: megatron_size_problems(arch, tp, pp)) if arch else (lambda tp, pp: []), dtype_bytes


def enumerate_candidates(cfg: Config, costs: Costs, shape_list: list[Shape], logprob_stage: bool,
                         problems: Any, sync_s: float) -> list[Candidate]:
    """Every candidate of `shape_list` (each shape with every combination of its components' sizes), bounded."""
    per_node = max(cfg.gpus_per_node())
    costs = cut_at(costs, cfg.rollout.max_new_tokens)  # (as `simulate` draws them)
    work = Work(cfg.data.rollout_batch_size, cfg.algorithm.group_size, cfg.algorithm.n_minibatches,
                {**{k: cfg.actor.context_parallel_size for k in ("actor", "actor_logprob", "actor_group",
                                                                   "actor_logprob_group")},
                 **{k: cfg.inference.context_parallel_size for k in ("inference", "inference_group")}},
                max_running(cfg), 0 if cfg.rollout.backend != "torch" else int(min(
                    max_running(cfg), cfg.rollout.first_batch_size or cfg.actor.micro_batch_size)),
                shares_prompts(cfg), logprob_passes(cfg))
    cache: dict[tuple[str, int, Sizes], float] = {}
    reward = cfg.cluster.component_placement.get("reward")
    layout = NodeLayout(cfg.gpus_per_node())
    processes = 1 if reward in (None, CPU_ONLY) else len(parse_gpu_ids("reward", reward, layout))
    scorers = processes * cfg.reward.num_workers  # (samples scored at once)
    arrival = cfg.algorithm.minibatch_order == "arrival" and not cfg.algorithm.dynamic_sampling

    def stage(component: str, gpus: int, sizes: Sizes) -> float:
        key = (component, gpus, sizes)
        if key not in cache:
            cache[key] = stage_bounds(costs, work, component, gpus, sizes)
        return cache[key]

    out = []
    for shape in shape_list:
        counts = shape.counts()
        names: list[str] = [n for n in ("rollout", "inference", "actor") if n in counts]
        options = [size_options(n, counts[n], per_node, problems) for n in names]
        for combo in itertools.product(*options):
            sizes: Sizes = tuple(kv for part in combo for kv in part)
            stage_s: dict[str, float] = {n: stage(n, counts[n], part) for n, part in zip(names, combo)}
            stage_s["reward"] = stage("reward", scorers, ())
            for n, part in zip(names, combo):
                if n != "rollout":  # (one group's pass: what must follow the last group generated)
                    stage_s[f"{n}_group"] = stage(f"{n}_group", counts[n], tuple(
                        (k.replace(f"{n}.", f"{n}_group."), v) for k, v in part))
            if logprob_stage and "inference" not in counts:
                for pass_ in ("actor_logprob", "actor_logprob_group"):
                    stage_s[pass_] = stage(pass_, counts["actor"], tuple(
                        (k.replace("actor.", f"{pass_}."), v) for k, v in combo[names.index("actor")]))
            out.append(Candidate(shape, sizes, bound(shape, stage_s, costs, sync_s, cfg.runner.max_staleness,
                                                     logprob_stage, work.minibatches, arrival)))
    return out


def search(cfg: Config, costs: Costs, capacity_bytes: int, top: int = 5, seed: int = 0,
           budget: int = SAMPLE_BUDGET) -> SearchResult:
    """The `top` best candidates of `cfg`'s cluster by predicted step time (see the module docstring), each GPU
    holding `capacity_bytes`; candidates stop being simulated once `budget` samples were (`SearchResult.budget_hit`)."""
    from rlinf_pipe.algorithms.logprob_needs import computes_logprobs
    from rlinf_pipe.planning.memory import estimate_memory

    started = time.perf_counter()
    if cfg.actor.micro_batch_tokens == "auto":  # (the memory check refuses a candidate only where not even one
        smallest = smallest_micro_batch_tokens(cfg)  # sample fits; each one kept gets the largest it fits below)
        cfg = replace(cfg, actor=replace(cfg.actor, micro_batch_tokens=smallest))
    total = sum(cfg.gpus_per_node())
    logprob_stage = computes_logprobs(cfg)
    arch, problems, dtype_bytes = _model(cfg)
    capacity = capacity_bytes
    result = SearchResult([], costs.source)
    seen: set[tuple[Shape, Sizes]] = set()
    best_of_shape: dict[Shape, float] = {}  # each placement's best prediction so far

    def sync_bound() -> float:
        return min(costs.weight_sync_s.values(), default=0.0)

    def run(candidates: list[Candidate]) -> None:
        result.enumerated += len(candidates)
        for i, cand in enumerate(sorted(candidates, key=lambda c: c.bound)):
            if (cand.shape, cand.sizes) in seen:
                continue
            seen.add((cand.shape, cand.sizes))
            if len(result.ranked) >= top and cand.bound >= result.ranked[top - 1].prediction.step_s:
                result.pruned += len(candidates) - i
                return
            if cand.bound >= best_of_shape.get(cand.shape, float("inf")):
                result.pruned += 1  # (it cannot beat its placement's best sizes, the placement's one entry)
                continue
            if result.simulated >= simulations:
                result.budget_hit = True
                result.pruned += len(candidates) - i
                return
            trial = candidate_config(cfg, cand)
            try:
                plan = plan_run(trial)
            except RlinfPipeError as exc:
                result.refused_rules += 1
                if len(result.refusals) < 5:
                    result.refusals.append(f"{cand.overrides()[0]}: {exc}")
                continue
            if arch is not None:
                memory = estimate_memory(trial, plan, arch, capacity, dtype_bytes)
                if not all(m.fits for m in memory.values()):
                    result.refused_memory += 1
                    continue
            prediction = simulate(trial, plan, costs, seed=seed)
            result.simulated += 1
            best_of_shape[cand.shape] = min(best_of_shape.get(cand.shape, float("inf")), prediction.step_s)
            same = next((r for r in result.ranked if r.candidate.shape == cand.shape), None)
            if same is not None and same.prediction.step_s <= prediction.step_s:
                continue  # (one entry per placement: its best parallel sizes)
            result.ranked = [r for r in result.ranked if r is not same] + [Ranked(cand, prediction)]
            result.ranked.sort(key=lambda r: r.prediction.step_s)
            del result.ranked[top:]

    steps = cfg.runner.max_staleness + 3 if cfg.runner.max_staleness else 2  # (what `simulate` runs)
    simulations = max(20, budget // (cfg.data.rollout_batch_size * cfg.algorithm.group_size * steps))
    coarse = split_unit(total)
    run(enumerate_candidates(cfg, costs, shapes(total, coarse, logprob_stage), logprob_stage, problems,
                             sync_bound()))
    if coarse > 1:  # refine around the best at the finest unit that keeps the neighbourhoods small
        fine = max(1, coarse // 4)
        near = {s for r in result.ranked[:2] for s in neighbours(r.candidate.shape, total, coarse, fine)}
        run(enumerate_candidates(cfg, costs, sorted(near, key=repr), logprob_stage, problems, sync_bound()))
    if cfg.actor.micro_batch_tokens is not None and arch is not None:  # (a config that budgets micro-batches by
        result.ranked = [with_micro_batch_tokens(cfg, r, arch, capacity, dtype_bytes)  # tokens)
                         for r in result.ranked]
    result.seconds = time.perf_counter() - started
    return result


def with_micro_batch_tokens(cfg: Config, ranked: Ranked, arch: Any, capacity_bytes: int, dtype_bytes: int = 2
                            ) -> Ranked:
    """`ranked` with the largest `actor.micro_batch_tokens` its placement fits among its sizes (the config's kept
    where none fits better)."""
    tokens = largest_micro_batch_tokens(candidate_config(cfg, ranked.candidate), arch, capacity_bytes,
                                        dtype_bytes)
    if tokens is None:
        return ranked
    sizes = (*ranked.candidate.sizes, ("actor.micro_batch_tokens", tokens))
    return Ranked(replace(ranked.candidate, sizes=sizes), ranked.prediction)
