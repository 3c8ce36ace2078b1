"""Runnable examples keep working (run as a user would, in a fresh process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_example(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run an example script from the repository root, as a user would."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_allreduce_example_on_a_local_virtual_gpu_cluster():
    proc = run_example("examples/workers/allreduce.py", "cluster.ray_address=local")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "actor rank 1: node 0" in proc.stdout and "CUDA_VISIBLE_DEVICES=3, global GPUs [3]" in proc.stdout
    assert "all-reduce of ranks: [1.0, 1.0]" in proc.stdout
    assert "items per data-parallel replica: [5, 5]" in proc.stdout


def test_example_reports_user_errors_without_traceback():
    proc = run_example("examples/workers/allreduce.py", "cluster.ray_address=local", "cluster.num_nodes=2",
                       timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: cluster.num_nodes=2 but no running Ray cluster")


@pytest.mark.slow
def test_channel_stream_example():
    proc = run_example("examples/channels/stream.py", "cluster.ray_address=local")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 0 complete" in proc.stdout and "step 1 complete" in proc.stdout
    assert "samples per producer: [12, 12]" in proc.stdout
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("step 0:")]
    assert line.startswith("step 0: 12 samples") and "(producers [0, 1])" in line
    assert int(line.split(", ")[1].split()[0]) == sum(3 + (i * 5 + r) % 9 for r in (0, 1) for i in range(6))


def test_large_tensors_example_shows_the_shared_memory_held_and_given_back():
    proc = run_example("examples/channels/large_tensors.py", "--items", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum("every byte exact: True" in line for line in lines) == 2
    assert "shared memory: 8 tensors, 8 MiB" in proc.stdout and "while the driver keeps them: 8 MiB" in proc.stdout
    assert "shared memory: after the driver let go: 0 MiB" in lines
    assert "(over the socket for want of room: 0 MiB)" in proc.stdout
    assert any(line.startswith("socket only:") and "keeps them: 0 MiB" in line for line in lines)


@pytest.mark.parametrize("script", ["run_main_math_pipeline_grpo_megatron.sh", "run_main_math_grpo_megatron.sh"])
def test_run_scripts_report_config_errors_without_traceback(script):
    proc = subprocess.run(
        ["bash", f"examples/math/{script}", "runner.max_stepz=3"], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unknown key `runner.max_stepz`" in proc.stderr and "max_steps" in proc.stderr


def test_main_math_rejects_an_unknown_model_name(tmp_path):
    proc = run_example("examples/math/main_math.py", "--config-name", "tiny-grpo-megatron-pipeline",
                       "actor.model_path=no-such-model", f"runner.output_dir={tmp_path}", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "actor.model_path: unknown model 'no-such-model'" in proc.stderr
    assert "Ray: started" not in proc.stdout + proc.stderr  # found by the checks before Ray starts


@pytest.mark.slow
def test_the_main_job_runs_and_stops_without_an_error_line(tmp_path):
    """The README's main command, cut to two steps: it trains, stops its workers and prints no error line (running
    every exit handler of a worker before killing it, Ray's among them, printed 'ERROR ... no attribute core_worker'
    from each one)."""
    proc = subprocess.run(
        ["bash", "examples/math/run_main_math_pipeline_grpo_megatron.sh", "runner.max_steps=2",
         f"runner.output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "outputs:" in proc.stdout
    assert "ERROR" not in output and "Traceback" not in output, output[-3000:]
