"""The layering (pyproject.toml's import-linter contracts, docs/architecture.md) holds and bites: a backwards
import breaks it, and importing a worker loads nothing of the driver stack."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=package_parent, env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (the test extra)")
def test_a_backwards_import_breaks_the_contract(tmp_path):
    copy = tmp_path / "rlinf_pipe"
    shutil.copytree(ROOT / "rlinf_pipe", copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert lint_imports(tmp_path).returncode == 0
    worker = copy / "workers" / "reward.py"
    worker.write_text(worker.read_text() + "\nfrom rlinf_pipe.runner.entry import run  # noqa\n")
    estimate = copy / "planning" / "memory.py"
    estimate.write_text(estimate.read_text() + "\nimport ray  # noqa\nfrom rlinf_pipe.engines.rollout import factory  # noqa\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "rlinf_pipe.workers is not allowed to import rlinf_pipe.runner" in broken.stdout
    assert "Planning runs without Ray and without any engine BROKEN" in broken.stdout
    assert "rlinf_pipe.planning.memory -> ray" in broken.stdout
    assert "rlinf_pipe.planning is not allowed to import rlinf_pipe.engines" in broken.stdout


WORKERS = ["rlinf_pipe.workers.reward", "rlinf_pipe.workers.rollout", "rlinf_pipe.workers.inference",
           "rlinf_pipe.workers.actor"]


def test_importing_a_worker_loads_no_driver_stack():
    """One fresh interpreter imports the workers one after another and lists, after each, the driver modules loaded
    so far: the first worker whose import pulls one in is named (the lightest first)."""
    code = (
        "import importlib, json, sys\n"
        f"for module in {WORKERS!r}:\n"
        "    importlib.import_module(module)\n"
        "    print(json.dumps([module, sorted(m for m in sys.modules if m.startswith(('rlinf_pipe.runner', "
        "'rlinf_pipe.cli')))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    loaded = [json.loads(line) for line in out.stdout.splitlines()]
    assert [module for module, _ in loaded] == WORKERS
    assert [(module, driver) for module, driver in loaded if driver] == []
