"""`benchmarks/pipeline_vs_collocated.py` on the GPU machine's CPU cores, its GPU hidden (`CUDA_VISIBLE_DEVICES`
naming no device: the workers run on CPU, as on the 2-core CI machine whose figures docs/benchmarks.md records):
the same comparison on up to 8 cores, one repeat of a few steps, its JSON printed for the record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("ray")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
NO_DEVICE = "8,9"  # (two ids no device of a one-GPU machine has: torch finds no CUDA, Ray's two GPUs are virtual)


def test_pipeline_against_collocated_on_the_machines_cores(tmp_path):
    cpus = max(2, min(8, len(os.sched_getaffinity(0))))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": NO_DEVICE}
    env.pop("RLINF_PIPE_NODE_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "benchmarks/pipeline_vs_collocated.py", "--cpus", str(cpus), "--steps",
                           "4", "--warmup", "1", "--repeats", "1", "--gloo-iters", "10", "--output-dir",
                           str(tmp_path), "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps({key: summary[key] for key in ("pipeline_over_collocated_step_time", "weight_sync_mib_per_s",
                                                    "runtime_s", "machine", "settings")}))
    assert summary["settings"]["cpus"] == cpus and summary["pipeline_over_collocated_step_time"] > 0
    assert all(summary["modes"][mode]["step_s"] > 0 for mode in ("pipeline", "collocated"))
