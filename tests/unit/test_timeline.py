"""The timeline: the run's analysis (each step's share of every stage, track and device) and its picture (every span
drawn in its stage's colour, on its own track, as wide as it lasted)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib import colormaps
from PIL import Image

from rlinf_pipe.utils.timeline import STEP_SPAN, analyse, analyse_step, render_timeline_png
from rlinf_pipe.utils.tracing import Span

# Times on a coarse grid, so that spans often start or end exactly where a step does.
times = st.integers(0, 40).map(lambda t: t / 4)
work_spans = st.builds(
    lambda name, track, a, length, devices: Span(name, track, a, a + length, tuple(sorted(devices))),
    st.sampled_from(["generate", "train", "reward"]), st.sampled_from(["rollout/0", "actor/0", "actor/1"]),
    times, st.integers(0, 24).map(lambda t: t / 4), st.sets(st.integers(0, 3), max_size=2),
)


@st.composite
def runs(draw) -> list[Span]:
    """Steps one after another (some with gaps between them) and spans anywhere, across steps and beyond them."""
    bounds = sorted(draw(st.sets(times, min_size=2, max_size=8)))
    steps = [Span(STEP_SPAN, "driver", a, b, (), {"step": i}) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
             if draw(st.booleans()) or i == 0]
    return draw(st.permutations(steps + draw(st.lists(work_spans, max_size=30))))


@settings(max_examples=300, deadline=None)
@given(runs())
def test_the_runs_analysis_is_each_steps_analysis_among_all_spans(spans):
    steps = sorted((s for s in spans if s.name == STEP_SPAN), key=lambda s: s.start)
    assert analyse(spans) == [analyse_step(spans, step) for step in steps]


def colour_pixels(path, rgba) -> int:
    """How many pixels of the picture are exactly this colour."""
    image = np.asarray(Image.open(path).convert("RGB")).astype(int)
    rgb = np.round(np.array(rgba[:3]) * 255).astype(int)
    return int((np.abs(image - rgb).sum(-1) == 0).sum())


def test_each_span_is_drawn_in_its_stages_colour_with_its_width(tmp_path):
    # Stages sort to colours tab20(0), tab20(1), tab20(2): generate, reward, train.
    spans = [Span(STEP_SPAN, "driver", 0.0, 8.0)]
    spans += [Span("train", "actor/0", 1.0 + 2 * i, 1.5 + 2 * i) for i in range(3)]  # 3 x 0.5 s
    spans += [Span("generate", "rollout/0", 0.0, 6.0), Span("reward", "rollout/0", 6.0, 7.5)]
    path = tmp_path / "timeline.png"
    render_timeline_png(spans, path)

    tab20 = colormaps["tab20"]
    generate, reward, train = (colour_pixels(path, tab20(i)) for i in range(3))
    assert min(generate, reward, train) > 0
    # Areas follow the durations (the legend's swatches add the same few pixels to each colour).
    assert 6.0 / 1.5 * 0.9 < generate / reward < 6.0 / 1.5 * 1.1
    assert 1.5 / 1.5 * 0.9 < train / reward < 1.5 / 1.5 * 1.1


def test_many_steps_draw_every_span_apart(tmp_path):
    # The spans of a track are one collection since long runs took seconds to draw with one artist per span.
    spans = [Span(STEP_SPAN, "driver", float(i), i + 1.0) for i in range(60)]
    spans += [Span("train", "actor/0", i + 0.25, i + 0.75) for i in range(60)]
    path = tmp_path / "timeline.png"
    render_timeline_png(spans, path)
    image = np.asarray(Image.open(path).convert("RGB")).astype(int)
    train = np.round(np.array(colormaps["tab20"](0)[:3]) * 255).astype(int)
    shown = (np.abs(image - train).sum(-1) == 0)
    row = shown[:, :].sum(1).argmax()  # the image row through the middle of the track
    columns = shown[row].astype(int)
    starts = np.flatnonzero(np.diff(columns) == 1)
    assert len(starts) == 60  # sixty separate bars (the legend's swatch is on another row)


def test_a_timeline_without_spans_draws_an_empty_picture(tmp_path):
    # (`rlinf-pipe timeline` on a run folder whose timeline.json holds no spans: the legend had no columns)
    render_timeline_png([], tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0
