"""Processes that need one light module do not load torch, transformers' model classes or math-verify's sympy (each
costs a second or more of CPU per process at launch, on cores the other workers are starting on)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = {
    # the channel registry, a Ray helper actor: sockets and msgpack only
    "rlinf_pipe.channels": ("torch", "transformers"),
    # resolving the tiny model's cached folder (its builders import what they need when called)
    "rlinf_pipe.models.resolve": ("torch", "transformers"),
    # the checks a run passes before Ray starts, model names included (its config errors show in about a second)
    "rlinf_pipe.runner.preflight": ("torch", "transformers"),
    # the names of the advantage estimators and weight transports, which those checks take
    "rlinf_pipe.algorithms": ("torch",),
    "rlinf_pipe.weights": ("torch",),
    # the driver's sampling settings
    "rlinf_pipe.engines.rollout.factory": ("transformers",),
    # the driver's dataset and prompts (answer extraction's thinking modes, not the scorer)
    "rlinf_pipe.runner.driver_inputs": ("sympy", "math_verify"),
    # the reward worker: it quick-scores integers itself and hands the rest to its pool's processes
    "rlinf_pipe.workers.reward": ("sympy", "math_verify"),
}


@pytest.mark.parametrize("module", sorted(CASES))
def test_module_does_not_load(module):
    heavy = CASES[module]
    code = f"import sys, {module}; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing {module} loaded {out.stdout.strip()}"


@pytest.mark.parametrize("overrides", [[], ["algorithm.dynamic_sampling=true"]], ids=["default", "dynamic-sampling"])
def test_a_runs_checks_before_ray_starts_load_no_torch(overrides):
    # Its config errors show in about a second: the estimator's scope and the transports' names are known without
    # their code.
    code = ("import sys; from rlinf_pipe.config import load_config; from rlinf_pipe.runner.preflight import preflight; "
            f"p = preflight(load_config(overrides={overrides!r})); print(p.plan.dynamic_sampling, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(bool(overrides)), "False"]


def test_the_first_full_score_in_a_process_loads_math_verify_outside_its_time_limit():
    # math-verify loads on first use (about a second, and its grammar warms on the first parse): inside `deadline`
    # its timer would cut the import short and score a right answer as timed out. What the time limit sees is
    # recorded where it starts, so the check does not depend on how busy the machine is.
    code = (
        "import contextlib, sys\n"
        "from rlinf_pipe.engines.reward import verify\n"
        "assert 'sympy' not in sys.modules\n"
        "seen, real = [], verify.deadline\n"
        "@contextlib.contextmanager\n"
        "def watched(timeout_s):\n"
        "    seen.append(('sympy' in sys.modules, 'math_verify' in sys.modules, verify._math_verify.cache_info().currsize))\n"
        "    with real(timeout_s):\n"
        "        yield\n"
        "verify.deadline = watched\n"
        "r = verify.score('\\\\boxed{\\\\frac{1}{2}}', '0.5', timeout_s=30)\n"
        "print(r.correct, r.timed_out, seen)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True False [(True, True, 1)]"


def test_an_engine_on_a_llama_family_model_does_not_load_transformers_model_classes(tmp_path):
    # The rollout worker's engine: transformers' model modules load TorchDynamo and DTensor (2-3 s of CPU per
    # rollout worker at launch); its Llama-family models load without them (`engines/rollout/lean_model.py`).
    from rlinf_pipe.models import ensure_tiny_model

    folder = ensure_tiny_model(tmp_path)
    heavy = ("transformers.modeling_utils", "torch._dynamo", "torch.distributed.tensor")
    code = (f"import sys; from rlinf_pipe.engines.rollout import TorchEngine; e = TorchEngine({str(folder)!r}); "
            f"print(type(e.model).__name__, [m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["LeanCausalLM", "[]"]


def test_the_drivers_memory_estimate_of_the_tiny_model_reads_its_config_only():
    # transformers' Llama config module loads DTensor and sympy (about 2 s of CPU); the tiny model is a Qwen2.
    heavy = ("torch.distributed.tensor", "sympy", "transformers.models.llama.configuration_llama")
    code = ("import sys; from rlinf_pipe.models.arch import model_config; config, _ = model_config('tiny'); "
            f"print(config.model_type, [m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["qwen2", "[]"]


def test_a_megatron_policy_on_a_llama_model_does_not_import_transformers(tmp_path):
    # The actor and log-prob workers read the model's config.json themselves (`models/hf_config.py`) and get the
    # pad id from the driver: transformers (and through its Llama config, DTensor's sympy) stays out of them.
    from rlinf_pipe.models import ensure_tiny_model
    from rlinf_pipe.utils.net import free_port

    folder = ensure_tiny_model(tmp_path, arch="llama")
    code = (
        "import os, sys, torch.distributed as dist; "
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1); "
        "from rlinf_pipe.models.megatron_gpt import init_model_parallel; init_model_parallel(1, 1); "
        "from rlinf_pipe.engines.policy.policy import MegatronPolicy; "
        f"p = MegatronPolicy({str(folder)!r}, train=True); "
        "print(p.arch.model_type, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["llama", "False"]
