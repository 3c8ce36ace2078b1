"""The pins pass of scripts/test.sh (in .venv-pins, `bash scripts/setup.sh pins`): this environment has the
transformers / tokenizers / huggingface_hub versions of constraints-sglang.txt, and the `sglang` extra still
resolves against the registry to them, with the torch, CUDA and wheel tags the node checks assume. Skipped outside
that pass (the resolution takes most of a minute), and where the registry cannot be reached."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlinf_pipe.engines.rollout.sglang_launch import SGLANG_VERSION
from rlinf_pipe.engines.rollout.sglang_node import SGLANG_CUDA_MAJOR

ROOT = Path(__file__).resolve().parents[2]
PINS_PASS_ENV = "RLINF_PIPE_PINS_PASS"
pytestmark = pytest.mark.skipif(os.environ.get(PINS_PASS_ENV) != "1",
                                reason="runs in the pins pass of scripts/test.sh (bash scripts/setup.sh pins)")


def pins() -> dict[str, str]:
    """constraints-sglang.txt as {normalised name: version}."""
    lines = (line.split("#")[0].strip() for line in (ROOT / "constraints-sglang.txt").read_text().splitlines())
    return {name.lower().replace("_", "-"): version for name, version in (line.split("==") for line in lines if line)}


def test_this_environment_runs_sglangs_pins():
    for name, version in pins().items():
        assert importlib.metadata.version(name) == version, name


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """What `pip install -e '.[sglang]'` would install here, from the registry (pip's report of a dry run)."""
    probe = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"], capture_output=True, text=True,
                           timeout=60, check=False)
    if probe.returncode or SGLANG_VERSION not in probe.stdout:
        pytest.skip(f"the registry does not answer for sglang here: {(probe.stderr or probe.stdout).strip()[-200:]}")
    report = tmp_path_factory.mktemp("pins") / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), "-e", f"{ROOT}[sglang]"], capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, f"the sglang extra no longer resolves: {proc.stderr[-2000:]}"
    return {item["metadata"]["name"].lower().replace("_", "-"): item for item in json.loads(report.read_text())["install"]}


def test_the_sglang_extra_still_resolves_to_the_pins(resolved):
    versions = {name: item["metadata"]["version"] for name, item in resolved.items()}
    assert versions["sglang"] == SGLANG_VERSION
    assert {name: versions.get(name) for name in pins()} == pins(), "update constraints-sglang.txt"
    assert versions["megatron-core"].startswith("0.16.")


def test_the_extra_pulls_the_cuda_and_wheels_the_node_checks_assume(resolved):
    """torch's CUDA build and sglang's cuda-python (`sglang_node.SGLANG_CUDA_MAJOR`), and sglang's only wheels being
    manylinux_2_34 for CPython 3.11-3.13 (scripts/setup.sh refuses the rest)."""
    cuda_runtime = resolved["nvidia-cuda-runtime"]["metadata"]["version"]
    assert int(cuda_runtime.split(".")[0]) == SGLANG_CUDA_MAJOR
    assert int(resolved["cuda-python"]["metadata"]["version"].split(".")[0]) == SGLANG_CUDA_MAJOR
    wheel = resolved["sglang"]["download_info"]["url"].rsplit("/", 1)[-1]
    assert re.search(r"-cp31[123]-cp31[123]-manylinux_2_34_", wheel), wheel
