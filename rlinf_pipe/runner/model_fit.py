"""The run's models checked against what runs them, before Ray starts (`rlinf-pipe plan` and `train`): a supported
family (`models.arch`), and every parallel size one can be split by: Megatron's rules for the actor and the log-prob
workers, SGLang's for its engines. Reads only `config.json` files (no torch)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.models.arch import HfArch, UnsupportedModelError, megatron_size_problems, model_arch, \
    sglang_tp_problem
from rlinf_pipe.runner.plan import RunPlan


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
