"""The Megatron training-step benchmark runs end to end and reports finite timings (no timed assertions)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_megatron_step_bench_reports_finite_timings():
    proc = subprocess.run(
        [sys.executable, "benchmarks/megatron_step_bench.py", "--repeats", "2", "--warmup", "1", "--batch", "4",
         "--seq-len", "24", "--response-len", "8", "--threads", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("step_s", "forward_s", "fwd_bwd_s", "optimizer_s"):
        assert set(summary[key]) == {"megatron", "hf"}
        assert all(math.isfinite(v) and v > 0 for v in summary[key].values()), summary[key]
    for key in ("megatron_over_hf_step_time", "megatron_over_hf_forward_time"):
        assert math.isfinite(summary[key]) and summary[key] > 0, summary[key]
    assert summary["repeats"] == 2 and summary["batch"] == 4 and summary["params"] > 0
