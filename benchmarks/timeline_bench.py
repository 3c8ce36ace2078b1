"""What a run's timeline costs at its end (and in `rlinf-pipe timeline`), against how it was done until 2026-11-29, on
the same spans: the analysis (`summarise(analyse(spans))`, for summary.json) against `analyse_step` of each step
among all the run's spans (what `analyse` did), and the picture (`render_timeline_png`) against one matplotlib artist
per span and per step line.

    python benchmarks/timeline_bench.py [--steps 200] [--repeats 5] [--timeline RUN_DIR/timeline.json] [--json]

The spans are a pipeline run's shape, `--steps` of them (a step line, and on each of three worker tracks the
stages a default step records: generate and weight_sync; train, optimizer_step and publish_weights; reward), or
those of a real run's timeline with `--timeline`. Each repeat times each way, alternating; reported: the medians
with their ranges and the ratio before / now. With --json the last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rlinf_pipe.utils.timeline import (
    STEP_SPAN,
    analyse,
    analyse_step,
    read_chrome_trace,
    render_timeline_png,
    summarise,
)
from rlinf_pipe.utils.tracing import Span

TRACKS = {"rollout/0": ("generate", "weight_sync"), "actor/0": ("train", "optimizer_step", "publish_weights"),
          "reward/0": ("reward",)}


def pipeline_spans(steps: int, seed: int = 0) -> list[Span]:
    """`steps` steps of 0.4 s, each with a step line and four spans of random stages on each worker track."""
    rng = random.Random(seed)
    spans = []
    for step in range(steps):
        t = 0.4 * step
        spans.append(Span(STEP_SPAN, "driver", t, t + 0.4))
        for track, stages in TRACKS.items():
            for _ in range(4):
                start = t + rng.uniform(0, 0.35)
                spans.append(Span(rng.choice(stages), track, start, start + rng.uniform(0.001, 0.05)))
    return spans


def render_one_artist_per_span(spans: Sequence[Span], path: Path) -> None:
    """The renderer as it was: the same picture, one `broken_barh` per span and one `axvline` per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = [s for s in spans if s.name != STEP_SPAN]
    tracks = sorted({s.track for s in work})
    stages = sorted({s.name for s in work})
    colours = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(stages)}
    t0 = min((s.start for s in spans), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 1 + 0.45 * max(len(tracks), 1)))
    for row, track in enumerate(tracks):
        for s in (s for s in work if s.track == track):
            ax.broken_barh([(s.start - t0, max(s.duration, 1e-4))], (row - 0.4, 0.8), color=colours[s.name])
    for s in spans:
        if s.name == STEP_SPAN:
            ax.axvline(s.start - t0, color="0.6", lw=0.6, ls="--")
    ax.set_yticks(range(len(tracks)), tracks)
    ax.set_xlabel("seconds")
    ax.set_title("timeline")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in stages]
    ax.legend(handles, stages, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=min(len(stages), 8),
              fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_now(spans: Sequence[Span], path: Path) -> None:
    summarise(analyse(spans))


def summary_before(spans: Sequence[Span], path: Path) -> None:
    """The run's analysis as it was: each step's among every span of the run."""
    steps = sorted((s for s in spans if s.name == STEP_SPAN), key=lambda s: s.start)
    summarise([analyse_step(spans, step) for step in steps])


def timed(work, spans: Sequence[Span], path: Path) -> float:
    start = time.perf_counter()
    work(spans, path)
    return time.perf_counter() - start


def compare(now, before, spans: Sequence[Span], path: Path, repeats: int) -> dict[str, float | list[float]]:
    """Medians and ranges of `now` and `before` on the same spans, alternating."""
    times: dict[str, list[float]] = {"now": [], "before": []}
    for _ in range(repeats):
        times["now"].append(timed(now, spans, path))
        times["before"].append(timed(before, spans, path))
    result: dict[str, float | list[float]] = {}
    for key, values in times.items():
        result[f"{key}_s"] = statistics.median(values)
        result[f"{key}_range_s"] = [min(values), max(values)]
    result["ratio_before_over_now"] = statistics.median(times["before"]) / statistics.median(times["now"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeline", type=Path, default=None, help="a run's timeline.json instead of made-up spans")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    spans = read_chrome_trace(args.timeline) if args.timeline else pipeline_spans(args.steps)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "timeline.png"
        render_timeline_png(spans[:10], path)  # matplotlib's import and first figure, outside the timings
        result: dict[str, object] = {
            "spans": len(spans),
            "analysis": compare(summary_now, summary_before, spans, path, args.repeats),
            "picture": compare(render_timeline_png, render_one_artist_per_span, spans, path, args.repeats),
        }
    print(f"{len(spans)} spans")
    for part in ("analysis", "picture"):
        r = result[part]
        print(f"  {part}: now {r['now_s']:.3f} s ({r['now_range_s'][0]:.3f}-{r['now_range_s'][1]:.3f}), before "
              f"{r['before_s']:.3f} s ({r['before_range_s'][0]:.3f}-{r['before_range_s'][1]:.3f}): "
              f"{r['ratio_before_over_now']:.1f}x")
    if args.json:
        print(json.dumps(result))

if __name__ == "__main__":
    main()
