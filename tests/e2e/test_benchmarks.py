"""Benchmark scripts run end to end at their smallest settings and report finite figures (no timed assertions)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pipeline_vs_collocated_reports_finite_figures():
    proc = subprocess.run(
        [sys.executable, "benchmarks/pipeline_vs_collocated.py", "--steps", "2", "--repeats", "1", "--rollout-batch-size", "3",
         "--gloo-iters", "5", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("pipeline_over_collocated_step_time", "scheduler_overhead_fraction", "weight_sync_bw_ratio_vs_gloo",
                "weight_sync_bw_ratio_vs_gloo_one_receiver", "bubble_fraction"):
        value = summary[key]
        assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
    assert summary["pipeline_over_collocated_step_time"] > 0 and summary["weight_sync_bw_ratio_vs_gloo"] > 0
    assert 0 <= summary["bubble_fraction"] < 1 and 0 <= summary["scheduler_overhead_fraction"] < 1
    assert summary["weight_sync_bytes"] > 0
    assert summary["modes"]["pipeline"]["weight_sync_receivers"] == 2
    assert summary["modes"]["collocated"]["weight_sync_receivers"] == 3
    assert summary["settings"]["steps"] == 2 and summary["settings"]["repeats"] == 1
    for mode in ("pipeline", "collocated"):  # training data streams worker to worker, never through the driver
        figures = summary["modes"][mode]
        assert figures["driver_data_bytes_per_step"] == 0 and figures["train_data_bytes_per_step"] > 0, figures


def test_weight_broadcast_bench_reports_finite_figures():
    proc = subprocess.run(
        [sys.executable, "benchmarks/weight_broadcast_bench.py", "--bucket-mb", "1", "--iters", "2", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    result = summary["by_bucket_mb"]["1"]
    assert summary["receivers"] == 2 and result["bytes"] > 0 and result["buckets"] >= 1
    assert all(math.isfinite(result[k]) and result[k] > 0 for k in ("raw_s", "protocol_s", "protocol_over_raw_bw"))
