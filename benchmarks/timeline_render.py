"""How long a run's `timeline.png` takes to draw: `render_timeline_png` against the way it drew until 2026-11-29 (one
matplotlib artist per span and per step line), on the same spans.

    python benchmarks/timeline_render.py [--steps 200] [--repeats 5] [--timeline RUN_DIR/timeline.json] [--json]

The spans are a pipeline run's shape, `--steps` of them (a step line, and on each of three worker tracks the
stages a default step records: generate and weight_sync; train, optimizer_step and publish_weights; reward), or
those of a real run's timeline with `--timeline`. Each repeat draws both, alternating; reported: the medians with
their ranges and the ratio baseline / now. The picture is drawn at the end of every run and by `rlinf-pipe
timeline`. With --json the last printed line is one JSON object.
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

from rlinf_pipe.utils.timeline import STEP_SPAN, read_chrome_trace, render_timeline_png
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


def timed(draw, spans: Sequence[Span], path: Path) -> float:
    start = time.perf_counter()
    draw(spans, path)
    return time.perf_counter() - start


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
        now: list[float] = []
        before: list[float] = []
        for _ in range(args.repeats):
            now.append(timed(render_timeline_png, spans, path))
            before.append(timed(render_one_artist_per_span, spans, path))
    result = {
        "spans": len(spans),
        "now_s": statistics.median(now), "now_range_s": [min(now), max(now)],
        "one_artist_per_span_s": statistics.median(before), "one_artist_per_span_range_s": [min(before), max(before)],
        "ratio_before_over_now": statistics.median(before) / statistics.median(now),
    }
    print(f"{len(spans)} spans: now {result['now_s']:.3f} s ({min(now):.3f}-{max(now):.3f}), one artist per span "
          f"{result['one_artist_per_span_s']:.3f} s ({min(before):.3f}-{max(before):.3f}): "
          f"{result['ratio_before_over_now']:.1f}x")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
