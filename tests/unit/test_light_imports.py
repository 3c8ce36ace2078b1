"""Processes that need one light module do not load torch, transformers' model classes or math-verify's sympy (each
costs a second or more of CPU per process at launch, on cores the other workers are starting on)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = {
    # the channel registry, a Ray helper actor: sockets and msgpack only
    "rlinf_pipe.scheduler.channel": ("torch", "transformers"),
    # resolving the tiny model's cached folder (its builders import what they need when called)
    "rlinf_pipe.models.resolve": ("torch", "transformers"),
    # the checks a run passes before Ray starts, model names included
    "rlinf_pipe.runner.preflight": ("transformers",),
    # the driver's sampling settings
    "rlinf_pipe.engines.rollout.factory": ("transformers",),
    # the driver's dataset and prompts (answer extraction's thinking modes, not the scorer)
    "rlinf_pipe.runner.driver_inputs": ("sympy", "math_verify"),
}


@pytest.mark.parametrize("module", sorted(CASES))
def test_module_does_not_load(module):
    heavy = CASES[module]
    code = f"import sys, {module}; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing {module} loaded {out.stdout.strip()}"
