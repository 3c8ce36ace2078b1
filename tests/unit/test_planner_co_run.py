"""The co-run slowdown (`planning.co_run`) on cases worked out by hand: overlaps, the fit, the profile's carry to
work alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlinf_pipe.planning.co_run import Busy, alone_figures, fit_slowdown, measured_slowdown, overlap_fractions
from rlinf_pipe.planning.costs import Curve
from rlinf_pipe.planning.profile import read_profile
from rlinf_pipe.planning.profile_pool import read_profiles
from rlinf_pipe.utils.tracing import Span

from tests.unit.test_planner_profile import write_spans


def test_overlap_counts_other_gpus_of_the_same_host_only():
    # hosts of 2 GPUs. "a" on GPU 0 over [0, 4] meets GPU 1's work over [2, 4] (half its time); "b" on GPU 1 is
    # covered by "a" over [2, 4] of its [2, 4] + [7, 8] (2 of 3 s); "c" on GPU 2 (the next host) overlaps both in
    # time but shares no host with them; "d" on GPUs 0 and 1 (tensor parallel) runs beside itself, its two GPUs
    # computing together: all its time; "e" on GPUs 2 and 3 over [0, 2] meets "c" on GPU 2 over all of it: from GPU
    # 3, GPU 2 computes all the time; from GPU 2, GPU 3 (itself) does too; "f" on GPUs 2 and 4 (two hosts) at
    # [30, 31] is alone on each host: 0.
    work = [Busy("a", 0.0, 4.0, (0,)), Busy("b", 2.0, 4.0, (1,)), Busy("b", 7.0, 8.0, (1,)),
            Busy("c", 0.0, 10.0, (2,)), Busy("d", 20.0, 21.0, (0, 1)), Busy("e", 0.0, 2.0, (2, 3)),
            Busy("f", 30.0, 31.0, (2, 4))]
    shares = overlap_fractions(work, lambda g: g // 2)
    assert shares == pytest.approx({"a": 0.5, "b": 2 / 3, "c": 0.2, "d": 1.0, "e": 1.0, "f": 0.0})


def test_the_fit_recovers_the_slowdown_across_stages_of_different_rates_and_pass_sizes():
    # seconds = work / rate x (1 + 0.3 f): two stages of other rates, a pass's seconds not proportional to its size
    samples = []
    for stage, rate in (("train", 100.0), ("logprob", 400.0)):
        for work in (50.0, 100.0, 200.0):
            for f in (0.0, 0.5, 1.0):
                samples.append((stage, work, (work / rate) ** 0.9 * (1 + 0.3 * f), f))
    assert fit_slowdown(samples) == pytest.approx(0.3, rel=0.05)
    # faster while overlapped is no slowdown; an overlap that never varies cannot tell one
    assert fit_slowdown([(st, w, s / (1 + 2 * f), f) for st, w, s, f in samples]) == 0.0
    assert fit_slowdown([(st, w, s, 0.5) for st, w, s, _ in samples]) is None


def run_spans(step: int, t: float) -> list[Span]:
    """Step `step` from `t`: a 0.58 s generation on GPU 0; on GPU 1 two train passes of the same 40 sequence
    tokens, the first wholly beside the generation (0.375 s), the second alone after it (0.25 s): a slowdown of
    0.5."""
    return [
        Span("step", "driver", t, t + 1.0, (), {"step": step}),
        Span("generate", "rollout/0", t + 0.02, t + 0.6, (0,), {"step": step, "prompts": 2, "tokens": 40}),
        Span("train", "actor/0", t + 0.1, t + 0.475, (1,), {"tokens": 20, "sequences": 2, "sequence_tokens": 40}),
        Span("train", "actor/0", t + 0.6, t + 0.85, (1,), {"tokens": 20, "sequences": 2, "sequence_tokens": 40}),
    ]


def test_a_profile_fits_the_slowdown_and_carries_its_rates_to_work_alone(tmp_path: Path):
    spans = [s for step in range(3) for s in run_spans(step, float(step))]
    slowdown, faster = measured_slowdown(spans, lambda g: 0)
    assert slowdown == pytest.approx(0.5)
    # train: 0.625 s measured, 0.25 + 0.375 / 1.5 = 0.5 s alone; the generation spent 0.375 of its 0.58 s beside
    # the training: alone it takes 1 / (1 + 0.5 x 0.375 / 0.58) of its time
    assert faster["train"] == pytest.approx(0.625 / 0.5)
    assert faster["generate"] == pytest.approx(1 + 0.5 * 0.375 / 0.58)
    carried = alone_figures({"train_tokens_per_s": 128.0, "decode": Curve(((1.0, 10.0),)), "launch_s": 1.0},
                            0.5, faster, "train")
    assert carried["train_tokens_per_s"] == pytest.approx(160.0) and carried["co_run_slowdown"] == 0.5
    assert carried["decode"] == Curve(((1.0, 10.0 * faster["generate"]),)) and "launch_s" not in carried

    costs = read_profile(write_spans(tmp_path / "run", spans))
    assert costs.co_run_slowdown == pytest.approx(0.5)
    assert costs.train_tokens_per_s == pytest.approx(2 * (20 + 20 / 2) / 0.5)  # (a group's prompt run once)
    assert not any("co-run" in m for m in costs.missing)


def test_where_enough_spans_ran_alone_their_speed_is_the_speed_alone():
    # Per step on GPU 1: a 40-token pass alone in 0.25 s, and one of 40 tokens in 0.5 s whose first half the
    # generation on GPU 0 covers (twice as slow: more than any line through the alone ones says). Half the spans
    # ran alone: work alone takes 0.25 s a pass, on average 0.375: 1.5x faster.
    spans = []
    for step in range(3):
        t = float(step)
        spans += [Span("generate", "rollout/0", t, t + 0.25, (0,), {"step": step, "tokens": 40}),
                  Span("train", "actor/0", t, t + 0.5, (1,), {"sequence_tokens": 40}),
                  Span("train", "actor/0", t + 0.6, t + 0.85, (1,), {"sequence_tokens": 40})]
    _, faster = measured_slowdown(spans, lambda g: 0)
    assert faster["train"] == pytest.approx(1.5)


def apart_and_together(step: int, t: float, together: bool) -> list[Span]:
    """Step `step` from `t`, each GPU's passes 40 tokens. Apart (one GPU at a time): a 0.5 s generation on GPU 0,
    then a 0.25 s train pass on GPU 1. Together (the same work on both GPUs at once): each 1.2x as long."""
    spans = [Span("step", "driver", t, t + 1.5, (), {"step": step})]
    if not together:
        return spans + [Span("generate", "rollout/0", t, t + 0.5, (0,), {"step": step, "tokens": 40}),
                        Span("train", "actor/0", t + 0.6, t + 0.85, (1,), {"sequence_tokens": 40})]
    for g in (0, 1):
        spans += [Span("generate", f"rollout/{g}", t, t + 0.6, (g,), {"step": step, "tokens": 40}),
                  Span("train", f"actor/{g}", t + 0.7, t + 1.0, (g,), {"sequence_tokens": 40})]
    return spans


def test_runs_of_two_placements_fit_the_slowdown_neither_run_can_alone(tmp_path: Path):
    apart = write_spans(tmp_path / "apart", [s for i in range(3) for s in apart_and_together(i, 2.0 * i, False)])
    together = write_spans(tmp_path / "together",
                           [s for i in range(3) for s in apart_and_together(i, 2.0 * i, True)])
    for run in (apart, together):  # (each run's overlaps never vary within a stage)
        assert read_profile(run).co_run_slowdown == 0.0 and any("co-run" in m for m in read_profile(run).missing)
    costs = read_profiles([apart, together])
    assert costs.co_run_slowdown == pytest.approx(0.2)
    assert not any("co-run" in m for m in costs.missing)
    # the training of both carried to work alone: 40 tokens in 0.25 s apart, 0.3 / 1.2 = 0.25 s together
    assert costs.train_tokens_per_s == pytest.approx(read_profile(apart).train_tokens_per_s)
    assert read_profile(together).train_tokens_per_s == pytest.approx(costs.train_tokens_per_s / 1.2)
