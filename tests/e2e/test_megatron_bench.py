"""The Megatron benchmarks (training step, log-prob pass) run end to end and report finite figures (no timed
assertions)."""

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


def test_logprob_pass_bench_reports_the_filler_it_saves():
    """Both passes run the same micro-batches; the equal-shape one carries filler, the log-probs agree."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/logprob_pass_bench.py", "--repeats", "1", "--rows", "16", "--max-response", "64",
         "--budget", "96", "--threads", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(math.isfinite(summary[k]) and summary[k] > 0 for k in ("own_shape_s", "equal_shape_s"))
    assert summary["micro_batches"] > 1 and 0 < summary["filler_fraction"] < 1
    assert summary["max_abs_diff"] < 1e-5
