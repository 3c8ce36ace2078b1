"""The all-reduces a tensor-parallel replica pays: per layer, Megatron's two in a forward (after attention and
after the MLP) and two more in a backward, and an SGLang engine's two per decode step (the torch engine runs its
model whole in one process: none), each a ring all-reduce of the activations (`tokens x hidden` values) over the
replica's `tp` ranks.

A profile's rates carry a replica's computing to other sizes (`costs.scale_rate`); the all-reduces are counted
apart because their latency does not shrink with the work: on CPU virtual GPUs, where gloo takes milliseconds a hop
(the profile's `collective_s`), a collocated TP-2 step of the tiny model measured 0.55-0.61 s against 0.22-0.24 s
for two data-parallel replicas, which the rates alone predicted at 0.16 s. A profile measured at TP > 1 already holds
its own all-reduces: only the difference to the target's is added (`extra_tp_s`). Counted only over slow links
(`SLOW_HOP_S`), with the hop a profile's weight broadcast measures: the TP-2 step above is then predicted at
0.53-0.56 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from rlinf_pipe.config.schema import Config
from rlinf_pipe.planning.costs import Costs

ALLREDUCES_PER_LAYER = {"train": 4, "logprob": 2, "decode": 2}  # a pass's (forward + backward), a forward's, a step's
# Counted only where a collective's hop costs at least this (gloo between CPU processes: milliseconds). On GPUs
# (NCCL, microseconds a hop; fused all-reduce kernels) `costs.TP_EFFICIENCY` stands for them, as before.
SLOW_HOP_S = 1e-4
ACTIVATION_BYTES = 2  # bytes per activation value sent (bf16; the latency term dominates where it is not)


@dataclass(frozen=True)
class TpShape:
    """What a replica's all-reduces depend on: the model's layers and hidden size (0 where unknown: no cost)."""

    layers: int = 0
    hidden: int = 0


def tp_shape(cfg: Config) -> TpShape:
    """The actor's model's layers and hidden size (its config.json), or an empty shape where it cannot be read."""
    return _shape_of(cfg.actor.model_path)


@lru_cache(maxsize=16)
def _shape_of(model_path: str) -> TpShape:  # (read once: a search simulates thousands of candidates)
    from rlinf_pipe.models.arch import model_arch

    arch, _ = model_arch(model_path)
    return TpShape(arch.num_layers, arch.hidden_size) if arch is not None else TpShape()


def allreduce_s(costs: Costs, tp: int, values: float, hop: float | None = None) -> float:
    """One ring all-reduce of `values` activations over `tp` ranks: `2 (tp - 1)` hops of `hop` (default
    `Costs.tp_hop`) and `2 (tp - 1) / tp` of the bytes at `collective_bytes_per_s`; 0 for one rank."""
    if tp <= 1:
        return 0.0
    hops = 2 * (tp - 1)
    return hops * (costs.tp_hop if hop is None else hop) + hops / tp * values * ACTIVATION_BYTES / \
        costs.collective_bytes_per_s


def extra_tp_s(costs: Costs, shape: TpShape, kind: str, tokens: float, tp: int, measured_tp: int,
               hop: float | None = None) -> float:
    """The all-reduce seconds of one `kind` pass (`ALLREDUCES_PER_LAYER`) over `tokens` at `tp`, less those at
    `measured_tp` that the profile's rate already holds (negative when the target has fewer); each hop `hop`, or
    `Costs.tp_hop` where that is a slow link's (`SLOW_HOP_S`; none counted otherwise)."""
    if hop is None and costs.tp_hop < SLOW_HOP_S:
        return 0.0
    per_layer = ALLREDUCES_PER_LAYER[kind] * shape.layers
    values = tokens * shape.hidden
    return per_layer * (allreduce_s(costs, tp, values, hop) - allreduce_s(costs, measured_tp, values, hop))


def extra_tp_hops(shape: TpShape, kind: str, tp: int, measured_tp: int) -> int:
    """The hops of `extra_tp_s`: how many more one `kind` pass at `tp` waits on than at `measured_tp`."""
    return ALLREDUCES_PER_LAYER[kind] * shape.layers * 2 * (max(tp, 1) - max(measured_tp, 1))
