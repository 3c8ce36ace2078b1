"""The checks a run passes before Ray starts: its plan (placement, algorithm, transports: `plan_run`), its dataset
files (present, readable by suffix) and the checkpoint it resumes from (`checkpoints.check_resume`). Light to
import (no model code)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.factory import check_data_files
from rlinf_pipe.runner import checkpoints
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
    check_data_files(cfg.data, validates=bool(cfg.runner.val_interval or cfg.runner.val_before_train))
    return Preflight(plan, checkpoints.check_resume(cfg))
