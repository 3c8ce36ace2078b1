"""Host clock offsets against the driver's: the estimate from round trips, spans and profiles shifted by it."""

from __future__ import annotations

import json

import pytest

from rlinf_pipe.runner.clocks import NodeClocks, offset_from_samples
from rlinf_pipe.utils.profiling import ProfileResult, align_profiles, write_profile
from rlinf_pipe.utils.tracing import Span


def test_the_quickest_round_trip_gives_the_offset():
    # (sent, remote clock, received): the remote clock is 2.0 s ahead; the second trip is the quickest
    samples = [(10.0, 12.3, 10.4), (20.0, 22.01, 20.02), (30.0, 32.5, 30.9)]
    offset, trip = offset_from_samples(samples)
    assert offset == pytest.approx(2.0) and trip == pytest.approx(0.02)


def test_spans_of_a_measured_node_are_shifted_and_others_kept():
    clocks = NodeClocks(driver_node=0)
    clocks.offsets[2] = 1.5
    span = Span("train", "actor/3", 101.5, 103.0, (17,), {"step": 4})
    (shifted,) = clocks.align([span], 2)
    assert (shifted.start, shifted.end, shifted.args, shifted.devices) == (100.0, 101.5, {"step": 4}, (17,))
    assert clocks.align([span], 1) == [span]


def test_a_profile_from_a_node_ahead_lands_on_the_timelines_clock(tmp_path):
    # a kineto trace as the workers return it (absolute microseconds, origin 0) from a host 2 s ahead
    trace = {"traceEvents": [{"name": "mm", "ph": "X", "pid": 1, "tid": 1, "ts": 102_000_000.0, "dur": 5.0}],
             "otherData": {"t0_unix_s": 0.0}}
    write_profile(tmp_path / "profile", "actor/0", 3, ProfileResult(json.dumps(trace).encode(), None), 2.0)
    timeline = {"traceEvents": [], "otherData": {"t0_unix_s": 90.0}}
    (tmp_path / "timeline.json").write_text(json.dumps(timeline))
    assert align_profiles(tmp_path) is not None
    written = json.loads((tmp_path / "profile" / "actor-0.step3.json").read_text())
    (event,) = [e for e in written["traceEvents"] if e.get("name") == "mm"]
    assert event["ts"] == pytest.approx((100.0 - 90.0) * 1e6)  # at 100 s on the driver's clock
