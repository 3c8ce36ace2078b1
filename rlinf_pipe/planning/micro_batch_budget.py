"""`actor.micro_batch_tokens: auto`: the largest token budget per micro-batch with which the actor fits the memory
estimate (`planning.memory`), resolved once before a run starts (`rlinf_pipe.runner.run`) and shown by
`rlinf-pipe plan`; `plan --search` gives each candidate its own."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.run_plan import plan_run

MICRO_BATCH_STEP = 1024  # actor.micro_batch_tokens tried in steps of this many tokens
MAX_SAMPLES = 32  # the budget grows to at most this many whole samples


def smallest_micro_batch_tokens(cfg: Config) -> int:
    """The least budget `auto` may take: one whole sample (prompt and response at their limits), in whole steps of
    `MICRO_BATCH_STEP`."""
    sample = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    return -(-sample // MICRO_BATCH_STEP) * MICRO_BATCH_STEP


def largest_micro_batch_tokens(cfg: Config, arch: Any, capacity_bytes: int, dtype_bytes: int = 2) -> int | None:
    """The largest `actor.micro_batch_tokens` (a multiple of `MICRO_BATCH_STEP`, from one whole sample up to
    `MAX_SAMPLES` of them) with which `cfg`'s actor fits the memory estimate; None when not even one sample does."""
    from rlinf_pipe.planning.memory import estimate_memory

    plan = plan_run(cfg)
    step = MICRO_BATCH_STEP
    lo = smallest_micro_batch_tokens(cfg) // step  # (in steps)
    hi = MAX_SAMPLES * lo

    def fits(steps: int) -> bool:
        trial = replace(cfg, actor=replace(cfg.actor, micro_batch_tokens=steps * step))
        return estimate_memory(trial, plan, arch, capacity_bytes, dtype_bytes)["actor"].fits

    if not fits(lo):
        return None
    while lo < hi:  # (the actor's memory grows with its micro-batch: the largest that fits, by bisection)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * step


def resolve_micro_batch_tokens(cfg: Config) -> Config:
    """`cfg` with `actor.micro_batch_tokens: auto` replaced by the largest budget that fits (unchanged otherwise);
    a `ConfigError` when the model's size is unknown or not even one sample fits."""
    if cfg.actor.micro_batch_tokens != "auto":
        return cfg
    from rlinf_pipe.models.arch import hf_arch, model_config
    from rlinf_pipe.planning.memory import dtype_bytes_of, gpu_capacity_bytes

    config, source = model_config(cfg.actor.model_path)
    if config is None:
        raise ConfigError(f"actor.micro_batch_tokens=auto sizes the micro-batches by the memory estimate, which needs "
                          f"the model's config.json ({source}); set a number of tokens instead")
    capacity = gpu_capacity_bytes(cfg)
    fixed = replace(cfg, actor=replace(cfg.actor, micro_batch_tokens=None))
    tokens = largest_micro_batch_tokens(fixed, hf_arch(config), capacity, dtype_bytes_of(config))
    if tokens is None:
        sample = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
        raise ConfigError(
            f"actor.micro_batch_tokens=auto: not even one sample of {sample} tokens (data.max_prompt_length + "
            f"rollout.max_new_tokens) fits the actor's GPUs in the memory estimate ({capacity / 1e9:.0f} GB each, "
            "cluster.gpu_memory_gb); give the actor more GPUs per replica (tensor / context parallel), "
            "actor.recompute=full, or shorter samples (`rlinf-pipe plan` shows the estimate)")
    return replace(cfg, actor=replace(cfg.actor, micro_batch_tokens=tokens))
