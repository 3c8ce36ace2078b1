"""`import_megatron_core`: megatron-core's torch.compile decorators are deferred to a function's first call."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlinf_pipe.models.megatron_import import deferred_compile


def test_deferred_compile_compiles_on_first_call_only():
    calls: list[tuple] = []

    def fake_compile(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_later = deferred_compile(fake_compile)

    @compile_later
    def plain(x):
        return x + 1

    @compile_later(dynamic=False)
    def with_options(x):
        return x * 2

    assert calls == []  # decorating compiles nothing
    assert plain.__name__ == "plain"
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_options(3) == ("compiled", 6)
    assert calls == [("plain", {}), ("with_options", {"dynamic": False})]


def test_megatron_import_leaves_dynamo_unloaded_and_torch_compile_restored():
    code = (
        "import sys, torch; real = torch.compile\n"
        "from rlinf_pipe.models.megatron_import import import_megatron_core\n"
        "import_megatron_core()\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu\n"
        "assert torch.compile is real, 'torch.compile not restored'\n"
        "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
        "print(bias_swiglu.__wrapped__.__name__)\n"  # a deferred wrapper around megatron's own function
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "bias_swiglu" in out.stderr and "ImportError" in out.stderr:
        pytest.skip("this megatron-core has no fused_bias_swiglu")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "bias_swiglu"
