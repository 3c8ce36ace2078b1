"""The launch's figures from its spans (`rlinf_pipe.utils.launch_timeline`), and launch spans kept out of the steps'
figures (`rlinf_pipe.utils.timeline`)."""

from __future__ import annotations

from rlinf_pipe.utils.launch_timeline import analyse_launch, render_launch
from rlinf_pipe.utils.timeline import analyse, summarise
from rlinf_pipe.utils.tracing import LAUNCH_SPAN, STEP_SPAN, Span


def launch(track: str, start: float, end: float, **args) -> Span:
    return Span(LAUNCH_SPAN, track, start, end, (), args)


def a_launch(t0: float) -> list[Span]:
    """A launch at `t0`: the driver's phases, two actor ranks and a rollout rank, then two steps."""
    return [
        launch("driver", t0, t0 + 12.0, phase="job"),
        launch("driver", t0 + 0.5, t0 + 1.0, phase="preflight"),
        launch("driver", t0 + 1.0, t0 + 4.0, phase="ray_start"),
        launch("driver/prepare", t0, t0 + 2.0, phase="import"),
        launch("driver/prepare", t0 + 2.0, t0 + 3.5, phase="prepare"),
        launch("driver", t0 + 4.0, t0 + 12.0, phase="start_workers"),
        launch("actor/0", t0 + 4.1, t0 + 11.0, build_s=5.0),
        launch("actor/1", t0 + 4.2, t0 + 11.9, build_s=5.5),
        launch("rollout/0", t0 + 4.1, t0 + 9.0, build_s=2.0),
        Span(STEP_SPAN, "driver", t0 + 12.5, t0 + 13.5, (), {"step": 0}),
        Span("train", "actor/0", t0 + 12.6, t0 + 13.4, (2,), {}),
        Span(STEP_SPAN, "driver", t0 + 13.5, t0 + 14.5, (), {"step": 1}),
        Span("train", "actor/0", t0 + 13.6, t0 + 14.4, (2,), {}),
    ]


def test_the_launch_figures():
    figures = analyse_launch(a_launch(100.0))
    assert figures == {
        "launch_s": 12.0, "to_first_step_s": 12.5,
        "phases_s": {"preflight": 0.5, "ray_start": 3.0, "import": 2.0, "prepare": 1.5, "start_workers": 8.0},
        "workers_s": {"actor": 7.7, "rollout": 4.9}, "build_s": {"actor": 5.5, "rollout": 2.0},
    }
    assert render_launch(figures) == (
        "launch: 12.5 s to the first step (checks 0.5 s, Ray 3.0 s, imports 2.0 s, preparing 1.5 s, workers 8.0 s); "
        "started: actor 7.7 s (building 5.5 s); rollout 4.9 s (building 2.0 s)")


def test_a_resumed_run_reports_its_own_launch_and_not_a_relaunched_worker():
    first, second = a_launch(100.0), a_launch(1000.0)
    relaunched = launch("rollout/0", 1013.6, 1020.0, build_s=3.0)  # a lost worker, started again in step 1
    figures = analyse_launch([*first, *second, relaunched])
    assert figures == analyse_launch(second) and figures["to_first_step_s"] == 12.5


def test_no_launch_no_figures():
    assert analyse_launch([s for s in a_launch(0.0) if s.name != LAUNCH_SPAN]) == {}
    assert render_launch({}) == ""


def test_launch_spans_are_not_part_of_any_steps_figures():
    spans = a_launch(0.0)
    relaunched = launch("rollout/0", 13.6, 14.4, build_s=0.5)  # inside step 1, on no device of the step's work
    without = summarise(analyse([s for s in spans if s.name != LAUNCH_SPAN]))
    assert summarise(analyse([*spans, relaunched])) == without
    assert "launch" not in without["stage_busy"] and "rollout/0" not in without["track_busy"]
