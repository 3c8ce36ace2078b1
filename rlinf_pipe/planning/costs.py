"""What a step's work costs: the figures the step simulator (`planning.simulate`) turns into a predicted step time.

`Costs` holds per-replica rates, each with the parallel sizes it was measured on, and `source` says where they came
from (printed beside every prediction): a run's profile (`planning.profile.read_profile`), RLinf-style hand-measured
seconds (`planning.rlinf_costs`), or the default here, derived from the model's size and the GPU's FLOPs and memory
bandwidth (`default_costs`). A rate measured on one replica size is carried to another by one function,
`scale_rate`, which every use goes through.

Token counts: decode and prefill rates count response and prompt tokens; log-prob and training rates count the
tokens a pass runs (`pass_tokens`: the responses, and a group's prompt once where its rows share it) -- what a
forward (one log-prob pass: old or reference) or a forward + backward processes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from rlinf_pipe.config.schema import Config

DEFAULT_SOURCE = "default: derived from the model's size and the GPU's FLOPs and memory bandwidth"
RLINF_SOURCE = "RLinf-style --costs"


@dataclass(frozen=True)
class Curve:
    """y against x, linear between the measured points, flat beyond the ends (`points` sorted by x)."""

    points: tuple[tuple[float, float], ...]

    def at(self, x: float) -> float:
        i = bisect.bisect_left(self.points, (x, -math.inf))
        if i == 0:
            return self.points[0][1]
        if i == len(self.points):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def scaled(self, factor: float) -> Curve:
        return Curve(tuple((x, y * factor) for x, y in self.points))

    @property
    def peak(self) -> float:
        return max(y for _, y in self.points)


@dataclass(frozen=True)
class Parallel:
    """The GPUs of one replica: tensor x pipeline x context parallel."""

    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp


# Share of throughput per GPU kept at each doubling of a replica's model-parallel size (communication, pipeline
# bubbles): a guess of the usual order, documented in docs/planning.md; a profile measured at the target size needs
# no scaling.
TP_EFFICIENCY, PP_EFFICIENCY, CP_EFFICIENCY = 0.9, 0.85, 0.9


def parallel_efficiency(p: Parallel) -> float:
    """`TP_EFFICIENCY ** log2(tp) * PP_EFFICIENCY ** log2(pp) * CP_EFFICIENCY ** log2(cp)`."""
    return (TP_EFFICIENCY ** math.log2(p.tp) * PP_EFFICIENCY ** math.log2(p.pp)
            * CP_EFFICIENCY ** math.log2(p.cp))


def unpipelined(p: Parallel) -> Parallel:
    """`p` as a pass of the actor or a log-prob worker runs on it: the streaming passes send one micro-batch (a
    log-prob pass, a group's few) through the pipeline stages one after the other, so the stages add no throughput
    to a pass (`engines/policy/policy.py`'s schedule call); they still hold a share of the model each."""
    return Parallel(p.tp, 1, p.cp)


def scale_rate(rate: float, measured: Parallel, target: Parallel) -> float:
    """A replica's rate measured on `measured` carried to `target`: `rate x target.gpus / measured.gpus x
    efficiency(target) / efficiency(measured)` (`parallel_efficiency`). The one scaling rule of the planner."""
    return rate * target.gpus / measured.gpus * parallel_efficiency(target) / parallel_efficiency(measured)


@dataclass(frozen=True)
class Costs:
    """Per-replica cost figures and the replica sizes they were measured on (see the module docstring)."""

    decode: Curve  # an engine's decode tokens/s (all its requests together) against its concurrent requests
    prefill_tokens_per_s: float  # an engine's prompt tokens/s
    response_lengths: tuple[int, ...]  # sampled response lengths (tokens); the simulator draws from them
    prompt_tokens: float  # mean prompt tokens
    logprob_tokens_per_s: float  # a log-prob replica's sequence tokens/s (forward), beyond `logprob_pass_s`
    train_tokens_per_s: float  # an actor data-parallel replica's sequence tokens/s (forward + backward), beyond
    # `train_pass_s`
    optimizer_step_s: float  # one optimizer step on `train_parallel`, less its data-parallel reduction
    weight_sync_s: dict[str, float]  # seconds to move one weight version, per transport
    reward_s_per_sample: float  # one reward process scoring one sample
    switch_s: dict[str, float]  # a component's onload + offload (or wake + sleep) around one phase
    launch_s: float  # a job's start to its first step
    source: str
    rollout_parallel: Parallel = Parallel()
    logprob_parallel: Parallel = Parallel()
    train_parallel: Parallel = Parallel()
    collective_s: float = 2e-5  # one hop of a collective between two GPUs' processes (its latency)
    collective_bytes_per_s: float = 50e9  # a collective's bandwidth between GPUs
    tp_hop_s: float = 0.0  # one hop of a tensor-parallel all-reduce, where a run at another TP size measured it
    # (0: `collective_s`)
    grad_bytes: float = 0.0  # the model's gradient bytes, summed over the data-parallel ranks every optimizer step
    call_s: float = 0.0  # a driver call's round trip to a worker, paid where a phase starts by the driver's call
    step_gap_s: float = 0.0  # the driver's work between one step's end and the next step's start
    decode_call_s: float = 0.0  # the torch engine's work between its decode calls (one ends where rows finish)
    co_run_slowdown: float = 0.0  # work x (1 + this x the share of its time another GPU of its host computes)
    phase_call_s: float = 0.0  # a stage call's latency, the driver's call to the worker's first work (`phase_call`)
    logprob_handoff_s: float = 0.0  # a log-prob worker's time between its passes of one step (reading the next group)
    share_s: float = 0.0  # a pass's input shared from a replica's input rank with its other ranks (a replica over
    # several GPUs), beyond `logprob_handoff_s`, where a run of such replicas measured it
    logprob_pass_s: float = 0.0  # a log-prob pass's fixed seconds, whatever its tokens (where measured)
    train_pass_s: float = 0.0  # a training pass's (micro-batch's) fixed seconds, whatever its tokens (where measured)
    missing: tuple[str, ...] = ()  # figures the source did not have (each taken from the default, labelled)
    notes: dict[str, str] = field(default_factory=dict)  # per figure, where it came from when not from `source`
    measured: tuple[str, ...] = ()  # the fields a profile measured (a dict's key as `field.key`); pooled alone

    @property
    def phase_call(self) -> float:
        """The latency of a driver's call that starts a stage: `phase_call_s` where measured, at least a round trip
        (`call_s`)."""
        return max(self.phase_call_s, self.call_s)

    @property
    def tp_hop(self) -> float:
        """One hop of a tensor-parallel all-reduce: `tp_hop_s` where measured, else `collective_s`."""
        return self.tp_hop_s or self.collective_s

    def decode_rate(self, concurrent: float, target: Parallel) -> float:
        return scale_rate(self.decode.at(concurrent), self.rollout_parallel, target)

    def prefill_rate(self, target: Parallel) -> float:
        return scale_rate(self.prefill_tokens_per_s, self.rollout_parallel, target)

    def logprob_rate(self, target: Parallel) -> float:
        return scale_rate(self.logprob_tokens_per_s, unpipelined(self.logprob_parallel), unpipelined(target))

    def train_rate(self, target: Parallel) -> float:
        return scale_rate(self.train_tokens_per_s, unpipelined(self.train_parallel), unpipelined(target))

    def optimizer_s(self, target: Parallel, reduce_ranks: int = 1) -> float:
        """An optimizer step of a replica of `target`'s size, its gradients summed over `reduce_ranks` (DP x CP)."""
        return self.optimizer_step_s / scale_rate(1.0, self.train_parallel, target) + self.reduce_s(target,
                                                                                                  reduce_ranks)

    def reduce_s(self, target: Parallel, ranks: int) -> float:
        """The data-parallel part of an optimizer step over `ranks` ranks: `OPTIMIZER_COLLECTIVES` collectives of
        `2 x ceil(log2 ranks)` hops each (latency), and a ring all-reduce of the replica's share of the gradients,
        `2 (ranks - 1) / ranks x grad_bytes / (tp x pp)` bytes at `collective_bytes_per_s`. 0 for one rank."""
        if ranks <= 1:
            return 0.0
        shard = self.grad_bytes / (target.tp * target.pp)
        return reduce_hops(ranks) * self.collective_s + 2 * (ranks - 1) / ranks * shard / self.collective_bytes_per_s

    def sync_s(self, transport: str) -> float:
        return self.weight_sync_s.get(transport, max(self.weight_sync_s.values(), default=0.0))

    @property
    def mean_response(self) -> float:
        return sum(self.response_lengths) / len(self.response_lengths)

    def to_json(self) -> dict[str, object]:
        return {"source": self.source, "missing": list(self.missing), "mean_response_tokens": self.mean_response,
                "prompt_tokens": self.prompt_tokens, "decode_tokens_per_s": [list(p) for p in self.decode.points],
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "logprob_tokens_per_s": self.logprob_tokens_per_s, "train_tokens_per_s": self.train_tokens_per_s,
                "optimizer_step_s": self.optimizer_step_s, "weight_sync_s": self.weight_sync_s,
                "collective_s": self.collective_s, "tp_hop_s": self.tp_hop, "call_s": self.call_s,
                "step_gap_s": self.step_gap_s, "decode_call_s": self.decode_call_s,
                "co_run_slowdown": self.co_run_slowdown, "phase_call_s": self.phase_call,
                "logprob_handoff_s": self.logprob_handoff_s, "share_s": self.share_s,
                "logprob_pass_s": self.logprob_pass_s, "train_pass_s": self.train_pass_s,
                "reward_s_per_sample": self.reward_s_per_sample, "switch_s": self.switch_s,
                "launch_s": self.launch_s}


@dataclass(frozen=True)
class GpuSpec:
    """What the default costs read of a GPU: dense bf16 FLOP/s, memory bandwidth, the link a broadcast crosses and
    the host link an offload crosses (bytes/s), memory, and one hop of a small collective between GPUs (s)."""

    flops: float
    memory_bw: float
    link_bw: float
    host_bw: float
    memory_bytes: float
    collective_s: float = 2e-5  # NCCL within a node, of the usual order


GPUS = {
    "H100": GpuSpec(989e12, 3.35e12, 50e9, 25e9, 80e9),
    "H200": GpuSpec(989e12, 4.8e12, 50e9, 25e9, 141e9),
    "A100": GpuSpec(312e12, 2.0e12, 25e9, 16e9, 80e9),
    # A virtual GPU of a CPU machine: a share of a few cores (all virtual GPUs share them; see docs/planning.md).
    "cpu": GpuSpec(50e9, 10e9, 5e9, 10e9, 80e9, collective_s=1e-3),  # (gloo between processes: a thread's wake-up)
}
# Model FLOP utilisation of each pass, and of the memory bandwidth while decoding; guesses of the usual order.
PREFILL_MFU, FORWARD_MFU, TRAIN_MFU, DECODE_MFU, DECODE_BW_UTIL = 0.5, 0.4, 0.35, 0.3, 0.6
REWARD_S_PER_SAMPLE = 0.005  # a math-verify check of one answer
LAUNCH_S = 120.0
CALL_S = 2e-3  # a Ray actor call's round trip between processes of one cluster
STEP_GAP_S = 5e-3  # the driver's bookkeeping between steps (metrics, progress)
# Collectives among the data-parallel ranks at every optimizer step: the replicas' vote, the gradients' sum and the
# step's metrics (an all-gather of their sizes, then of them).
OPTIMIZER_COLLECTIVES = 4
OBJECT_STORE_BW = 2e9  # bytes/s through Ray's object store (a copy in and a copy out through host memory)
CONCURRENCY_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LENGTH_SAMPLES = 64


def reduce_hops(ranks: int) -> int:
    """The hops of an optimizer step's data-parallel collectives over `ranks` ranks: `OPTIMIZER_COLLECTIVES` of
    `2 x ceil(log2 ranks)` each (none for one rank)."""
    return OPTIMIZER_COLLECTIVES * 2 * math.ceil(math.log2(ranks)) if ranks > 1 else 0


def shares_prompts(cfg: Config) -> bool:
    """Whether the actor's and the log-prob workers' passes run each group's prompt once (packed rows sharing it,
    `actor.share_prompts`)."""
    return cfg.actor.pack_sequences and cfg.actor.share_prompts


def logprob_passes(cfg: Config) -> int:
    """Forward passes of a log-prob stage per sample: the old log-probs where recomputed, the reference's; at least
    one (the rate of a stage the config does not run is that of one pass)."""
    from rlinf_pipe.algorithms.logprob_needs import needs_ref, recomputes_old

    return max(int(recomputes_old(cfg)) + int(needs_ref(cfg)), 1)


def pass_tokens(response_tokens: float, prompt_tokens: float, group_size: int, shared: bool) -> float:
    """The tokens a pass runs for whole groups of rows whose prompts hold `prompt_tokens` in all: the responses,
    and each group's prompt once where `shared`, every row's otherwise. Rates count these tokens."""
    return response_tokens + (prompt_tokens / group_size if shared else prompt_tokens)


def cut_at(costs: Costs, longest: int) -> Costs:
    """`costs` with its response lengths cut at `longest` (a config's `rollout.max_new_tokens`)."""
    return replace(costs, response_lengths=tuple(min(n, longest) for n in costs.response_lengths))


def gpu_spec(gpu: str) -> GpuSpec:
    from rlinf_pipe.errors import ConfigError

    if gpu not in GPUS:
        raise ConfigError(f"--gpu {gpu!r}: not a GPU the planner knows; use one of {', '.join(GPUS)}")
    return GPUS[gpu]


def default_lengths(max_new_tokens: int, mean_fraction: float = 0.45) -> tuple[int, ...]:
    """`LENGTH_SAMPLES` response lengths at evenly spaced quantiles of `max_new_tokens x min(1, mean_fraction x
    Exp(1))`: a long tail, with about e^(-1/mean_fraction) (11%) of the responses cut at the limit; mean about
    0.4 x max_new_tokens."""
    qs = [(i + 0.5) / LENGTH_SAMPLES for i in range(LENGTH_SAMPLES)]
    return tuple(max(1, round(max_new_tokens * min(1.0, -mean_fraction * math.log(1 - q)))) for q in qs)


def decode_curve(params: float, gpu: GpuSpec, context_tokens: float = 0.0, kv_bytes_per_token: float = 0.0) -> Curve:
    """An engine's decode tokens/s against its concurrent requests `c`: each decode step reads the weights once
    (`2 x params` bytes at `DECODE_BW_UTIL` of the bandwidth) and each request's KV cache (`context_tokens x
    kv_bytes_per_token`), and spends `2 x params` FLOPs per request (at `DECODE_MFU`): `c / max(memory time,
    compute time)`, bandwidth-bound at few requests, compute-bound at many."""
    points = []
    for c in CONCURRENCY_POINTS:
        memory = (2 * params + c * context_tokens * kv_bytes_per_token) / (gpu.memory_bw * DECODE_BW_UTIL)
        compute = c * 2 * params / (gpu.flops * DECODE_MFU)
        points.append((float(c), c / max(memory, compute)))
    return Curve(tuple(points))


def model_params(cfg: Config) -> tuple[float, float]:
    """The actor model's parameter count and its KV bytes per token (bf16), from its `config.json` (shipped copies
    of known models count); 1.5e9 and a Qwen2.5-1.5B-like 28 KiB when there is none to read."""
    from rlinf_pipe.models.arch import model_arch
    from rlinf_pipe.planning.model_sizes import kv_cache_bytes, num_params

    arch, _ = model_arch(cfg.actor.model_path)
    if arch is None:
        return 1.5e9, 28672.0
    return float(num_params(arch)), kv_cache_bytes(arch, 1, 1, 1)


def default_costs(cfg: Config, gpu: str = "H100", params: float | None = None) -> Costs:
    """Costs from the model's size `P` (parameters) and the GPU (`GPUS`), for replicas of one GPU:

    * decode: `decode_curve` (weights and KV cache read per step against 2P FLOPs per token);
    * prefill: `flops x PREFILL_MFU / 2P`; log-probs: `flops x FORWARD_MFU / 2P`; training (forward + backward):
      `flops x TRAIN_MFU / 6P` sequence tokens/s;
    * optimizer step: Adam reads and writes about 36 bytes per parameter (fp32 master, moments, gradient, the bf16
      copy) at the memory bandwidth; over DP, `Costs.reduce_s` of `4P` gradient bytes (fp32) at the link's
      bandwidth and `GpuSpec.collective_s` a hop;
    * a driver call `CALL_S`, the driver's work between steps `STEP_GAP_S`;
    * weight sync of `2P` bytes: broadcast over `link_bw`; ipc: a device copy at a quarter of the bandwidth; object
      store: `OBJECT_STORE_BW`;
    * phase switch: the actor's 18 bytes per parameter (bf16 weights, fp32 grads, master and moments) out and back
      over the host link; the engines' and log-prob workers' weights (2P) likewise;
    * response lengths: `default_lengths(rollout.max_new_tokens)`; prompts: half of `data.max_prompt_length`;
    * reward `REWARD_S_PER_SAMPLE` per sample, launch `LAUNCH_S`."""
    spec = gpu_spec(gpu)
    p, kv_per_token = (params, 28672.0) if params is not None else model_params(cfg)
    lengths = default_lengths(cfg.rollout.max_new_tokens)
    prompt = cfg.data.max_prompt_length / 2
    context = prompt + sum(lengths) / len(lengths) / 2
    weights = 2 * p
    return Costs(
        decode=decode_curve(p, spec, context, kv_per_token),
        prefill_tokens_per_s=spec.flops * PREFILL_MFU / (2 * p),
        response_lengths=lengths, prompt_tokens=prompt,
        logprob_tokens_per_s=spec.flops * FORWARD_MFU / (2 * p),
        train_tokens_per_s=spec.flops * TRAIN_MFU / (6 * p),
        optimizer_step_s=36 * p / spec.memory_bw, collective_s=spec.collective_s,
        collective_bytes_per_s=spec.link_bw, grad_bytes=4 * p, call_s=CALL_S, step_gap_s=STEP_GAP_S,
        weight_sync_s={"broadcast": weights / spec.link_bw, "ipc": weights / (spec.memory_bw / 4),
                       "object_store": weights / OBJECT_STORE_BW},
        reward_s_per_sample=REWARD_S_PER_SAMPLE,
        switch_s={"actor": 2 * 18 * p / spec.host_bw, "rollout": 2 * weights / spec.host_bw,
                  "inference": 2 * weights / spec.host_bw},
        launch_s=LAUNCH_S, source=f"{DEFAULT_SOURCE} ({gpu})")


def carried(costs: Costs, rollout: Parallel, logprob: Parallel, train: Parallel) -> Costs:
    """`costs` with its rates carried (`scale_rate`) to replicas of these sizes."""
    return replace(
        costs, decode=costs.decode.scaled(scale_rate(1.0, costs.rollout_parallel, rollout)),
        prefill_tokens_per_s=costs.prefill_rate(rollout), logprob_tokens_per_s=costs.logprob_rate(logprob),
        train_tokens_per_s=costs.train_rate(train), optimizer_step_s=costs.optimizer_s(train),
        rollout_parallel=rollout, logprob_parallel=logprob, train_parallel=train)
