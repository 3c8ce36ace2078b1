"""The validation pass over a typed `Config`: bounds, cross-field rules, derived values. What depends on the
placement (which the scheduler plans) is checked by `rlinf_pipe.planning.run_plan.plan_run`."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Callable

from rlinf_pipe.config.function_ref import absolute_function_ref
from rlinf_pipe.config.schema import COMPONENTS, ActorConfig, Config
from rlinf_pipe.errors import ConfigError


MAX_GPUS_PER_NODE = 1024
MAX_GPUS = 65536


def validate_config(cfg: Config, source_of: Callable[[str], str] = lambda _: "the config") -> None:
    """Reject bad values with a message naming the key; fill derived values in place."""
    _check_bounds(cfg, source_of)

    per_node = cfg.cluster.num_gpus_per_node
    if cfg.cluster.num_nodes > MAX_GPUS:
        raise ConfigError(
            f"cluster.num_nodes: {cfg.cluster.num_nodes} (from {source_of('cluster.num_nodes')}) is beyond any cluster "
            f"this supports ({MAX_GPUS} GPUs in all); give the number of Ray nodes the job runs on"
        )
    if isinstance(per_node, list) and len(per_node) != cfg.cluster.num_nodes:
        raise ConfigError(
            f"cluster.num_gpus_per_node: the list has {len(per_node)} entries but cluster.num_nodes is "
            f"{cfg.cluster.num_nodes} (from {source_of('cluster.num_gpus_per_node')}); give one GPU count per "
            "node, or a single number when all nodes are alike"
        )
    counts = per_node if isinstance(per_node, list) else [per_node] * cfg.cluster.num_nodes
    if max(counts) > MAX_GPUS_PER_NODE or sum(counts) > MAX_GPUS:
        raise ConfigError(
            f"cluster.num_gpus_per_node: {max(counts)} GPUs on a node, {sum(counts)} in all (from "
            f"{source_of('cluster.num_gpus_per_node')}): at most {MAX_GPUS_PER_NODE} per node and {MAX_GPUS} in all "
            "are supported; give each node's real GPU count"
        )
    outside = [s for s in cfg.runner.profile_steps if not 0 <= s < cfg.runner.max_steps]
    if outside:
        raise ConfigError(
            f"runner.profile_steps: step(s) {outside} (from {source_of('runner.profile_steps')}) are not steps of this "
            f"run; steps count from 0 to runner.max_steps - 1 = {cfg.runner.max_steps - 1}"
        )
    unknown = [name for name in cfg.runner.nsight if name not in COMPONENTS]
    if unknown:
        raise ConfigError(
            f"runner.nsight: {unknown} (from {source_of('runner.nsight')}) are not components; name some of "
            f"{', '.join(COMPONENTS)}"
        )
    if cfg.algorithm.clip_ratio_low >= 1:
        raise ConfigError(
            f"algorithm.clip_ratio_low: {cfg.algorithm.clip_ratio_low} must be below 1 (the ratio is clipped to "
            f"[1 - low, 1 + high]) (from {source_of('algorithm.clip_ratio_low')})"
        )
    if cfg.algorithm.dual_clip_c is not None and cfg.algorithm.dual_clip_c <= 1:
        raise ConfigError(
            f"algorithm.dual_clip_c: {cfg.algorithm.dual_clip_c} must be > 1, or null to disable the dual clip "
            f"(from {source_of('algorithm.dual_clip_c')})"
        )
    if cfg.rollout.top_k == 0:
        raise ConfigError(
            f"rollout.top_k: 0 would sample from no token (from {source_of('rollout.top_k')}); use -1 (off) or a "
            "number of tokens >= 1"
        )
    _check_ray_address(cfg.cluster.ray_address, source_of("cluster.ray_address"))
    for name, section in (("actor", cfg.actor), ("inference", cfg.inference)):
        if section.sequence_parallel and section.tensor_parallel_size < 2:
            raise ConfigError(
                f"{name}.sequence_parallel: true splits each layer's sequence over the tensor-parallel ranks, but "
                f"{name}.tensor_parallel_size is {section.tensor_parallel_size} (from "
                f"{source_of(f'{name}.sequence_parallel')}); set {name}.tensor_parallel_size to 2 or more, or "
                f"{name}.sequence_parallel: false"
            )
        if section.context_parallel_size > 1 and not cfg.actor.pack_sequences:
            raise ConfigError(
                f"{name}.context_parallel_size: {section.context_parallel_size} splits packed sequences over the "
                f"context-parallel ranks, but actor.pack_sequences is false (from "
                f"{source_of('actor.pack_sequences')}); set actor.pack_sequences: true, or "
                f"{name}.context_parallel_size: 1"
            )
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(
            f"rollout.top_p: {cfg.rollout.top_p} must be in (0, 1] (the probability mass sampled from; 1 = off) "
            f"(from {source_of('rollout.top_p')})"
        )
    if cfg.runner.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"runner.wandb_project: {cfg.runner.wandb_project!r} needs the wandb package, which is not installed "
            f"(from {source_of('runner.wandb_project')}); `pip install wandb`, or leave runner.wandb_project null"
        )
    if cfg.reward.answer_pattern is not None:
        try:
            if re.compile(cfg.reward.answer_pattern).groups < 1:
                raise re.error("it has no capture group for the answer")
        except re.error as exc:
            raise ConfigError(
                f"reward.answer_pattern: {cfg.reward.answer_pattern!r} is not a usable regex: {exc} "
                f"(from {source_of('reward.answer_pattern')}); write e.g. '#### (.+)'"
            ) from None
    if cfg.reward.function is not None:  # (the file is checked before launch: `runner.preflight`)
        try:
            cfg.reward.function = absolute_function_ref(cfg.reward.function)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from {source_of('reward.function')})") from None
    if cfg.data.rollout_batch_size % cfg.algorithm.n_minibatches:
        raise ConfigError(
            f"algorithm.n_minibatches: {cfg.algorithm.n_minibatches} does not divide data.rollout_batch_size="
            f"{cfg.data.rollout_batch_size} (from {source_of('algorithm.n_minibatches')}); prompt groups stream as "
            f"units, so each mini-batch holds whole groups: choose a divisor of {cfg.data.rollout_batch_size}"
        )
    if cfg.algorithm.dynamic_sampling and cfg.runner.max_staleness:
        raise ConfigError(
            f"algorithm.dynamic_sampling: true cannot run with runner.max_staleness: {cfg.runner.max_staleness} (from "
            f"{source_of('algorithm.dynamic_sampling')}): a step's extra sampling rounds depend on its own rewards, "
            "so its rollout cannot run a step ahead; set one of them off"
        )
    if cfg.rollout.model_path is None:
        cfg.rollout.model_path = cfg.actor.model_path


ADDRESS = re.compile(r"(?:ray://)?(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+):(?P<port>[0-9]+)")


def _check_ray_address(address: str, source: str) -> None:
    """`auto`, `local`, or `HOST:PORT` / `ray://HOST:PORT` with a port Ray can listen on."""
    if address in ("auto", "local"):
        return
    match = ADDRESS.fullmatch(address)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        problem = "a port must be 1-65535" if match else "not `auto`, `local` or HOST:PORT"
        raise ConfigError(
            f"cluster.ray_address: {address!r} (from {source}): {problem}; give the head's address as printed by "
            "`ray start --head` or ray_utils/start_ray.sh (e.g. 10.0.0.1:6379), `auto` or `local`"
        )


def bound_text(value: float) -> str:
    """A bound as written: 2**63 as `2**63`, whole numbers whole, others in `%g`."""
    if value == 2**63:
        return "2**63"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _check_bounds(section: object, source_of: Callable[[str], str], prefix: str = "") -> None:
    """Every field's `min` and `below` bounds, recursing into nested sections (e.g. data.arithmetic)."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_bounds(value, source_of, f"{key}.")
            continue
        low, high = f.metadata.get("min"), f.metadata.get("below")
        if value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, (int, float)):
                continue
            if low is not None and item < low:
                raise ConfigError(f"{key}: must be >= {bound_text(low)}, got {item!r} (from {source_of(key)})")
            if high is not None and item >= high:
                raise ConfigError(f"{key}: must be < {bound_text(high)}, got {item!r} (from {source_of(key)})")


def token_budget(actor: ActorConfig) -> int | None:
    """`actor.micro_batch_tokens` once `auto` was resolved (`planning.micro_batch_budget`, before the run starts)."""
    if actor.micro_batch_tokens == "auto":
        raise ConfigError("actor.micro_batch_tokens=auto was not resolved before this use (resolve it with "
                          "rlinf_pipe.planning.micro_batch_budget.resolve_micro_batch_tokens)")
    return actor.micro_batch_tokens
