"""The one validation pass over a typed `Config`: bounds, cross-field rules, derived values, placement."""

from __future__ import annotations

import dataclasses
from typing import Callable

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError


def validate_config(cfg: Config, source_of: Callable[[str], str] = lambda _: "the config") -> None:
    """Reject bad values with a message naming the key; fill derived values in place."""
    _check_bounds(cfg, source_of)

    per_node = cfg.cluster.num_gpus_per_node
    if isinstance(per_node, list) and len(per_node) != cfg.cluster.num_nodes:
        raise ConfigError(
            f"cluster.num_gpus_per_node: the list has {len(per_node)} entries but cluster.num_nodes is "
            f"{cfg.cluster.num_nodes} (from {source_of('cluster.num_gpus_per_node')}); give one GPU count per "
            "node, or a single number when all nodes are alike"
        )
    if cfg.runner.max_staleness > 1:
        raise ConfigError(
            f"runner.max_staleness: {cfg.runner.max_staleness} is not supported (from "
            f"{source_of('runner.max_staleness')}); use 0 (exact, default) or 1 (rollout one step ahead)"
        )
    if cfg.algorithm.clip_ratio_low >= 1:
        raise ConfigError(
            f"algorithm.clip_ratio_low: {cfg.algorithm.clip_ratio_low} must be below 1 (the ratio is clipped to "
            f"[1 - low, 1 + high]) (from {source_of('algorithm.clip_ratio_low')})"
        )
    samples = cfg.data.rollout_batch_size * cfg.algorithm.group_size
    if samples % cfg.algorithm.n_minibatches:
        raise ConfigError(
            f"algorithm.n_minibatches: {cfg.algorithm.n_minibatches} does not divide the {samples} samples of a "
            f"step (data.rollout_batch_size={cfg.data.rollout_batch_size} x algorithm.group_size="
            f"{cfg.algorithm.group_size}); choose a divisor of {samples}"
        )

    if cfg.rollout.model_path is None:
        cfg.rollout.model_path = cfg.actor.model_path

    from rlinf_pipe.scheduler.placement import plan_placement

    plan_placement(cfg)


def _check_bounds(cfg: Config, source_of: Callable[[str], str]) -> None:
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            low = f.metadata.get("min")
            value = getattr(values, f.name)
            if low is None or value is None:
                continue
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, (int, float)) and item < low:
                    key = f"{section.name}.{f.name}"
                    raise ConfigError(f"{key}: must be >= {low:g}, got {item!r} (from {source_of(key)})")
