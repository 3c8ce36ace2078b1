"""What the driver does before it launches the workers: the run's preflight checks, warnings (placement, memory
estimate), its folder, the model folders and prompts. `rlinf_pipe.runner.run` does it while Ray starts."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rlinf_pipe.config.schema import Config
from rlinf_pipe.runner.driver_inputs import DriverInputs, driver_inputs
from rlinf_pipe.runner.preflight import Preflight, preflight
from rlinf_pipe.runner.run_dir import open_run_dir, write_config
from rlinf_pipe.planning.memory import memory_report

log = logging.getLogger(__name__)


@dataclass
class PreparedRun:
    """A run checked and ready to launch: its folder, the checkpoint it resumes from, the driver's inputs."""

    run_dir: Path
    resume_from: Path | None
    inputs: DriverInputs


def prepare_run(cfg: Config, checked: Preflight | None = None) -> PreparedRun:
    """Check the run (`preflight`, unless `checked` is its result), warn (a memory estimate that does not fit names
    the keys to change), open the run folder, read the driver's inputs."""
    checked = checked or preflight(cfg)
    for warning in checked.plan.warnings:
        log.warning("placement: %s (rlinf-pipe plan shows the placement; docs/placement.md)", warning)
    for warning in memory_report(cfg, checked.plan).warnings():
        log.warning("memory estimate: %s (rlinf-pipe plan shows the estimate; docs/memory.md)", warning)
    run_dir = open_run_dir(cfg, checked.resume_from)
    write_config(cfg, run_dir)
    return PreparedRun(run_dir, checked.resume_from, driver_inputs(cfg))
