"""The SGLang contract: what `scripts/sglang_contract.py` extracts from the real sglang 0.5.23 wheel (checked in at
tests/support/sglang_contract.json) holds the CPU stand-in and the adapter to the real API: the stand-in's methods
have the real parameters and block the way the real ones do, its request classes have the real fields, and the
adapter calls nothing the contract does not list."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import sglang_standin
from support.sglang_standin.engine import Engine
from support.sglang_standin.tokenizer_manager import StandinTokenizerManager

from rlinf_pipe.engines.rollout import sglang_engine, sglang_host, sglang_launch, sglang_requests, sglang_weights
from rlinf_pipe.models.tiny import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = sglang_standin.CONTRACT
ADAPTER_SOURCES = [Path(m.__file__) for m in (sglang_engine, sglang_host, sglang_launch, sglang_requests,
                                               sglang_weights)]


def params(fn: object) -> list[str]:
    """A signature's parameters after `self`, as the contract writes them."""
    out: list[str] = []
    star_done = False
    for p in list(inspect.signature(fn).parameters.values())[1:]:  # type: ignore[arg-type]
        if p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
            continue
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star_done = True
            continue
        if p.kind is p.KEYWORD_ONLY and not star_done:
            out.append("*")
            star_done = True
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return out


@pytest.mark.parametrize("cls, key", [(Engine, "engine_methods"), (StandinTokenizerManager,
                                                                    "tokenizer_manager_methods")])
def test_standin_methods_have_the_real_parameters(cls: type, key: str) -> None:
    assert CONTRACT["sglang_version"] == sglang_launch.SGLANG_VERSION
    for name, real in CONTRACT[key].items():
        method = getattr(cls, name)
        assert params(method) == real["params"], name
        is_async = inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method)
        assert is_async == real["async"], name


def test_standin_request_classes_have_the_real_fields() -> None:
    for name, fields in CONTRACT["request_classes"].items():
        cls = getattr(sglang_standin.io_struct, name)
        assert list(cls.__struct_fields__) == [f for f, _ in fields] + ["rid"], name
        required = {f: 0 for f, source in fields if source is None}
        instance = cls(**required)
        for field, source in fields:
            if source is not None:
                assert getattr(instance, field) == ast.literal_eval(source), (name, field)


def test_the_real_engine_has_no_tokenizer_and_the_standin_neither(tmp_path_factory: pytest.TempPathFactory) -> None:
    assert CONTRACT["engine_assigns_self_tokenizer"] is False
    path = ensure_tiny_model(tmp_path_factory.mktemp("models"), arch="qwen2")
    engine = Engine(model_path=str(path), skip_tokenizer_init=True)
    assert not hasattr(engine, "tokenizer") and engine.tokenizer_manager.tokenizer is None
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        Engine(model_path=str(path), tensor_parallel_size=2)  # a CLI alias, not a field


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # as with the real Engine
async def test_blocking_methods_cannot_run_inside_a_running_loop(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The bite of sglang's Engine in an async actor: built inside the loop it captures that loop, and a blocking
    method then calls `run_until_complete` on the running loop."""
    path = ensure_tiny_model(tmp_path_factory.mktemp("models"), arch="qwen2")
    engine = Engine(model_path=str(path), skip_tokenizer_init=True)
    assert engine.loop is asyncio.get_running_loop()
    blocking = [m for m, real in CONTRACT["engine_methods"].items() if real["blocks_on_engine_loop"]]
    assert {"begin_weight_update", "release_memory_occupation", "update_weights_from_tensor"} <= set(blocking)
    with pytest.raises(RuntimeError, match="already running"):
        engine.flush_cache()
    with pytest.raises(RuntimeError, match="already running"):
        engine.release_memory_occupation()
    # built in a thread without a loop, it captures a loop of its own, which the thread can drive
    other = await asyncio.to_thread(Engine, model_path=str(path), skip_tokenizer_init=True)
    assert other.loop is not asyncio.get_running_loop()
    assert (await asyncio.to_thread(other.flush_cache)).success
    await asyncio.to_thread(other.shutdown)  # its scheduler task ends on its loop, not left pending there
    assert other.scheduler.task.done()


def _adapter_trees() -> list[ast.Module]:
    return [ast.parse(path.read_text()) for path in ADAPTER_SOURCES]


def test_the_adapter_calls_only_what_the_contract_lists() -> None:
    tm_methods = set(CONTRACT["tokenizer_manager_methods"])
    classes = {**CONTRACT["request_classes"], "GenerateReqInput": list(CONTRACT["generate_request_fields"].items())}
    used_tm, used_classes = set(), set()
    for tree in _adapter_trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            # self.call("method", ...) / engine.call("method", ...): a tokenizer-manager coroutine by name
            if isinstance(func, ast.Attribute) and func.attr == "call" and node.args and isinstance(
                    node.args[0], ast.Constant):
                used_tm.add(node.args[0].value)
            # <...>.tm.<method>(...) / tm.<method>(...)
            if isinstance(func, ast.Attribute) and (isinstance(func.value, ast.Attribute) and func.value.attr == "tm"
                                                    or isinstance(func.value, ast.Name) and func.value.id == "tm"):
                used_tm.add(func.attr)
            # <...>.requests.<Class>(field=...)
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute) and \
                    func.value.attr == "requests":
                used_classes.add(func.attr)
                fields = {f for f, _ in classes.get(func.attr, [])}
                assert {k.arg for k in node.keywords} <= fields, func.attr
    assert used_tm <= tm_methods, used_tm - tm_methods
    assert used_classes <= set(classes), used_classes - set(classes)
    assert {"begin_weight_update", "end_weight_update", "update_weights_from_tensor", "update_weights_from_distributed",
            "init_weights_update_group", "release_memory_occupation", "resume_memory_occupation", "flush_cache",
            "abort_request", "get_weights_by_name", "generate_request"} <= used_tm
    assert sglang_requests.REQUEST_DISPATCHED in CONTRACT["req_state_fields"]  # (what the aborts wait for)
    args = sglang_launch.server_args("m", tp_size=2, mem_fraction_static=0.5, max_running_requests=8, seed=3,
                                     deterministic=True, dtype="auto", cpu_backup=False)
    assert set(args) <= set(CONTRACT["server_args"])


def test_the_adapter_never_calls_a_blocking_engine_method() -> None:
    blocking = {m for m, real in CONTRACT["engine_methods"].items() if real["blocks_on_engine_loop"]}
    for tree in _adapter_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
                    node.func.value, ast.Attribute) and node.func.value.attr == "engine":
                assert node.func.attr not in blocking, node.func.attr


def test_the_checked_in_contract_is_what_the_wheel_says(tmp_path_factory: pytest.TempPathFactory,
                                                        request: pytest.FixtureRequest) -> None:
    """Re-extract the contract from the real wheel (downloaded once into pytest's cache, without dependencies)."""
    pytest_cache = getattr(request.config, "cache", None)  # None with `-p no:cacheprovider`: download each time
    cache = Path(pytest_cache.mkdir("sglang_wheel") if pytest_cache else tmp_path_factory.mktemp("sglang_wheel"))
    if not list(cache.glob("sglang-*.whl")):
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"sglang=={sglang_launch.SGLANG_VERSION}", "--no-deps", "-q",
             "-d", str(cache)], capture_output=True, text=True, timeout=300, check=False)
        if download.returncode:
            pytest.skip(f"cannot download the sglang wheel here: {download.stderr.strip()[-300:]}")
    wheel = next(cache.glob("sglang-*.whl"))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sglang_contract.py"), "--wheel", str(wheel)],
                         capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout) == CONTRACT
