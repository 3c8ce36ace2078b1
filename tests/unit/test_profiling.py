"""torch.profiler per step: every thread's ops recorded, absolute timestamps, and traces shifted onto the timeline's
origin with a combined file (real torch.profiler, real timeline.json)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from rlinf_pipe.config import load_config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.utils.profiling import COMBINED, PROFILE_DIR, StepProfiler, align_profiles, write_profile
from rlinf_pipe.utils.timeline import write_chrome_trace
from rlinf_pipe.utils.tracing import Span


def matmuls() -> None:
    a = torch.randn(64, 64)
    for _ in range(3):
        a = a @ a.T / 64


def test_a_step_profile_records_every_thread_in_absolute_time(tmp_path):
    profiler = StepProfiler()
    before = time.time()
    profiler.start(3)
    with pytest.raises(RuntimeError, match="step 3 is still being profiled"):
        profiler.start(4)
    worker = threading.Thread(target=matmuls)  # engines and trainers compute off the calling thread
    worker.start()
    worker.join()
    result = profiler.stop()
    after = time.time()
    trace = json.loads(result.trace)
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("aten::")]
    assert {e["tid"] for e in ops if e["name"] == "aten::mm"} == {worker.native_id}
    assert all(before * 1e6 - 1e3 <= e["ts"] <= after * 1e6 for e in ops)  # absolute µs
    assert trace["otherData"] == {"t0_unix_s": 0.0} and "baseTimeNanoseconds" not in trace
    assert result.memory_snapshot is None  # (CPU: no CUDA memory history)
    with pytest.raises(RuntimeError, match="without start_profile"):
        profiler.stop()


def test_traces_are_shifted_onto_the_timeline_origin_and_combined(tmp_path):
    profiler = StepProfiler()
    started = time.time()
    profiler.start(1)
    matmuls()
    result = profiler.stop()
    ended = time.time()
    spans = [Span("warmup", "driver", started - 5.0, started - 4.0), Span("train", "actor/0", started, ended, (2,))]
    write_chrome_trace(spans, tmp_path / "timeline.json")
    (path,) = write_profile(tmp_path / PROFILE_DIR, "actor/0", 1, result)
    assert path.name == "actor-0.step1.json"
    combined = align_profiles(tmp_path)
    assert combined == tmp_path / PROFILE_DIR / COMBINED
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    train = next(e for e in timeline["traceEvents"] if e.get("name") == "train")
    shifted = json.loads(path.read_text())
    ops = [e for e in shifted["traceEvents"] if e.get("ph") == "X" and e["name"] == "aten::mm"]
    assert ops and all(train["ts"] <= e["ts"] <= train["ts"] + train["dur"] for e in ops)  # the same origin
    assert shifted["otherData"]["t0_unix_s"] == timeline["otherData"]["t0_unix_s"]
    assert json.loads(path.read_text()) == shifted == json.loads(json.dumps(shifted))
    align_profiles(tmp_path)  # again: idempotent
    assert json.loads(path.read_text())["traceEvents"] == shifted["traceEvents"]
    events = json.loads(combined.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"driver", "actor"} <= names and any(n.startswith("actor-0.step1 (") for n in names)
    timeline_pids = {e["pid"] for e in timeline["traceEvents"]}
    assert {e["pid"] for e in events if e.get("name") == "aten::mm"}.isdisjoint(timeline_pids)


def test_profile_steps_and_nsight_components_are_checked():
    with pytest.raises(ConfigError, match=r"runner.profile_steps: step\(s\) \[5\] .* 0 to runner.max_steps - 1 = 4"):
        load_config(overrides=["runner.max_steps=5", "runner.profile_steps=[1,5]"])
    with pytest.raises(ConfigError, match=r"runner.nsight: \['actr'\] .* are not components"):
        load_config(overrides=["runner.nsight=[actr]"])
