"""The checks a run passes before Ray starts, the same for `rlinf-pipe train` and `rlinf-pipe plan`: its plan
(placement, algorithm, transports: `plan_run`), its model names (a built-in one or a folder with config.json), its
models' families, parallel sizes and context (`model_fit`), its data settings (the arithmetic generator's knobs, a
format template), its dataset files (present, readable by suffix), its reward function file (imported here) and
the checkpoint it resumes from
(`checkpoints.check_resume`). `plan --no-files` skips those that read the user's files, to plan a cluster from a
machine without them. Light to import (no model code)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.factory import ARITHMETIC, check_data_files
from rlinf_pipe.engines.reward.registry import check_reward, check_reward_type
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.models.resolve import check_model_name
from rlinf_pipe.runner import checkpoints
from rlinf_pipe.runner.model_fit import check_context, check_models
from rlinf_pipe.planning.run_plan import RunPlan, plan_run


@dataclass(frozen=True)
class Preflight:
    """A run's plan, the checkpoint it resumes from (None: a fresh start), and what was checked (`CHECKS`' names;
    `skipped`: those `files=False` left out)."""

    plan: RunPlan
    resume_from: Path | None
    passed: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()


def preflight(cfg: Config, files: bool = True) -> Preflight:
    """Run every check (those reading the user's files only with `files`); raise a `PlacementError`,
    `ConfigError`, `DataError` or `CheckpointError` naming what cannot run and how to fix it."""
    plan = plan_run(cfg)
    if cfg.reward.function is None:
        check_reward_type(cfg.reward.reward_type)
    results: dict[str, object] = {"placement and algorithm": None}
    skipped = []
    for name, reads_files, check in CHECKS:
        if reads_files and not files:
            skipped.append(name)
            continue
        results[name] = check(cfg, plan)
    resume_from = results.get(RESUME)
    return Preflight(plan, resume_from if isinstance(resume_from, Path) else None, tuple(results), tuple(skipped))


def check_model_names(cfg: Config, plan: RunPlan | None = None) -> None:
    """A `ConfigError` naming the key of a model that is neither a built-in name nor a folder with config.json
    (found here in a second, where building the run's inputs finds it only once Ray has started)."""
    for key, name in (("actor.model_path", cfg.actor.model_path), ("rollout.model_path", cfg.rollout.model_path)):
        if name is None:
            continue
        try:
            check_model_name(name)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None


def check_data_settings(cfg: Config, plan: RunPlan | None = None) -> None:
    """The arithmetic generator's knobs (when a prompt set is generated) and a format template, as the dataset
    checks them when the driver builds it (a `DataError` / `TemplateError` naming the key)."""
    from rlinf_pipe.data.arithmetic import ArithmeticSpec
    from rlinf_pipe.data.templates import CHAT, check_format_template

    if ARITHMETIC in (cfg.data.dataset, cfg.data.val_dataset):
        knobs = cfg.data.arithmetic
        ArithmeticSpec(knobs.min_value, knobs.max_value, knobs.num_operands, tuple(knobs.operators), knobs.size)
    if cfg.data.template != CHAT:
        check_format_template(cfg.data.template)


def _reward_function(cfg: Config, plan: RunPlan) -> None:
    """A `reward.function` file imports here and its NAME takes verl's arguments (`check_reward`)."""
    if cfg.reward.function is not None:
        check_reward(cfg.reward)


def _data_files(cfg: Config, plan: RunPlan) -> None:
    check_data_files(cfg.data, validates=bool(cfg.runner.val_interval or cfg.runner.val_before_train))


RESUME = "resume checkpoint"
CHECKS: tuple[tuple[str, bool, Callable[[Config, RunPlan], object]], ...] = (
    ("model names", True, check_model_names),
    ("models' families and parallel sizes", False, check_models),
    ("prompt and response lengths in the model's context", False, check_context),
    ("data settings", False, check_data_settings),
    ("dataset files", True, _data_files),
    ("reward function", True, _reward_function),
    (RESUME, True, lambda cfg, plan: checkpoints.check_resume(cfg)),  # (the checkpoint, or None)
)
"""(name, whether it reads the user's files, the check) in the order they run."""
