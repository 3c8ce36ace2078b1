"""Where per-step metrics go: `metrics.jsonl` always, tensorboard events, and wandb when asked.

`MetricsWriter(run_dir, tensorboard=True, wandb=None)`; `write(step, metrics)`; `close()`.
wandb is imported only when a project is given, so a run without it needs neither the package nor a network.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def max_over_mean(values: list[int] | list[float]) -> float:
    """The largest of `values` over their mean (1.0: even; e.g. the actor replicas' tokens, whose busiest sets the
    optimizer steps' pace), 1.0 when there is nothing to compare."""
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN / inf
    return value


def json_safe(value: Any) -> Any:
    """`value` with every NaN / inf float (at any depth of dicts and lists) replaced by None: valid JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return _clean(value)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The objects of a `metrics.jsonl`, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class WandbRun:
    """Where a run's metrics go in wandb: its project, entity (team or user; None: the login's default), run name and
    tags (`runner.wandb_*`)."""

    project: str
    entity: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = ()


class MetricsWriter:
    """Appends one JSON object per step to `<run_dir>/metrics.jsonl` and mirrors scalars to the other sinks."""

    def __init__(
        self, run_dir: str | Path, *, tensorboard: bool = True, wandb_run: WandbRun | None = None,
        config: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._wandb = None
        if wandb_run is not None:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError(
                    "runner.wandb_project is set but wandb is not installed: `pip install wandb`, or unset it"
                ) from exc
            self._wandb = wandb.init(project=wandb_run.project, entity=wandb_run.entity, name=wandb_run.name,
                                     tags=list(wandb_run.tags) or None, config=config, dir=str(self.run_dir))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def truncate(self, before_step: int) -> None:
        """Drop the metrics.jsonl records of steps >= `before_step` (steps a restart or resume trains again).
        Tensorboard and wandb keep theirs: they show a redone step twice."""
        self._file.close()
        kept = [r for r in read_metrics(self.path) if r["step"] < before_step] if self.path.exists() else []
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)
        self._file = self.path.open("a")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
