"""SGLangEngine (the sglang adapter) against the CPU stand-in of `sglang.Engine` (tests/support/sglang_standin.py)."""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.sglang_standin import SGLangEngineStandin, StandinTokenizerManager
from transformers import AutoModelForCausalLM

from rlinf_pipe.engines.rollout import EngineAsleepError, GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from rlinf_pipe.engines.rollout.engine import sample_seed
from rlinf_pipe.engines.rollout.sglang import (
    INSTALL_HINT,
    SGLANG_VERSION,
    SGLangEngine,
    SGLangNotInstalledError,
    import_sglang_engine,
)
from rlinf_pipe.models.tiny import ensure_tiny_model

PROMPTS = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [99, 7, 250, 13, 8]]

# The real signatures, recorded from sglang 0.5.23 (python/sglang/srt/entrypoints/engine.py `class Engine`, and
# python/sglang/srt/managers/tokenizer_manager.py `TokenizerManager.abort_request`), annotations left out. If
# SGLANG_VERSION moves, re-record these from the new source and update the stand-in to match.
REAL_SIGNATURES_VERSION = "0.5.23"
REAL_ENGINE_SIGNATURES = {
    "__init__": "(self, **kwargs)",
    "async_generate": (
        "async (self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None, "
        "video_data=None, mm_hashes=None, mm_content_hashes=None, return_logprob=False, logprob_start_len=None, "
        "top_logprobs_num=None, token_ids_logprob=None, lora_path=None, custom_logit_processor=None, "
        "require_reasoning=False, return_hidden_states=False, return_routed_experts=False, "
        "routed_experts_start_len=0, stream=False, bootstrap_host=None, bootstrap_port=None, bootstrap_room=None, "
        "routed_dp_rank=None, disagg_prefill_dp_rank=None, kv_hints=None, data_parallel_rank=None, "
        "external_trace_header=None, rid=None, session_params=None, priority=None, session_id=None, *, "
        "cache_salt=None)"
    ),
    "shutdown": "(self)",
    "flush_cache": "(self)",
    "init_weights_update_group": (
        "(self, master_address, master_port, rank_offset, world_size, group_name, backend='nccl')"
    ),
    "destroy_weights_update_group": "(self, group_name)",
    "update_weights_from_distributed": (
        "(self, names, dtypes, shapes, group_name='weight_update_group', flush_cache=True, load_format=None)"
    ),
    "update_weights_from_tensor": "(self, named_tensors, load_format=None, flush_cache=True)",
    "release_memory_occupation": "(self, tags=None)",
    "resume_memory_occupation": "(self, tags=None)",
}
REAL_TOKENIZER_MANAGER_SIGNATURES = {"abort_request": "(self, rid='', abort_all=False)"}


def plain_signature(fn: object) -> str:
    """`(a, b=1, *, c=None)` without annotations, prefixed `async ` for coroutine functions."""
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    sig = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                      return_annotation=inspect.Signature.empty)
    return ("async " if inspect.iscoroutinefunction(fn) else "") + str(sig)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's single-token forwards are far faster on one thread on a small, shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models"), arch="qwen2")


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


def make_engine(model_path: Path, **kwargs: object) -> SGLangEngine:
    return SGLangEngine(model_path, dtype="float32", engine_factory=SGLangEngineStandin, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(model_path: Path) -> SGLangEngine:
    return make_engine(model_path)


def standin(engine: SGLangEngine) -> SGLangEngineStandin:
    assert isinstance(engine.engine, SGLangEngineStandin)
    return engine.engine


def req(rid: str, prompt: list[int], **sampling: object) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


async def run(engine: SGLangEngine, requests: list[GenerateRequest]) -> dict[str, GenerateResult]:
    return {r.request_id: r async for r in engine.generate(requests)}


def tokens(results: dict[str, GenerateResult]) -> dict[str, list[list[int]]]:
    return {k: [s.response_ids for s in r.samples] for k, r in results.items()}


# --- the stand-in matches the real Engine --------------------------------------------------------------------


def test_standin_signatures_match_recorded_sglang() -> None:
    assert REAL_SIGNATURES_VERSION == SGLANG_VERSION
    got = {name: plain_signature(getattr(SGLangEngineStandin, name)) for name in REAL_ENGINE_SIGNATURES}
    assert got == REAL_ENGINE_SIGNATURES
    got_tm = {name: plain_signature(getattr(StandinTokenizerManager, name)) for name in REAL_TOKENIZER_MANAGER_SIGNATURES}
    assert got_tm == REAL_TOKENIZER_MANAGER_SIGNATURES


def test_adapter_uses_only_recorded_engine_members() -> None:
    source = inspect.getsource(sys.modules[SGLangEngine.__module__])
    used = {m for m in REAL_ENGINE_SIGNATURES if f"engine.{m}(" in source}
    assert used >= {"async_generate", "update_weights_from_tensor", "update_weights_from_distributed",
                    "init_weights_update_group", "release_memory_occupation", "resume_memory_occupation", "shutdown"}
    assert "tokenizer_manager.abort_request(" in source


def test_engine_satisfies_protocol_and_server_args(engine: SGLangEngine, model_path: Path) -> None:
    assert isinstance(engine, RolloutEngine)
    args = standin(engine).server_args
    assert args["model_path"] == str(model_path)
    assert args["skip_tokenizer_init"] and args["enable_memory_saver"] and args["enable_weights_cpu_backup"]
    assert args["sampling_backend"] == "pytorch" and "max_running_requests" not in args
    capped = make_engine(model_path, max_batch_size=8, mem_fraction_static=0.5)
    assert standin(capped).server_args["max_running_requests"] == 8
    assert standin(capped).server_args["mem_fraction_static"] == 0.5


def test_missing_sglang_error_names_extra_and_gpu(monkeypatch: pytest.MonkeyPatch, model_path: Path) -> None:
    assert "sglang" not in sys.modules  # importing the adapter did not import sglang
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` raise ImportError
    with pytest.raises(SGLangNotInstalledError) as info:
        SGLangEngine(model_path)
    message = str(info.value)
    assert INSTALL_HINT in message and "pip install 'rlinf_pipe[sglang]'" in message and "GPU" in message
    assert isinstance(info.value, ImportError)
    with pytest.raises(ImportError, match="rollout.backend 'torch'"):
        import_sglang_engine()


# --- generation ---------------------------------------------------------------------------------------------


async def test_results_stream_as_each_finishes(engine: SGLangEngine) -> None:
    requests = [req("long", PROMPTS[0], max_new_tokens=60, ignore_eos=True, seed=0),
                req("short", PROMPTS[1], max_new_tokens=2, ignore_eos=True, seed=0)]
    order = []
    async for result in engine.generate(requests):
        order.append((result.request_id, len(result.samples[0].response_ids)))
        if result.request_id == "short":  # the long one is still running in the engine
            assert any(rid.startswith("long#") for rid in standin(engine).running)
    assert order == [("short", 2), ("long", 60)]


async def test_n_samples_fan_out_with_derived_seeds(engine: SGLangEngine) -> None:
    request = req("n", PROMPTS[0], temperature=1.0, top_k=50, top_p=0.95, max_new_tokens=10, n=4, seed=123,
                  ignore_eos=True, stop_token_ids=[7])
    before = len(standin(engine).calls_of("async_generate"))
    first = await run(engine, [request])
    calls = standin(engine).calls_of("async_generate")[before:]
    assert len(calls) == 4
    assert sorted(c["sampling_params"]["sampling_seed"] for c in calls) == sorted(sample_seed(123, k) for k in range(4))
    for c in calls:
        assert c["input_ids"] == PROMPTS[0] and c["return_logprob"] is True and c["stream"] is False
        sp = c["sampling_params"]
        assert (sp["n"], sp["top_k"], sp["top_p"], sp["max_new_tokens"]) == (1, 50, 0.95, 10)
        assert sp["stop_token_ids"] == [7] and sp["ignore_eos"] is True
    assert len({c["rid"] for c in calls}) == 4
    samples = tokens(first)["n"]
    assert len({tuple(s) for s in samples}) == 4
    assert tokens(await run(engine, [request]))["n"] == samples  # seeded: reruns repeat
    default_k = standin(engine).calls_of("async_generate")[-1]
    assert default_k["sampling_params"]["top_k"] == 50
    await run(engine, [req("d", PROMPTS[0], max_new_tokens=2)])
    assert standin(engine).calls_of("async_generate")[-1]["sampling_params"]["top_k"] == -1  # 0 -> disabled


async def test_logprobs_align_with_tokens(engine: SGLangEngine, hf_model: torch.nn.Module) -> None:
    temp = 0.7
    results = await run(engine, [req(str(i), p, temperature=temp, top_k=20, max_new_tokens=12, seed=i)
                                 for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        sample = results[str(i)].samples[0]
        assert len(sample.logprobs) == len(sample.response_ids) > 0
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + sample.response_ids])).logits[0].float()
        expected = torch.log_softmax(logits / temp, -1)[len(prompt) - 1 : -1].gather(
            -1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
        assert sample.version == engine.version


async def test_greedy_and_finish_reasons(engine: SGLangEngine) -> None:
    base = (await run(engine, [req("g", PROMPTS[2], temperature=0.0, max_new_tokens=12, ignore_eos=True)]))["g"]
    sample = base.samples[0]
    assert (sample.finish_reason, len(sample.response_ids)) == ("length", 12)
    assert base.prompt_ids == PROMPTS[2]
    assert standin(engine).calls_of("async_generate")[-1]["sampling_params"]["temperature"] == 0.0
    sampled = (await run(engine, [req("s", PROMPTS[2], max_new_tokens=12, ignore_eos=True, seed=5)]))["s"].samples[0]
    ids = sampled.response_ids
    cut = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    stopped = (await run(engine, [req("s", PROMPTS[2], max_new_tokens=12, ignore_eos=True, seed=5,
                                      stop_token_ids=[ids[cut]])]))["s"].samples[0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_ids == ids[: cut + 1] and stopped.logprobs == sampled.logprobs[: cut + 1]


def test_output_mapping_checks_alignment_and_reasons() -> None:
    def out(ids: list[int], lp_ids: list[int], reason: object) -> dict[str, object]:
        return {"output_ids": ids, "meta_info": {"id": "x", "finish_reason": reason,
                                                 "output_token_logprobs": [(-0.5, t, None) for t in lp_ids]}}

    s = SGLangEngine._to_sample(out([1, 2], [1, 2], {"type": "length", "length": 2}), 3)
    assert (s.response_ids, s.logprobs, s.finish_reason, s.version) == ([1, 2], [-0.5, -0.5], "length", 3)
    trimmed = SGLangEngine._to_sample(out([1], [1, 9], {"type": "stop", "matched": 9}), 0)
    assert trimmed.response_ids == [1, 9] and trimmed.finish_reason == "stop"  # the stop token is kept
    assert SGLangEngine._to_sample(out([], [], {"type": "abort", "message": "Aborted"}), 0).finish_reason == "abort"
    with pytest.raises(RuntimeError, match="disagree"):
        SGLangEngine._to_sample(out([1, 2], [1, 3], {"type": "length", "length": 2}), 0)
    with pytest.raises(RuntimeError, match="finish_reason"):
        SGLangEngine._to_sample(out([1], [1], None), 0)


async def test_abort_ends_running_requests(model_path: Path) -> None:
    engine = make_engine(model_path)
    requests = [req("short", PROMPTS[0], max_new_tokens=3, ignore_eos=True, seed=0),
                req("running", PROMPTS[1], max_new_tokens=400, ignore_eos=True, seed=0, n=2)]
    results = {}
    async for result in engine.generate(requests):
        results[result.request_id] = result
        if result.request_id == "short":
            engine.abort()
    assert results["short"].samples[0].finish_reason == "length"
    aborted = standin(engine).calls_of("abort_request")
    assert len(aborted) == 2 and all(c["rid"].startswith("running#") and not c["abort_all"] for c in aborted)
    for s in results["running"].samples:
        assert s.finish_reason == "abort" and 0 < len(s.response_ids) < 400 and len(s.logprobs) == len(s.response_ids)
    again = await run(engine, [req("x", PROMPTS[0], max_new_tokens=4, ignore_eos=True)])
    assert again["x"].samples[0].finish_reason == "length"


async def test_early_exit_aborts_this_calls_requests(model_path: Path) -> None:
    engine = make_engine(model_path)
    gen = engine.generate([req("a", PROMPTS[0], max_new_tokens=2, ignore_eos=True),
                           req("b", PROMPTS[1], max_new_tokens=300, ignore_eos=True)])
    first = await gen.__anext__()
    assert first.request_id == "a"
    await gen.aclose()
    assert [c["rid"].split("#")[0] for c in standin(engine).calls_of("abort_request")] == ["b"]
    await asyncio.sleep(0)
    assert not standin(engine).running


# --- weights ------------------------------------------------------------------------------------------------


async def test_update_weights_buckets_and_versions(model_path: Path) -> None:
    engine = make_engine(model_path, bucket_bytes=64 * 1024)
    fake = standin(engine)
    request = req("w", PROMPTS[0], temperature=0.0, max_new_tokens=10, ignore_eos=True)
    before = await run(engine, [request])
    original = {k: v.detach().clone() for k, v in fake.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    noisy = [(k, v + 0.5 * torch.randn(v.shape, generator=gen)) for k, v in original.items()]
    engine.update_weights(iter(noisy), version=3)
    calls = fake.calls_of("update_weights_from_tensor")
    sizes = [sum(original[n].numel() * 4 for n in c["names"]) for c in calls]
    assert len(calls) > 2 and [n for c in calls for n in c["names"]] == [n for n, _ in noisy]
    assert all(s <= 64 * 1024 or len(c["names"]) == 1 for s, c in zip(sizes, calls, strict=True))
    assert [c["flush_cache"] for c in calls] == [False] * len(calls)
    assert len(fake.calls_of("flush_cache")) == 1  # once the whole version is in
    assert all(c["load_format"] is None for c in calls)
    after = await run(engine, [request])
    assert engine.version == 3 and after["w"].samples[0].version == 3
    assert tokens(after) != tokens(before)
    engine.update_weights(original.items(), version=4)
    assert tokens(await run(engine, [request])) == tokens(before)

    with pytest.raises(ValueError, match=r"update_weights_from_tensor failed.*q_proj\.wieght"):
        engine.update_weights([("model.layers.0.self_attn.q_proj.wieght", torch.zeros(1))], version=5)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.update_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))], version=5)
    with pytest.raises(TypeError, match=r"\(str, torch.Tensor\)"):
        engine.update_weights([("model.norm.weight", [1.0])], version=5)  # type: ignore[list-item]
    assert engine.version == 4


def test_distributed_weight_path(model_path: Path) -> None:
    engine = make_engine(model_path)
    specs = [("model.norm.weight", torch.bfloat16, (64,)), ("lm_head.weight", "float32", torch.Size([10, 64]))]
    with pytest.raises(ValueError, match="not initialized"):
        engine.update_weights_from_distributed(specs, version=1)
    assert engine.version == 0
    engine.init_weight_sync_group("10.0.0.1", 29500, rank_offset=1, world_size=2)
    assert standin(engine).calls_of("init_weights_update_group")[-1] == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
        "group_name": "weight_update_group", "backend": "nccl"}
    engine.update_weights_from_distributed(specs, version=2, flush_cache=False)
    call = standin(engine).calls_of("update_weights_from_distributed")[-1]
    assert call["dtypes"] == ["bfloat16", "float32"] and call["shapes"] == [[64], [10, 64]]
    assert call["names"] == ["model.norm.weight", "lm_head.weight"] and call["flush_cache"] is False
    assert engine.version == 2


# --- memory -------------------------------------------------------------------------------------------------


async def test_sleep_wake_use_memory_apis(model_path: Path) -> None:
    engine = make_engine(model_path)
    fake = standin(engine)
    requests = [req(str(i), p, temperature=1.0, max_new_tokens=6, seed=i) for i, p in enumerate(PROMPTS)]
    before = await run(engine, requests)
    engine.sleep()
    engine.sleep()  # idempotent
    assert fake.calls_of("release_memory_occupation") == [{"tags": ["kv_cache", "weights", "cuda_graph"]}]
    with pytest.raises(EngineAsleepError, match="wake"):
        await run(engine, requests)
    state = {k: v.clone() for k, v in fake.model.state_dict().items()}
    engine.update_weights(state.items(), version=1)  # while asleep: weights come back first
    assert fake.calls_of("resume_memory_occupation") == [{"tags": ["weights"]}]
    engine.wake()
    assert fake.calls_of("resume_memory_occupation")[-1] == {"tags": ["kv_cache", "cuda_graph"]}
    assert not fake.released
    assert tokens(await run(engine, requests)) == tokens(before)
    engine.shutdown()
    assert fake.is_shut_down
