#!/usr/bin/env bash
# torch.profiler in every worker for two steps of the tiny pipeline, lined up with the timeline
# (docs/profiling.md). Prints each worker's heaviest ops and where the traces are.
#   bash examples/profiling/profile_steps.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-outputs/profiling-example}
PY=${PYTHON:-.venv/bin/python}
"$PY" -m rlinf_pipe.cli train runner.max_steps=4 "runner.profile_steps=[2,3]" runner.progress=false \
    runner.output_dir="$OUT" runner.experiment_name=profiled
RUN=$(ls -d "$OUT"/profiled/*/ | tail -1)
"$PY" - "$RUN" <<'PY'
import collections, json, pathlib, sys

run = pathlib.Path(sys.argv[1])
for trace in sorted((run / "profile").glob("*.step3.json")):
    events = json.loads(trace.read_text())["traceEvents"]
    total = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            total[e["name"]] += e["dur"] / 1e3
    top = ", ".join(f"{name} {ms:.0f} ms" for name, ms in total.most_common(3))
    print(f"{trace.name}: {top or 'no torch ops'}")
print(f"open {run / 'profile' / 'with_timeline.json'} in https://ui.perfetto.dev (the timeline and every trace together)")
PY
