"""Benchmark scripts that start Ray or use shared memory run end to end at their smallest settings and report finite
figures (no timed assertions); those that run in one process are in tests/integration/test_benchmark_scripts.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_weight_broadcast_bench_reports_finite_figures(transport):
    proc = subprocess.run(
        [sys.executable, "benchmarks/weight_broadcast_bench.py", "--bucket-mb", "1", "--iters", "2", "--transport",
         transport, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked shared_memory" not in proc.stderr  # (ipc: the slots' names are removed once mapped)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    result = summary["by_bucket_mb"]["1"]
    assert summary["receivers"] == 2 and summary["transport"] == transport
    assert result["bytes"] > 0 and result["buckets"] >= 1
    assert all(math.isfinite(result[k]) and result[k] > 0 for k in ("raw_s", "protocol_s", "protocol_over_raw_bw"))


def test_channel_bench_reports_finite_figures_for_both_ways_of_taking_and_encrypted():
    proc = subprocess.run(
        [sys.executable, "benchmarks/channel_bench.py", "--sizes", "100B", "64KiB", "--scale", "0.01", "--repeats",
         "1", "--no-load", "--aget", "--curve", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    figures = [summary["ratio_vs_zmq"]["64KiB"], summary["ratio_vs_zmq_aget"]["64KiB"], summary["ratio_vs_ray"]["100B"],
               summary["ratio_vs_zmq_socket"]["64KiB"], summary["curve_vs_plain"]["64KiB"],
               summary["curve_socket_vs_socket"]["64KiB"], *summary["cpu_us_per_item"]["64KiB"].values()]
    assert len(figures) == 12 and all(math.isfinite(f) and f > 0 for f in figures), summary  # (6 transports' CPU)
