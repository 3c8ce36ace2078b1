"""Where a job's launch went, from its launch spans (`tracing.LAUNCH_SPAN`): the time to its first step, the
driver's phases and each worker group's start.

    analyse_launch(spans)  # {} without a launch; else the last launch's figures (a resumed run's own)
    render_launch(figures) # one line for the run's summary and `rlinf-pipe timeline`
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlinf_pipe.utils.tracing import LAUNCH_SPAN, STEP_SPAN, Span

PHASE_WORDS = {"preflight": "checks", "ray_start": "Ray", "import": "imports", "prepare": "preparing",
               "start_workers": "workers"}  # the driver's phases, in order, and their words in the summary line
PHASES = tuple(PHASE_WORDS)


def analyse_launch(spans: Sequence[Span]) -> dict[str, Any]:
    """The last launch among `spans` (the one whose driver span, phase `job`, starts last): its length, the time
    from its start to the first step after it, each driver phase's length, and per worker group the longest
    rank's time from its process's start until it was built and its longest constructor (`build_s`). Workers
    relaunched later in the run (a lost worker) are not part of it. {} when there is no launch span."""
    jobs = [s for s in spans if s.name == LAUNCH_SPAN and s.args.get("phase") == "job"]
    if not jobs:
        return {}
    job = max(jobs, key=lambda s: s.start)
    steps = [s.start for s in spans if s.name == STEP_SPAN and s.start >= job.start]
    ours = [s for s in spans if s.name == LAUNCH_SPAN and job.start <= s.end <= job.end]
    phases = {s.args["phase"]: round(s.duration, 3) for s in ours if s.args.get("phase") in PHASES}
    workers: dict[str, float] = {}
    builds: dict[str, float] = {}
    for s in ours:
        if "phase" not in s.args:
            group = s.track.split("/")[0]
            workers[group] = round(max(workers.get(group, 0.0), s.duration), 3)
            builds[group] = round(max(builds.get(group, 0.0), float(s.args.get("build_s", 0.0))), 3)
    return {
        "launch_s": round(job.duration, 3),
        "to_first_step_s": round(min(steps) - job.start, 3) if steps else None,
        "phases_s": {p: phases[p] for p in PHASES if p in phases},
        "workers_s": dict(sorted(workers.items(), key=lambda kv: -kv[1])),
        "build_s": builds,
    }


def render_launch(figures: dict[str, Any]) -> str:
    """`launch: 16.0 s to the first step (checks 0.4 s, Ray 3.1 s, ...; workers: actor 9.8 s, building 5.1 s; ...)`;
    "" without a launch."""
    if not figures:
        return ""
    first = figures["to_first_step_s"]
    head = f"{first:.1f} s to the first step" if first is not None else f"{figures['launch_s']:.1f} s, no step"
    phases = ", ".join(f"{PHASE_WORDS[p]} {s:.1f} s" for p, s in figures["phases_s"].items())
    workers = "; ".join(f"{g} {s:.1f} s (building {figures['build_s'].get(g, 0.0):.1f} s)"
                        for g, s in figures["workers_s"].items())
    return f"launch: {head} ({phases}){'; started: ' + workers if workers else ''}"
