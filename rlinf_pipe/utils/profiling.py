"""torch.profiler around chosen steps (`runner.profile_steps`), in each worker process, lined up with the timeline.

A worker's `StepProfiler` records CPU activity of every thread (and CUDA kernels and a CUDA memory history on a
GPU) from `start` to `stop`, which returns the trace as bytes. The driver writes one file per worker and step into
`<run dir>/profile/` with timestamps in absolute microseconds (`otherData.t0_unix_s` 0); once the run's timeline is
written, `align_profiles` shifts them to the timeline's origin and writes `profile/with_timeline.json`, the
timeline and every trace in one file (open it in https://ui.perfetto.dev).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR = "profile"
COMBINED = "with_timeline.json"
MEMORY_HISTORY_ENTRIES = 100_000


@dataclass
class ProfileResult:
    """What a worker's profiler recorded over one step: the chrome trace (absolute µs) and, on a GPU, the CUDA
    memory snapshot (a pickle for https://pytorch.org/memory_viz)."""

    trace: bytes
    memory_snapshot: bytes | None = None


@dataclass
class StepProfiler:
    """Profiles this process between `start(step)` and `stop()`; one step at a time."""

    step: int | None = None
    profiler: Any = field(default=None, repr=False)

    def start(self, step: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.profiler is not None:
            raise RuntimeError(f"profiling step {step}: step {self.step} is still being profiled")
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        self.profiler = profile(activities=activities, profile_memory=cuda, experimental_config=_all_threads())
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.step = step
        self.profiler.start()

    def stop(self) -> ProfileResult:
        import torch

        if self.profiler is None:
            raise RuntimeError("stop_profile without start_profile")
        self.profiler.stop()
        with tempfile.TemporaryDirectory(prefix="rlinf-pipe-profile-") as tmp:
            path = Path(tmp) / "trace.json"
            self.profiler.export_chrome_trace(str(path))
            trace = _absolute(json.loads(path.read_text()))
            snapshot = None
            if torch.cuda.is_available():
                memory = Path(tmp) / "memory.pickle"
                torch.cuda.memory._dump_snapshot(str(memory))
                torch.cuda.memory._record_memory_history(enabled=None)
                snapshot = memory.read_bytes()
        self.profiler = self.step = None
        return ProfileResult(json.dumps(trace).encode(), snapshot)


def _all_threads() -> Any:
    """Kineto's option to record every thread's ops (engines and trainers compute off the thread that starts the
    profiler); None where this torch lacks it."""
    import torch

    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def _absolute(trace: dict[str, Any]) -> dict[str, Any]:
    """Kineto writes `ts` relative to `baseTimeNanoseconds`; make them absolute µs (origin 0)."""
    base_us = trace.pop("baseTimeNanoseconds", 0) / 1e3
    for event in trace.get("traceEvents", []):
        if "ts" in event:
            event["ts"] = float(event["ts"]) + base_us
    trace["otherData"] = {"t0_unix_s": 0.0}
    return trace


def write_profile(folder: Path, owner: str, step: int, result: ProfileResult, clock_offset_s: float = 0.0
                  ) -> list[Path]:
    """`<owner>.step<N>.json` (and `.memory.pickle` on a GPU) in `folder`; returns the paths. `clock_offset_s`: how
    far the worker's host clock is ahead of the driver's (its trace is put on the driver's clock)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{owner.replace('/', '-')}.step{step}"
    paths = [folder / f"{stem}.json"]
    trace = result.trace
    if clock_offset_s:
        shifted = json.loads(trace)
        shifted["otherData"] = {**shifted.get("otherData", {}), "t0_unix_s": -clock_offset_s}
        trace = json.dumps(shifted).encode()
    paths[0].write_bytes(trace)
    if result.memory_snapshot is not None:
        paths.append(folder / f"{stem}.memory.pickle")
        paths[1].write_bytes(result.memory_snapshot)
    return paths


def align_profiles(run_dir: Path) -> Path | None:
    """Shift every trace in `<run_dir>/profile/` to the origin of `<run_dir>/timeline.json` (a same `ts` is the same
    moment in both) and write the combined file; returns its path (None without traces or timeline)."""
    folder, timeline_path = run_dir / PROFILE_DIR, run_dir / "timeline.json"
    traces = sorted(p for p in folder.glob("*.step*.json")) if folder.is_dir() else []
    if not traces or not timeline_path.is_file():
        return None
    timeline = json.loads(timeline_path.read_text())
    t0 = timeline.get("otherData", {}).get("t0_unix_s", 0.0)
    events = list(timeline["traceEvents"])
    next_pid = 1 + max((e.get("pid", 0) for e in events if isinstance(e.get("pid"), int)), default=0)
    for path in traces:
        trace = json.loads(path.read_text())
        shift_us = (trace.get("otherData", {}).get("t0_unix_s", 0.0) - t0) * 1e6
        for event in trace.get("traceEvents", []):
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift_us
        trace["otherData"] = {"t0_unix_s": t0}
        path.write_text(json.dumps(trace))
        pids = {e["pid"] for e in trace.get("traceEvents", []) if "pid" in e}
        renamed = {pid: next_pid + i for i, pid in enumerate(sorted(pids, key=str))}
        next_pid += len(renamed)
        events += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                    "args": {"name": f"{path.stem} ({'process' if isinstance(old, int) else old})"}}
                   for old, pid in renamed.items()]
        events += [{**e, "pid": renamed[e["pid"]]} for e in trace.get("traceEvents", [])
                   if "pid" in e and not (e.get("ph") == "M" and e.get("name") == "process_name")]
    combined = folder / COMBINED
    combined.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0_unix_s": t0}}))
    return combined
