"""`scripts/gpu_smoke.sh` itself, on CPU: a broken script costs a GPU session its device time (the first version made
a virtual environment over the GPU machine's own, which did not see its torch). Its dry run runs one GPU test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"


def _smoke(tmp_path: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python, "RLINF_PIPE_GPU_SITE": str(tmp_path / "site"),
           "RLINF_PIPE_GPU_DRY_RUN": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, check=False)


def test_a_dry_run_installs_nothing_that_is_there_and_runs_the_selected_gpu_test(tmp_path):
    proc = _smoke(tmp_path, "--", "-k", "ipc_weights_load_bitwise", "-q")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "installing" not in proc.stdout  # everything the suite needs is in the test environment
    assert "1 passed" in proc.stdout


def test_an_empty_wheel_folder_is_refused_by_name(tmp_path):
    (tmp_path / "wheels").mkdir()
    proc = _smoke(tmp_path, "--wheels", str(tmp_path / "wheels"))
    assert proc.returncode == 1 and f"no wheels in {tmp_path / 'wheels'}" in proc.stderr


def test_a_python_without_the_assumed_packages_is_refused_by_name(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    proc = _smoke(tmp_path, python=str(bare / "bin" / "python"))
    assert proc.returncode == 1 and "cannot import torch" in proc.stderr


def test_the_pipeline_selection_is_the_one_gpu_pipeline_runs_and_the_benchmark(tmp_path):
    """`--pipeline`: what a lent one-GPU machine runs in its 15 minutes (the runs themselves pass in the dry run:
    `RLINF_PIPE_GPU_DRY_RUN=1 bash scripts/gpu_smoke.sh --pipeline`, a few minutes on 2 cores)."""
    proc = _smoke(tmp_path, "--pipeline", "--", "--collect-only", "-q")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = sorted(line.strip()[len("<Function "):-1] for line in proc.stdout.splitlines()
                       if line.strip().startswith("<Function "))
    assert collected == ["test_pipeline_against_collocated_on_the_machines_cores",
                         "test_the_hybrid_placement_on_one_gpu",
                         "test_the_pipeline_on_one_gpu_streams_and_takes_its_weights_over_ipc"]
