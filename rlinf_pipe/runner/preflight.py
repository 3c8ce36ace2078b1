"""The checks a run passes before Ray starts: its plan (placement, algorithm, transports: `plan_run`), its model
names (a built-in one or a folder with config.json), its models' families and parallel sizes (`model_fit`), its
dataset files (present, readable by suffix) and the
checkpoint it resumes from (`checkpoints.check_resume`). Light to import (no model code)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.factory import check_data_files
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.models.resolve import check_model_name
from rlinf_pipe.runner import checkpoints
from rlinf_pipe.runner.model_fit import check_models
from rlinf_pipe.runner.plan import RunPlan, plan_run


@dataclass(frozen=True)
class Preflight:
    """A run's plan and the checkpoint it resumes from (None: a fresh start)."""

    plan: RunPlan
    resume_from: Path | None


def preflight(cfg: Config) -> Preflight:
    """Raise a `PlacementError`, `ConfigError`, `DataError` or `CheckpointError` naming what cannot run and how to
    fix it."""
    plan = plan_run(cfg)
    check_model_names(cfg)
    check_models(cfg, plan)
    check_data_files(cfg.data, validates=bool(cfg.runner.val_interval or cfg.runner.val_before_train))
    return Preflight(plan, checkpoints.check_resume(cfg))


def check_model_names(cfg: Config) -> None:
    """A `ConfigError` naming the key of a model that is neither a built-in name nor a folder with config.json
    (found here in a second, where building the run's inputs finds it only once Ray has started)."""
    for key, name in (("actor.model_path", cfg.actor.model_path), ("rollout.model_path", cfg.rollout.model_path)):
        if name is None:
            continue
        try:
            check_model_name(name)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None
