"""The run's timeline: Chrome trace output, busy / bubble analysis and the picture.

`write_chrome_trace(spans, path)` writes `timeline.json` (opens in Perfetto or chrome://tracing: one process
per component, one thread per worker). `analyse(spans)` computes, per step and over the run:

- busy fraction of each stage (span name) and each worker track: time covered by its spans / step time;
- device bubble fraction: 1 - (sum over used devices of the time some span occupied the device) /
  (number of used devices x step time) -- the share of device time nobody used;
- scheduler overhead: the share of step time during which no worker ran any span (pure orchestration).

`render_timeline_png(spans, path)` draws one row per worker with one colour per stage.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlinf_pipe.utils.intervals import IntervalUnion
from rlinf_pipe.utils.tracing import LAUNCH_SPAN, STEP_SPAN, Span


def _is_step_work(span: Span) -> bool:
    """Whether a span counts in the figures of the step it falls in (not the step's own, not a launch's)."""
    return span.name not in (STEP_SPAN, LAUNCH_SPAN)


def _union_length(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of intervals clipped to [lo, hi]."""
    return IntervalUnion(intervals).covered(lo, hi)


def overlaps(spans: Sequence[Span]) -> list[tuple[Span, Span]]:
    """Pairs of spans of DIFFERENT tracks that occupy a common device at the same time."""
    by_device: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        for d in s.devices:
            by_device[d].append(s)
    found = []
    for device_spans in by_device.values():
        device_spans.sort(key=lambda s: s.start)
        for i, a in enumerate(device_spans):
            for b in device_spans[i + 1 :]:
                if b.start >= a.end:
                    break
                if a.track.split("/")[0] != b.track.split("/")[0]:
                    found.append((a, b))
    return found


@dataclass
class StepAnalysis:
    """Where one step's time went (fractions of `duration`)."""

    step: int
    duration: float
    stage_busy: dict[str, float] = field(default_factory=dict)
    track_busy: dict[str, float] = field(default_factory=dict)
    bubble_fraction: float = 0.0
    scheduler_overhead_fraction: float = 0.0


@dataclass(frozen=True)
class _RunNames:
    """Every stage, track and device of the spans a step is analysed among (each step reports all of them)."""

    stages: tuple[str, ...]
    tracks: tuple[str, ...]
    devices: frozenset[int]

    @classmethod
    def of(cls, work: Sequence[Span]) -> _RunNames:
        return cls(tuple(sorted({s.name for s in work})), tuple(sorted({s.track for s in work})),
                   frozenset(d for s in work for d in s.devices))


def analyse_step(spans: Sequence[Span], step_span: Span) -> StepAnalysis:
    """Where `step_span`'s time went among `spans` (spans outside it count as idle)."""
    work = [s for s in spans if _is_step_work(s)]
    return _analyse(step_span, work, _RunNames.of(work))


def _analyse(step_span: Span, work: Sequence[Span], names: _RunNames) -> StepAnalysis:
    """`analyse_step` given the work spans that may overlap the step (others may be left out: they add nothing)."""
    lo, hi = step_span.start, step_span.end
    duration = max(hi - lo, 1e-9)
    by_stage: dict[str, list[tuple[float, float]]] = {k: [] for k in names.stages}
    by_track: dict[str, list[tuple[float, float]]] = {k: [] for k in names.tracks}
    by_device: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in work:
        by_stage[s.name].append((s.start, s.end))
        by_track[s.track].append((s.start, s.end))
        for d in s.devices:
            by_device[d].append((s.start, s.end))
    result = StepAnalysis(step=int(step_span.args.get("step", -1)), duration=duration)
    result.stage_busy = {k: _union_length(v, lo, hi) / duration for k, v in by_stage.items()}
    result.track_busy = {k: _union_length(v, lo, hi) / duration for k, v in by_track.items()}
    if names.devices:
        busy = sum(_union_length(v, lo, hi) for v in by_device.values())
        result.bubble_fraction = 1.0 - busy / (len(names.devices) * duration)
    any_work = _union_length([(s.start, s.end) for s in work], lo, hi)
    result.scheduler_overhead_fraction = 1.0 - any_work / duration
    return result


def analyse(spans: Sequence[Span]) -> list[StepAnalysis]:
    """One `StepAnalysis` per driver `step` span, in step order: `analyse_step` of each, in time linear in the
    run's length (each step looks only at the spans that reach into it; a 3,000-step run took two minutes)."""
    steps = sorted((s for s in spans if s.name == STEP_SPAN), key=lambda s: s.start)
    work = sorted((s for s in spans if _is_step_work(s)), key=lambda s: s.start)
    names = _RunNames.of(work)
    analyses: list[StepAnalysis] = []
    reaching: list[Span] = []  # spans that started before the step ends and had not ended when an earlier one began
    taken = 0
    for step in steps:
        while taken < len(work) and work[taken].start < step.end:
            reaching.append(work[taken])
            taken += 1
        reaching = [s for s in reaching if s.end > step.start]  # steps go in start order: ended spans stay ended
        analyses.append(_analyse(step, reaching, names))
    return analyses


def summarise(analyses: Sequence[StepAnalysis]) -> dict[str, Any]:
    """Time-weighted averages over steps (stage and track busy fractions, bubble, scheduler overhead)."""
    total = sum(a.duration for a in analyses) or 1e-9

    def weighted(get) -> float:
        return sum(get(a) * a.duration for a in analyses) / total

    stages = sorted({k for a in analyses for k in a.stage_busy})
    tracks = sorted({k for a in analyses for k in a.track_busy})
    return {
        "steps": len(analyses),
        "total_step_time_s": sum(a.duration for a in analyses),
        "stage_busy": {k: weighted(lambda a, k=k: a.stage_busy.get(k, 0.0)) for k in stages},
        "track_busy": {k: weighted(lambda a, k=k: a.track_busy.get(k, 0.0)) for k in tracks},
        "bubble_fraction": weighted(lambda a: a.bubble_fraction),
        "scheduler_overhead_fraction": weighted(lambda a: a.scheduler_overhead_fraction),
    }


def to_chrome_trace(spans: Sequence[Span]) -> dict[str, Any]:
    """Chrome trace events: component = process, worker = thread; args carry step, version and devices."""
    components = sorted({s.track.split("/")[0] for s in spans})
    pid_of = {c: i + 1 for i, c in enumerate(components)}
    tracks = sorted({s.track for s in spans})
    tid_of = {t: i + 1 for i, t in enumerate(tracks)}
    t0 = min((s.start for s in spans), default=0.0)
    events: list[dict[str, Any]] = []
    for c, pid in pid_of.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": c}})
    for t, tid in tid_of.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid_of[t.split("/")[0]], "tid": tid,
                       "args": {"name": t}})
    for s in sorted(spans, key=lambda s: s.start):
        args = dict(s.args)
        if s.devices:
            args["devices"] = list(s.devices)
        events.append({
            "name": s.name, "ph": "X", "pid": pid_of[s.track.split("/")[0]], "tid": tid_of[s.track],
            "ts": round((s.start - t0) * 1e6, 1), "dur": round(max(s.end - s.start, 0.0) * 1e6, 1), "args": args,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0_unix_s": t0}}


def write_chrome_trace(spans: Sequence[Span], path: str | Path) -> None:
    """Write `timeline.json` whole or not at all (a temporary sibling renamed into place: a full disk or a kill
    mid-write leaves the previous file, never a truncated one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(to_chrome_trace(spans)))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def read_chrome_trace(path: str | Path) -> list[Span]:
    """Spans back from a `timeline.json` written by `write_chrome_trace`."""
    data = json.loads(Path(path).read_text())
    t0 = data.get("otherData", {}).get("t0_unix_s", 0.0)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
    spans = []
    for e in data["traceEvents"]:
        if e.get("ph") != "X":
            continue
        args = dict(e.get("args", {}))
        devices = tuple(args.pop("devices", ()))
        start = t0 + e["ts"] / 1e6
        spans.append(Span(e["name"], names[(e["pid"], e["tid"])], start, start + e["dur"] / 1e6, devices, args))
    return spans


def render_timeline_png(spans: Sequence[Span], path: str | Path, title: str = "timeline") -> None:
    """One row per worker track, one colour per stage, x in seconds from the first span."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = [s for s in spans if s.name != STEP_SPAN]
    tracks = sorted({s.track for s in work})
    stages = sorted({s.name for s in work})
    colours = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(stages)}
    t0 = min((s.start for s in spans), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 1 + 0.45 * max(len(tracks), 1)))
    for row, track in enumerate(tracks):  # one collection per row (one per span took seconds for a long run)
        on_row = [s for s in work if s.track == track]
        row_colours = [colours[s.name] for s in on_row]
        ax.broken_barh([(s.start - t0, max(s.duration, 1e-4)) for s in on_row], (row - 0.4, 0.8),
                       facecolors=row_colours, edgecolors=row_colours)
    step_starts = [s.start - t0 for s in spans if s.name == STEP_SPAN]
    ax.vlines(step_starts, 0, 1, transform=ax.get_xaxis_transform(), colors="0.6", lw=0.6, ls="--")
    ax.set_yticks(range(len(tracks)), tracks)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in stages]
    ax.legend(handles, stages, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=max(1, min(len(stages), 8)),
              fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_curve_png(series: dict[str, tuple[Sequence[int], Sequence[float]]], path: str | Path, title: str) -> None:
    """Line chart of per-step metrics, each with its own steps (e.g. reward/mean at every step, val/pass@1 at the
    validated ones)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (steps, values) in series.items():
        ax.plot(list(steps), list(values), marker="o", ms=3, label=name)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timeline_report(run_dir: str | Path, render: bool = True) -> str:
    """The text `rlinf-pipe timeline RUN_DIR` prints (and, with `render`, timeline.png rewritten)."""
    from rlinf_pipe.errors import RlinfPipeError

    path = Path(run_dir) / "timeline.json"
    if not path.is_file():
        raise RlinfPipeError(f"{path} does not exist; give a run folder written by a finished (or stopped) run")
    try:
        spans = read_chrome_trace(path)
    except (ValueError, KeyError, TypeError) as exc:
        raise RlinfPipeError(
            f"{path} is not a readable timeline ({type(exc).__name__}: {exc}); it was cut short or edited. Runs "
            "of this version write it whole; the run's metrics.jsonl and summary.json do not depend on it"
        ) from None
    from rlinf_pipe.utils.launch_timeline import analyse_launch, render_launch

    s = summarise(analyse(spans))
    lines = [f"{s['steps']} steps, {s['total_step_time_s']:.2f} s in steps"]
    lines += [launch] if (launch := render_launch(analyse_launch(spans))) else []
    lines += ["", "stage busy (share of step time):"]
    lines += [f"  {name:<16} {frac:6.1%}" for name, frac in sorted(s["stage_busy"].items(), key=lambda kv: -kv[1])]
    lines += ["", "worker busy:"]
    lines += [f"  {name:<16} {frac:6.1%}" for name, frac in s["track_busy"].items()]
    lines += [
        "",
        f"device bubble (device time nobody used): {s['bubble_fraction']:.1%}",
        f"scheduler overhead (no worker busy):     {s['scheduler_overhead_fraction']:.1%}",
    ]
    if render:
        render_timeline_png(spans, Path(run_dir) / "timeline.png", title=Path(run_dir).name)
        lines.append(f"picture: {Path(run_dir) / 'timeline.png'}")
    return "\n".join(lines)
