"""`read_profile(run_dir)`: the costs a run measured, from its `timeline.json`, `metrics.jsonl` and `config.yaml`.

The first step (`warmup` steps) is left out when there are more (it warms up). Per figure:

* response lengths: the reward spans' `response_tokens` (every sample's length); older runs: the default's shape
  scaled to `response_length/mean`;
* prompt tokens: the reward spans' `prompt_tokens`; older runs: the default (half of `data.max_prompt_length`);
* decode: the torch engine's `generate` spans record its decode steps by batch size (`decode_steps`: rows, steps,
  seconds) and its prefills (`prefill`: prompt tokens, seconds), which give the curve and the prefill rate
  (`decode_profile.decode_curve_of_steps`), and its decode calls (`decode_calls`): the span's seconds outside steps
  and prefills over them are each call's hand-off (`Costs.decode_call_s`). SGLang's record each sample's send and
  return times and tokens (`requests`), whose overlap gives its decode rate against the requests in flight
  (`decode_profile.decode_curve_of_requests`); and each span (an engine's whole generation: its requests, response
  tokens and seconds) fixes the scale of the default curve's shape, for SGLang's prefill rate and for an older run's
  decode curve too: the engine is simulated on the default curve (`planning.batching`) with its requests' lengths (in
  a seeded random order) and its backend's batching (`batching.engine_batching`), and the curve scaled by simulated /
  measured seconds (the median over spans);
* log-prob and training tokens/s: each replica's sequence tokens over its spans' seconds (`tokens` of `logprob`
  spans, `sequence_tokens` of `train` spans; older runs: response tokens plus the prompts'); where the passes'
  sizes vary enough, a pass's fixed seconds and the tokens/s beyond them (`planning.pass_cost`); a run without a
  log-prob stage gives log-probs at its training passes' forward rate (`forward_s` of `train` spans: from a pass's
  start to its loss), older runs at 3 x the training rate (a forward is about a third of forward + backward);
* the optimizer step less its data-parallel reduction (`Costs.reduce_s` at the run's DP x CP), reward seconds per
  sample (the reward spans' seconds over their rounds of `reward.num_workers`: a mean, as a few slow answers take
  most of the time), the `weight_sync` seconds of a version on the run's transport less its driver calls
  (`run_plan.sync_calls`; the other transports in the default's proportion), the actor's onload + offload and the
  engines' wake + sleep per step, the launch span;
* the co-run slowdown (`planning.co_run`): how much longer work takes while another GPU of its host computes,
  fitted from the compute spans' overlap with other GPUs' work; the rates above are carried to work alone;
* one hop of a collective: a pushed broadcast's seconds (its longest span) less its bytes' time; a driver call's
  round trip: the metrics' `timing/call_round_trip` (the heartbeat's pings); the driver's work between steps: the
  median gap between the measured step spans; a log-prob worker's reading of its next group (the lower quartile
  of the gaps between its passes of one step) and, where the actor computes the log-probs, the latency of the call
  that starts its training (from its last log-prob pass to its first training pass: `_stage_calls`).

Token rates count what a pass runs (`costs.pass_tokens`: a group's prompt once where its rows share it), and each
log-prob pass of a span (old and reference log-probs) on its own.

Whatever is missing is named in `Costs.missing` and taken from `default_costs`.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.batching import engine_batching, max_running
from rlinf_pipe.planning.co_run import Sample, alone_figures, compute_samples, measured_slowdown
from rlinf_pipe.planning.costs import (Costs, Parallel, carried, default_costs, logprob_passes, pass_tokens,
                                       shares_prompts)
from rlinf_pipe.planning.decode_profile import decode_curve_of_requests, decode_curve_of_steps, decode_scale
from rlinf_pipe.planning.gpu_ids import NodeLayout
from rlinf_pipe.planning.pass_cost import fit_pass_cost, fixed_cost_beside
from rlinf_pipe.planning.run_plan import RunPlan, plan_run, sync_calls
from rlinf_pipe.utils.tracing import LAUNCH_SPAN, STEP_SPAN, Span

T = TypeVar("T")


SYNC_SPANS = ("weight_sync", "publish_weights")  # a version's move: the actor's side and the receivers'


def default_gpu(cfg: Config) -> str:
    """The GPU kind the defaults assume: an H100 for SGLang engines, else the virtual GPUs of a CPU machine."""
    return "H100" if cfg.rollout.backend == "sglang" else "cpu"


def read_run_config(run_dir: Path) -> Config:
    from rlinf_pipe.config import load_config

    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir}/config.yaml does not exist; give a run folder (it holds config.yaml, "
                          "timeline.json and metrics.jsonl)")
    return load_config(run_dir, "config")


def after_warmup(items: Sequence[T], warmup: int = 1) -> list[T]:
    """The steps measured, of `items` in step order: all but the first `warmup`, keeping at least the last."""
    return list(items[min(warmup, max(len(items) - 1, 0)):])


def kept_steps(steps: Sequence[Span], warmup: int = 1) -> list[Span]:
    """The step spans measured (`after_warmup` of them in time order)."""
    return after_warmup(sorted(steps, key=lambda s: s.start), warmup)


def step_cadence(spans: Sequence[Span], warmup: int = 1) -> float:
    """A run's step time over its measured steps (`kept_steps` of `spans`' step spans): the wall time from the first
    one's start to the last one's end over their count, the driver's work between steps included."""
    kept = kept_steps([s for s in spans if s.name == STEP_SPAN], warmup)
    return (kept[-1].end - kept[0].start) / len(kept)


def measured_spans(spans: Sequence[Span], warmup: int = 1) -> list[Span]:
    """The work spans inside the steps measured (every step but the first `warmup`, keeping at least the last)."""
    kept = kept_steps([s for s in spans if s.name == STEP_SPAN], warmup)
    numbers = {st.args.get("step") for st in kept}

    def inside(s: Span) -> bool:  # (a generation started, or a version pushed, during the step before counts in
        if "step" in s.args:       # the step it is for)
            return s.args["step"] in numbers
        if s.name in SYNC_SPANS and "version" in s.args:
            return s.args["version"] in numbers
        return any(st.start <= s.start < st.end for st in kept)

    return [s for s in spans if s.name not in (STEP_SPAN, LAUNCH_SPAN) and inside(s)]


def _by(spans: Sequence[Span], name: str, component: str | None = None) -> list[Span]:
    return [s for s in spans if s.name == name and (component is None or s.track.split("/")[0] == component)]


def _rate(spans: Sequence[Span], tokens_of: Callable[[Span], float]) -> float | None:
    seconds = sum(s.duration for s in spans)
    return sum(tokens_of(s) for s in spans) / seconds if spans and seconds > 0 else None


def _longest_per_version(work: Sequence[Span], driver: bool) -> dict[object, float]:
    """Per weight version, its longest sync span: the actor's `publish_weights` or a receiver's `weight_sync`, and
    with `driver` the driver's `weight_sync` (which only collects a pushed version)."""
    versions: dict[object, float] = defaultdict(float)
    for s in work:
        if s.name in SYNC_SPANS and (driver or s.track.split("/")[0] != "driver"):
            versions[s.args.get("version")] = max(versions[s.args.get("version")], s.duration)
    return versions


def _parallel(plan: RunPlan, name: str | None) -> Parallel:
    comp = plan.placement.components.get(name or "")
    return Parallel(comp.tp, comp.pp, comp.cp) if comp else Parallel()


def replica_sizes(plan: RunPlan) -> tuple[Parallel, Parallel, Parallel]:
    """The parallel sizes a run measures its rates on: its rollout, log-prob and actor replicas' (1s where one is
    not placed)."""
    return _parallel(plan, "rollout"), _parallel(plan, plan.logprob_component or "actor"), _parallel(plan, "actor")


@dataclass(frozen=True)
class SpanTokens:
    """The tokens a run's compute spans ran (`costs.pass_tokens`: a group's prompt once where its rows share it),
    from their args and the run's mean prompt and response."""

    prompt: float
    mean_response: float
    group_size: int
    shared: bool
    passes: int  # log-prob passes a logprob span runs (old and reference log-probs where both)

    @classmethod
    def of(cls, cfg: Config, costs: Costs) -> SpanTokens:
        return cls(costs.prompt_tokens, costs.mean_response, cfg.algorithm.group_size, shares_prompts(cfg),
                   logprob_passes(cfg))

    def train(self, s: Span) -> float:
        """A train span's pass."""
        sequence = s.args.get("sequence_tokens", s.args.get("tokens", 0) + s.args.get("sequences", 0) * self.prompt)
        return pass_tokens(s.args.get("tokens", 0), sequence - s.args.get("tokens", 0), self.group_size, self.shared)

    def logprob(self, s: Span) -> float:
        """Every pass of a logprob span together."""
        n = s.args.get("sequences", 0)
        sequence = s.args.get("tokens", n * (self.prompt + self.mean_response))
        return self.passes * pass_tokens(sequence - n * self.prompt, n * self.prompt, self.group_size, self.shared)


@dataclass(frozen=True)
class RunRecord:
    """A run folder read once: its config and plan, its timeline's spans, those after the first `warmup` steps
    (`work`) and its metrics; what `profile_of` and the co-run fit over several runs (`planning.profile_pool`) read."""

    run_dir: Path
    warmup: int
    cfg: Config
    plan: RunPlan
    spans: list[Span]
    work: list[Span]
    metrics: list[dict]

    def co_run_samples(self) -> list[Sample]:
        """The run's compute spans as samples of the co-run fit (`planning.co_run.compute_samples`)."""
        return compute_samples(self.work, NodeLayout(self.plan.placement.gpus_per_node).node_of)


def read_run(run_dir: str | Path, warmup: int = 1) -> RunRecord:
    """Run folder `run_dir` read (`RunRecord`); a folder without a config or a timeline is named in the error."""
    from rlinf_pipe.utils.metrics import read_metrics
    from rlinf_pipe.utils.timeline import read_chrome_trace

    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    plan = plan_run(cfg)
    if not (run_dir / "timeline.json").is_file():
        raise ConfigError(f"{run_dir}/timeline.json does not exist; a profile needs a run that trained a step")
    spans = read_chrome_trace(run_dir / "timeline.json")
    metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    return RunRecord(run_dir, warmup, cfg, plan, spans, measured_spans(spans, warmup), metrics)


def read_profile(run_dir: str | Path, gpu: str | None = None, warmup: int = 1) -> Costs:
    """The costs run `run_dir` measured (see the module docstring); `gpu` names the defaults' GPU (default:
    `default_gpu` of the run's config); the first `warmup` steps are left out (at least one step is kept)."""
    return profile_of(read_run(run_dir, warmup), gpu)


def profile_of(run: RunRecord, gpu: str | None = None, co_run: float | None = None) -> Costs:
    """`read_profile` of a run already read; `co_run`: the co-run slowdown fitted over several runs
    (`profile_pool`), in place of this run's own fit."""
    run_dir, warmup, cfg, plan, spans, work, metrics = (run.run_dir, run.warmup, run.cfg, run.plan, run.spans,
                                                        run.work, run.metrics)
    base = carried(default_costs(cfg, gpu or default_gpu(cfg)), *replica_sizes(plan))
    missing: list[str] = []
    figures: dict[str, object] = {}
    reward = _by(work, "reward")

    lengths = [n for s in reward for n in s.args.get("response_tokens", ())]
    if lengths:
        figures["response_lengths"] = tuple(lengths)
    else:
        mean = statistics.fmean(m["response_length/mean"] for m in metrics if "response_length/mean" in m) \
            if any("response_length/mean" in m for m in metrics) else None
        missing.append("response length of each sample (reward spans' response_tokens)"
                       + ("; the default's shape scaled to response_length/mean" if mean else ""))
        if mean:
            stretch, longest = mean / base.mean_response, cfg.rollout.max_new_tokens
            figures["response_lengths"] = tuple(min(longest, max(1, round(n * stretch)))
                                                for n in base.response_lengths)
    prompts = [s.args["prompt_tokens"] for s in reward if "prompt_tokens" in s.args]
    if prompts:
        figures["prompt_tokens"] = statistics.fmean(prompts)
    else:
        missing.append("prompt tokens (reward spans' prompt_tokens)")
    costs = replace(base, **figures)  # type: ignore[arg-type]

    generated = _by(work, "generate", "rollout")
    if measured_curve := decode_curve_of_steps(generated):
        figures["decode"], figures["prefill_tokens_per_s"], figures["decode_call_s"] = measured_curve
    else:
        requests_curve = decode_curve_of_requests(generated, max_running(cfg))
        if requests_curve is None:
            missing.append("an engine's decode steps by batch size or its requests' times (generate spans' "
                           "decode_steps or requests; the decode curve keeps the default's shape)")
        scale = decode_scale(generated, costs, cfg.algorithm.group_size, engine_batching(cfg, plan))
        if scale is not None:  # (the prefill rate, and the decode curve where no request was timed, scaled)
            figures["decode"] = requests_curve or costs.decode.scaled(scale)
            figures["prefill_tokens_per_s"] = costs.prefill_tokens_per_s * scale
        else:
            missing.append("generate spans (decode and prefill rates)")

    counts = SpanTokens.of(cfg, costs)
    run_tokens = counts.train
    trained = _by(work, "train", "actor")
    train = _rate(trained, run_tokens)
    if not any("sequence_tokens" in s.args for s in trained):
        missing.append("sequence tokens per train span (response tokens plus the mean prompt)")
    logprob_spans, passes, logprob_tokens = _by(work, "logprob"), counts.passes, counts.logprob
    logprob = _rate(logprob_spans, logprob_tokens)
    if logprob_spans and not any("tokens" in s.args for s in logprob_spans):
        missing.append("tokens per log-prob span (sequences x the mean sequence)")
    if train is not None:
        figures["train_tokens_per_s"] = train
    else:
        missing.append("train spans")
    timed = [s for s in trained if "forward_s" in s.args and "sequence_tokens" in s.args]
    forward_s = sum(s.args["forward_s"] for s in timed)
    forward = sum(run_tokens(s) for s in timed) / forward_s if timed and forward_s > 0 else None
    if logprob is not None:
        figures["logprob_tokens_per_s"] = logprob
    elif forward is not None:  # (the training passes' forwards: a log-prob pass is one, without the graph kept)
        figures["logprob_tokens_per_s"] = forward
    elif train is not None:
        figures["logprob_tokens_per_s"] = 3 * train
        missing.append("log-prob spans or the forward seconds of training passes (3 x the training rate)")
    logprob_runs = [(logprob_tokens(s) / passes, s.duration / passes) for s in logprob_spans]
    beside = fixed_cost_beside(logprob_runs, [(run_tokens(s), s.args["forward_s"]) for s in timed])
    for key, fit in (("train", fit_pass_cost([(run_tokens(s), s.duration) for s in trained])),
                     ("logprob", fit_pass_cost(logprob_runs) or beside)):
        if fit is not None:
            figures[f"{key}_pass_s"], figures[f"{key}_tokens_per_s"] = fit
        elif key == "train" or logprob_spans:
            missing.append(f"a {key} pass's fixed cost (its passes are all about one size: tokens/s alone)")
    slowdown, faster = measured_slowdown(work, NodeLayout(plan.placement.gpus_per_node).node_of, co_run)
    if slowdown is None:
        missing.append("the co-run slowdown (the compute spans' overlap with other GPUs' work varies too little)")
    else:
        figures |= alone_figures(figures, slowdown, faster, "logprob" if logprob is not None else "train")
    driver = _driver_figures(spans, metrics, warmup, missing)
    figures |= driver | _stage_calls(work, plan)
    collective = _collective_s(work, metrics, plan, base)
    if collective is not None:
        figures["collective_s"] = collective
    else:
        missing.append("a collective's latency (the spans of a pushed broadcast)")
    stand_in: list[str] = []  # figures that rest on a default's value: not measured, for pooling
    if opt := [s.duration for s in _by(work, "optimizer_step")]:  # (less its data-parallel reduction)
        actor = plan.placement.components["actor"]
        hop = replace(base, collective_s=base.collective_s if collective is None else collective)
        figures["optimizer_step_s"] = max(0.0, statistics.median(opt) - hop.reduce_s(_parallel(plan, "actor"),
                                                                                    actor.dp * actor.cp))
        if collective is None and actor.dp * actor.cp > 1:  # (its reduction taken off at the default's hop)
            stand_in.append("optimizer_step_s")
    workers = cfg.reward.num_workers
    rounds = sum(math.ceil(max(int(s.args.get("samples", 1)), 1) / workers) for s in reward)
    if rounds:  # (the mean: a few slow answers take most of the scoring's time)
        figures["reward_s_per_sample"] = sum(s.duration for s in reward) / rounds
    if versions := _longest_per_version(work, driver=True):
        calls = sync_calls(plan) * driver.get("call_s", base.call_s)  # (the driver's round trips, counted apart)
        measured = max(statistics.median(versions.values()) - calls, 0.0)
        default = base.sync_s(plan.weight_transport) or 1.0
        figures["weight_sync_s"] = {k: v * measured / default for k, v in base.weight_sync_s.items()}
    else:
        missing.append(f"weight_sync spans ({plan.weight_transport})")
    switches = _switches(work)
    figures["switch_s"] = base.switch_s | switches
    launch = [s.duration for s in spans if s.name == LAUNCH_SPAN and s.args.get("phase") == "job"]
    if launch:
        figures["launch_s"] = launch[0]
    missing.append("bytes per weight version per transport (seconds only, for the run's transport)")
    taken = [k for k in figures if k not in ("switch_s", "weight_sync_s", *stand_in)]
    taken += [f"switch_s.{k}" for k in switches]
    if "weight_sync_s" in figures:
        taken.append(f"weight_sync_s.{plan.weight_transport}")
    return replace(costs, **figures, source=f"profile of {run_dir}", missing=tuple(missing),  # type: ignore[arg-type]
                   measured=tuple(sorted(taken)))


def _driver_figures(spans: Sequence[Span], metrics: Sequence[dict], warmup: int, missing: list[str]
                    ) -> dict[str, float]:
    """The driver's costs: a call's round trip (the heartbeat's pings, `timing/call_round_trip`) and its work
    between steps (the median gap between the measured steps' spans)."""
    out: dict[str, float] = {}
    trips = [m["timing/call_round_trip"] for m in after_warmup(metrics, warmup) if "timing/call_round_trip" in m]
    if trips:
        out["call_s"] = statistics.median(trips)
    else:
        missing.append("a driver call's round trip (metrics' timing/call_round_trip)")
    steps = kept_steps([s for s in spans if s.name == STEP_SPAN], warmup)
    if gaps := [b.start - a.end for a, b in zip(steps, steps[1:])]:
        out["step_gap_s"] = max(0.0, statistics.median(gaps))
    return out


def _logprob_passes(work: Sequence[Span]) -> dict[tuple[str, object], list[Span]]:
    """The `logprob` spans per worker and step."""
    passes: dict[tuple[str, object], list[Span]] = defaultdict(list)
    for s in _by(work, "logprob"):
        passes[(s.track, s.args.get("step"))].append(s)
    return passes


def logprob_handoff_s(work: Sequence[Span]) -> float | None:
    """A log-prob worker's time between its passes of one step: the lower quartile of the gaps between consecutive
    `logprob` spans of a worker and step (a group read while the next waited, not a wait for it to arrive)."""
    return _handoff(_logprob_passes(work))


def _handoff(passes: dict[tuple[str, object], list[Span]]) -> float | None:
    gaps: list[float] = []
    for group in passes.values():
        ordered = sorted(group, key=lambda s: s.start)
        gaps += [b.start - a.end for a, b in zip(ordered, ordered[1:]) if b.start >= a.end]
    if not gaps:
        return None
    return statistics.quantiles(gaps, n=4)[0] if len(gaps) > 1 else gaps[0]


def _stage_calls(work: Sequence[Span], plan: RunPlan) -> dict[str, float]:
    """What a stage's calls cost beyond its passes: a log-prob worker's time between its passes of one step
    (`logprob_handoff_s`), and, where the actor computes the log-probs, the latency of the
    driver's call that starts its training (the median per step of its first `train` span's start less its last
    `logprob` span's end: the call returns, the next goes out)."""
    out: dict[str, float] = {}
    passes = _logprob_passes(work)
    if (handoff := _handoff(passes)) is not None:
        out["logprob_handoff_s"] = handoff
    if plan.actor_logprobs:
        trains: dict[tuple[str, object], float] = {}
        for s in _by(work, "train", "actor"):
            key = (s.track, s.args.get("version"))
            trains[key] = min(trains.get(key, math.inf), s.start)
        calls = [trains[key] - max(s.end for s in group) for key, group in passes.items()
                 if key[0].split("/")[0] == "actor" and key in trains and trains[key] > max(s.end for s in group)]
        if calls:
            out["phase_call_s"] = statistics.median(calls)
    return out


def _collective_s(work: Sequence[Span], metrics: Sequence[dict], plan: RunPlan, base: Costs) -> float | None:
    """One hop of a collective between two GPUs' processes: a pushed broadcast of a weight version (the median over
    versions of its longest span, the actor's `publish_weights` or a receiver's `weight_sync`: the sender's covers
    the collective from its start, a receiver that joins late sees only its tail) less its bytes' time at the
    link's bandwidth; None where the run's transport is not a broadcast or its versions are not pushed."""
    versions = _longest_per_version(work, driver=False)
    if plan.weight_transport != "broadcast" or sync_calls(plan) or not versions:
        return None
    sizes = [m["weight_sync/bytes"] for m in metrics if m.get("weight_sync/bytes")]
    moved = statistics.median(sizes) / base.collective_bytes_per_s if sizes else 0.0
    return max(statistics.median(versions.values()) - moved, base.collective_s / 100)


def _switches(work: Sequence[Span]) -> dict[str, float]:
    """Per component whose phase switches the run measured, their seconds per step (onload + offload, wake +
    sleep)."""
    steps = {s.args.get("step") for s in work if "step" in s.args} or {None}
    out: dict[str, float] = {}
    pairs = {"actor": ("onload", "offload"), "rollout": ("wake", "sleep")}
    for component, names in pairs.items():
        per_track: dict[str, float] = defaultdict(float)
        for s in work:
            if s.name in names and s.track.split("/")[0] == component:
                per_track[s.track] += s.duration
        if per_track:
            out[component] = max(per_track.values()) / len(steps)
    return out
