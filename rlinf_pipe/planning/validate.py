"""`validate_run`: a run's own placement predicted beside what it measured (step time, device bubble, tokens/s)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.costs import Costs
from rlinf_pipe.planning.profile import after_warmup, read_run_config, step_cadence
from rlinf_pipe.planning.run_plan import plan_run
from rlinf_pipe.planning.simulate import Prediction, simulate


@dataclass(frozen=True)
class Validation:
    """The prediction of a run's placement and the run's measured means over its steps (the first `warmup` left out
    when there are more): its step time is the wall time from the first measured step's start to the last one's
    end over their count, the driver's work between steps included, as the prediction counts it."""

    run_dir: str
    prediction: Prediction
    measured_step_s: float
    measured_bubble: float
    measured_tokens_per_s: float
    steps: int

    @property
    def error(self) -> float:
        """(predicted - measured) / measured step time."""
        return (self.prediction.step_s - self.measured_step_s) / self.measured_step_s

    def to_json(self) -> dict[str, object]:
        return {"run_dir": self.run_dir, **self.prediction.to_json(), "measured_step_s": self.measured_step_s,
                "measured_bubble": self.measured_bubble, "measured_tokens_per_s": self.measured_tokens_per_s,
                "steps": self.steps, "error": self.error}


def validate_run(run_dir: str | Path, costs: Costs, warmup: int = 1) -> Validation:
    """Predict `run_dir`'s placement from `costs` and read what the run measured (`utils.timeline.analyse`) over
    its steps after the first `warmup` (at least the last step)."""
    from rlinf_pipe.utils.metrics import read_metrics
    from rlinf_pipe.utils.timeline import analyse, read_chrome_trace

    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    if not (run_dir / "timeline.json").is_file():
        raise ConfigError(f"{run_dir}/timeline.json does not exist; --validate needs a run that trained a step")
    trace = read_chrome_trace(run_dir / "timeline.json")
    steps = analyse(trace)
    if not steps:
        raise ConfigError(f"{run_dir}/timeline.json holds no step; --validate needs a run that trained a step")
    kept = after_warmup(steps, warmup)
    numbers = {a.step for a in kept}
    metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    rates = [m["throughput/tokens_per_s"] for m in metrics
             if m.get("step") in numbers and m.get("throughput/tokens_per_s") is not None]
    total = sum(a.duration for a in kept)
    return Validation(str(run_dir), simulate(cfg, plan_run(cfg), costs), step_cadence(trace, warmup),
                      sum(a.bubble_fraction * a.duration for a in kept) / total,
                      statistics.fmean(rates) if rates else 0.0, len(kept))
