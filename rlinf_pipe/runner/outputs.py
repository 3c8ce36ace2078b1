"""What a run reports: one step's metrics (from its outcome and its spans), the timeline and curve pictures, and
the end-of-run summary."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlinf_pipe.algorithms.scoring import RewardTally
from rlinf_pipe.runner.run_dir import read_events
from rlinf_pipe.runner.steps import StepOutcome
from rlinf_pipe.utils.launch_timeline import analyse_launch
from rlinf_pipe.utils.metrics import max_over_mean, read_metrics
from rlinf_pipe.utils.profiling import align_profiles
from rlinf_pipe.utils.timeline import (
    STEP_SPAN,
    analyse,
    analyse_step,
    read_chrome_trace,
    render_curve_png,
    render_timeline_png,
    summarise,
    write_chrome_trace,
)
from rlinf_pipe.utils.tracing import Span

log = logging.getLogger(__name__)


def step_metrics(outcome: StepOutcome, spans: list[Span], driver_data_bytes: int) -> dict[str, float]:
    """metrics.jsonl's object of one step: rewards, loss, timings from the spans, throughput, pipeline shape."""
    step_span = next(s for s in spans if s.name == STEP_SPAN)
    analysis = analyse_step(spans, step_span)
    tally = RewardTally()
    for t in outcome.generation.tallies:
        tally = tally.merge(t)

    def stage_time(name: str) -> float:  # wall time during which some worker ran this stage
        return analysis.stage_busy.get(name, 0.0) * analysis.duration

    replica0 = outcome.train[0] if outcome.train else None
    steps = [m for m in (replica0.optimizer_steps if replica0 else []) if m is not None]
    last = steps[-1] if steps else {}
    metrics: dict[str, float] = {
        **tally.metrics(),
        **outcome.generation.sampling,
        "loss": last.get("loss", math.nan),
        "grad_norm": last.get("grad_norm", math.nan),
        "lr": last.get("lr", math.nan),
        **({"kl": last["loss/kl"]} if "loss/kl" in last else {}),  # with reference log-probs only
        "timing/step": analysis.duration,
        "timing/rollout": stage_time("generate"),
        "timing/reward": stage_time("reward"),
        "timing/inference": stage_time("logprob"),
        "timing/train": stage_time("train"),
        # (collocated over a group transport, the step moves the next version at the end of its actor phase; the
        # last step moves none)
        "timing/weight_sync": sum(s.duration for s in spans if s.name == "weight_sync" and s.track == "driver"),
        "timing/publish_weights": sum(s.duration for s in spans if s.name == "publish_weights"),
        "weight_sync/bytes": outcome.sync["bytes"],
        "throughput/tokens_per_s": tally.response_tokens / analysis.duration,
        "pipeline/bubble_fraction": analysis.bubble_fraction,
        "pipeline/scheduler_overhead_fraction": analysis.scheduler_overhead_fraction,
        "optimizer_steps": float(len(steps)),
        "driver/data_bytes": float(driver_data_bytes),
        "actor/train_data_bytes": float(sum(r.data_bytes for r in outcome.train)),
        "actor/replica_tokens_max_over_mean": max_over_mean([r.tokens for r in outcome.train]),
    }
    for key, value in last.items():
        if key not in ("loss", "grad_norm", "lr") and isinstance(value, (int, float)):
            metrics.setdefault(f"actor/{key}", float(value))
    for name, frac in analysis.stage_busy.items():
        metrics[f"busy/{name}"] = frac
    return metrics


def training_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics.jsonl rows of training steps (the row after the last step may hold only a validation)."""
    return [r for r in records if "timing/step" in r]


def validation_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics.jsonl rows that carry a validation (`runner.val_interval`)."""
    return [r for r in records if "val/pass@1" in r]


def write_pictures(spans: list[Span], run_dir: Path, title: str) -> None:
    """timeline.json and timeline.png from the run's spans; reward.png from metrics.jsonl."""
    if not spans:
        return
    write_chrome_trace(spans, run_dir / "timeline.json")
    align_profiles(run_dir)  # `runner.profile_steps`' traces onto the timeline's origin
    render_timeline_png(spans, run_dir / "timeline.png", title=title)
    path = run_dir / "metrics.jsonl"
    records = read_metrics(path) if path.exists() else []
    trained = training_rows(records)
    if trained:
        series: dict[str, tuple[Sequence[int], Sequence[float]]] = {
            k: ([r["step"] for r in trained], [r.get(k) or 0.0 for r in trained])
                  for k in ("reward/mean", "reward/accuracy")}
        validated = validation_rows(records)
        for key in ("val/pass@1", "val/pass@k"):
            if validated:
                series[key] = ([r["step"] for r in validated], [r[key] for r in validated])
        render_curve_png(series, run_dir / "reward.png", title="reward")


def previous_spans(run_dir: Path) -> list[Span]:
    """The spans of earlier runs in this run folder (a resume continues the folder's timeline); an unreadable
    timeline.json is set aside as `timeline.json.unreadable` with a warning."""
    path = run_dir / "timeline.json"
    if not path.exists():
        return []
    try:
        return read_chrome_trace(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s is unreadable (%s: %s); it is kept as %s.unreadable and the timeline starts again", path,
                    type(exc).__name__, exc, path.name)
        path.replace(path.with_name(path.name + ".unreadable"))
        return []


def run_summary(run_dir: Path, spans: list[Span]) -> dict[str, Any]:
    """summary.json: learning (first vs last quarter of the steps), speed, where the time went (the launch's
    included), and the run's restarts, resumes and stops (`events.jsonl`)."""
    everything = read_metrics(run_dir / "metrics.jsonl")
    records, validated = training_rows(everything), validation_rows(everything)
    head, tail = records[: max(1, len(records) // 4)], records[-max(1, len(records) // 4):]

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else math.nan

    return {
        "run_dir": str(run_dir),
        "steps": len(records),
        "reward_first": mean(head, "reward/mean"),
        "reward_last": mean(tail, "reward/mean"),
        "accuracy_first": mean(head, "reward/accuracy"),
        "accuracy_last": mean(tail, "reward/accuracy"),
        "mean_step_s": mean(records, "timing/step"),
        "tokens_per_s": mean(records, "throughput/tokens_per_s"),
        "validation": [{"step": r["step"], "pass@1": r["val/pass@1"], "pass@k": r["val/pass@k"], "k": r["val/k"]}
                       for r in validated],
        "timeline": summarise(analyse(spans)) if spans else {},
        "launch": analyse_launch(spans),
        "events": read_events(run_dir),
    }
