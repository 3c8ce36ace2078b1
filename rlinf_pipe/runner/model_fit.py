"""The run's models checked against what runs them, before Ray starts (`rlinf-pipe plan` and `train`): a supported
family (`models.arch`), every parallel size one can be split by (Megatron's rules for the actor and the log-prob
workers, SGLang's for its engines), and the longest sample within the model's context. Reads only `config.json`
files (no torch)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.models.arch import SGLANG_SPARE_TOKENS, HfArch, UnsupportedModelError, megatron_size_problems, \
    model_arch, model_config, sglang_tp_problem
from rlinf_pipe.planning.run_plan import RunPlan


@dataclass(frozen=True)
class Split:
    """One component's split of a model: the config key of its model, the sizes' keys, and which rules apply."""

    component: str
    model_key: str
    model: str
    tp: int
    pp: int
    rules: str  # "megatron", "sglang" or "family" (only the model's family is checked)


def splits(cfg: Config, plan: RunPlan) -> Iterator[Split]:
    """The model splits the run starts: the actor's, the log-prob workers' when they run, the SGLang engines'."""
    yield Split("actor", "actor.model_path", cfg.actor.model_path, cfg.actor.tensor_parallel_size,
                cfg.actor.pipeline_parallel_size, "megatron")
    if plan.inference_workers:
        yield Split("inference", "actor.model_path", cfg.actor.model_path, cfg.inference.tensor_parallel_size,
                    cfg.inference.pipeline_parallel_size, "megatron")
    rollout_key = "rollout.model_path" if cfg.rollout.model_path else "actor.model_path"
    rollout_model = cfg.rollout.model_path or cfg.actor.model_path
    if cfg.rollout.backend == "sglang":
        yield Split("rollout", rollout_key, rollout_model, cfg.rollout.tensor_parallel_size, 1, "sglang")
    elif cfg.rollout.model_path:  # (the torch engine holds the whole model: only its family is checked)
        yield Split("rollout", rollout_key, rollout_model, 1, 1, "family")


def split_problems(split: Split, arch: HfArch) -> list[str]:
    """The rules `split` breaks, each beginning with the config key of the size that breaks it."""
    if split.rules == "family":
        return []
    if split.rules == "sglang":
        problem = sglang_tp_problem(arch, split.tp)
        return [f"{split.component}.{problem}"] if problem else []
    return [f"{split.component}.{problem}" for problem in megatron_size_problems(arch, split.tp, split.pp)]


def check_models(cfg: Config, plan: RunPlan) -> None:
    """Raise `ConfigError` naming the model key and file of a model no worker can run, or the size key of a split
    the model cannot take, with the rule and the sizes that would do. Models without a `config.json` to read here
    (a built-in model not built yet, a folder on another machine with no shipped copy) pass."""
    archs: dict[str, tuple[HfArch | None, str]] = {}
    for split in splits(cfg, plan):
        if split.model not in archs:
            try:
                archs[split.model] = model_arch(split.model)
            except UnsupportedModelError as exc:
                raise ConfigError(f"{split.model_key}: {exc}") from None
        arch, source = archs[split.model]
        problems = [] if arch is None else split_problems(split, arch)
        if problems:
            where = source.split(",")[0]
            raise ConfigError(f"{'; '.join(problems)} (model: {where})")


CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


def context_length(hf_config: Any) -> int:
    """A model's context in tokens as sglang 0.5.23 reads it from the HF config (`get_context_length`): the first of
    `CONTEXT_KEYS` it has, times a `rope_scaling` factor unless the scaling names its original length or is
    llama3's (whose `max_position_embeddings` is already the scaled one); 2048 when it has none of them."""
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    factor = scaling.get("factor", 1)
    if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
        factor = 1
    for key in CONTEXT_KEYS:
        if (value := getattr(hf_config, key, None)) is not None:
            return int(factor * value)
    return 2048


def check_context_length(cfg: Config, hf_config: Any, model: str) -> None:
    """The longest sample a run can make (the longest prompt it keeps and the longest response) must fit the
    model's context (`context_length`) less the tokens sglang keeps spare: beyond it SGLang silently shortens each
    request's max_new_tokens, while the torch engine and Megatron go on at positions the model never saw. A
    `ConfigError` names the keys."""
    context = context_length(hf_config)
    usable = context - SGLANG_SPARE_TOKENS
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if longest > usable:
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}) = {longest} tokens does not fit the context of {model} ({context} "
            f"tokens, from its config.json, of which SGLang keeps {SGLANG_SPARE_TOKENS} spare): lower one of them so "
            f"that the sum is at most {usable}"
        )


def check_context(cfg: Config, plan: RunPlan | None = None) -> None:
    """`check_context_length` for each of the run's models whose config.json can be read here."""
    for model in dict.fromkeys(m for m in (cfg.actor.model_path, cfg.rollout.model_path) if m):
        config, _ = model_config(model)
        if config is not None:
            check_context_length(cfg, config, model)
