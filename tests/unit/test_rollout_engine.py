"""TorchEngine on the tiny Qwen2 model: sampling semantics, streaming, weights, abort, sleep/wake."""

from __future__ import annotations

import inspect

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlinf_pipe.engines.rollout import (
    EngineAsleepError,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    SamplingParams,
    TorchEngine,
    to_rollout_samples,
)
from rlinf_pipe.models.tiny import ensure_tiny_model

PROMPTS = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [99, 7, 250, 13, 8]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models"), arch="qwen2")


@pytest.fixture(scope="module")
def engine(model_path: Path) -> TorchEngine:
    return TorchEngine(model_path, max_batch_size=16)


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


def req(rid: str, prompt: list[int], **sampling: object) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


async def run(engine: TorchEngine, requests: list[GenerateRequest]) -> dict[str, GenerateResult]:
    return {r.request_id: r async for r in engine.generate(requests)}


def tokens(results: dict[str, GenerateResult]) -> dict[str, list[list[int]]]:
    return {k: [s.response_ids for s in r.samples] for k, r in results.items()}


def test_engine_satisfies_protocol(engine: TorchEngine) -> None:
    assert isinstance(engine, RolloutEngine)
    assert engine.tokenizer.eos_token_id in engine.eos_ids


async def test_greedy_matches_hand_rolled_loop(engine: TorchEngine, hf_model: torch.nn.Module) -> None:
    results = await run(engine, [req(str(i), p, temperature=0.0, max_new_tokens=12) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for _ in range(12):
            with torch.no_grad():
                nxt = int(hf_model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            if nxt in engine.eos_ids:
                break
        assert results[str(i)].samples[0].response_ids == seq[len(prompt):]


async def test_logprobs_are_temperature_scaled_before_truncation(
    engine: TorchEngine, hf_model: torch.nn.Module
) -> None:
    temp, top_k = 0.7, 20
    requests = [req(str(i), p, temperature=temp, top_k=top_k, top_p=0.9, max_new_tokens=16, seed=i)
                for i, p in enumerate(PROMPTS)]
    results = await run(engine, requests)
    for i, prompt in enumerate(PROMPTS):
        sample = results[str(i)].samples[0]
        full = torch.tensor([prompt + sample.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(full).logits[0].float() / temp, dim=-1)
        rows = logp[len(prompt) - 1 : -1]
        ids = torch.tensor(sample.response_ids)
        expected = rows.gather(-1, ids[:, None]).squeeze(-1)
        assert len(sample.logprobs) == len(sample.response_ids)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
        # truncation applies to the sampling: every token is within the top-k of its step
        ranks = (rows > expected[:, None]).sum(-1)
        assert int(ranks.max()) < top_k


async def test_seeded_sample_does_not_depend_on_batch(engine: TorchEngine) -> None:
    target = req("t", PROMPTS[1], temperature=1.0, max_new_tokens=24, seed=7, ignore_eos=True)
    alone = await run(engine, [target])
    others = [req("a", PROMPTS[0], temperature=0.5, top_p=0.8, max_new_tokens=5, seed=1),
              req("b", PROMPTS[2] * 3, temperature=1.0, max_new_tokens=30, seed=2, n=3)]
    batched = await run(engine, [others[0], target, others[1]])
    assert alone["t"].samples[0].response_ids == batched["t"].samples[0].response_ids


async def test_n_samples_differ_and_reruns_repeat(engine: TorchEngine) -> None:
    request = req("n", PROMPTS[0], temperature=1.0, max_new_tokens=10, n=4, seed=123, ignore_eos=True)
    first, second = await run(engine, [request]), await run(engine, [request])
    samples = tokens(first)["n"]
    assert len(samples) == 4
    assert len({tuple(s) for s in samples}) == 4
    assert samples == tokens(second)["n"]
    other_seed = await run(engine, [req("n", PROMPTS[0], temperature=1.0, max_new_tokens=10, n=4, seed=124,
                                        ignore_eos=True)])
    assert tokens(other_seed)["n"] != samples


async def test_max_new_tokens_gives_length(engine: TorchEngine) -> None:
    result = (await run(engine, [req("l", PROMPTS[0], max_new_tokens=5, seed=0, ignore_eos=True)]))["l"]
    sample = result.samples[0]
    assert (sample.finish_reason, len(sample.response_ids), len(sample.logprobs)) == ("length", 5, 5)
    assert result.prompt_ids == PROMPTS[0]
    assert sample.version == engine.version == 0


async def test_stop_token_is_included_and_ends_sample(engine: TorchEngine) -> None:
    base = (await run(engine, [req("s", PROMPTS[2], max_new_tokens=12, ignore_eos=True, seed=5)]))["s"]
    ids = base.samples[0].response_ids
    cut = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    stopped = (await run(engine, [req("s", PROMPTS[2], max_new_tokens=12, ignore_eos=True, seed=5,
                                      stop_token_ids=[ids[cut]])]))["s"].samples[0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_ids == ids[: cut + 1]  # the stop token is kept ...
    assert stopped.logprobs == base.samples[0].logprobs[: cut + 1]  # ... and has its log-prob


async def test_results_stream_as_each_finishes(engine: TorchEngine) -> None:
    requests = [req("long", PROMPTS[0], max_new_tokens=150, ignore_eos=True, seed=0),
                req("short", PROMPTS[1], max_new_tokens=2, ignore_eos=True, seed=0)]
    order = []
    async for result in engine.generate(requests):
        order.append((result.request_id, len(result.samples[0].response_ids)))
    assert order == [("short", 2), ("long", 150)]


async def test_update_weights_changes_outputs_and_version(model_path: Path) -> None:
    engine = TorchEngine(model_path)
    request = req("w", PROMPTS[0], temperature=0.0, max_new_tokens=10, ignore_eos=True)
    before = await run(engine, [request])
    original = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    noisy = [(k, v + 0.5 * torch.randn(v.shape, generator=gen)) for k, v in original.items() if k.endswith("weight")]
    await engine.update_weights(noisy, version=3)
    after = await run(engine, [request])
    assert engine.version == 3 and after["w"].samples[0].version == 3
    assert tokens(after) != tokens(before)
    await engine.update_weights(original.items(), version=4)
    assert tokens(await run(engine, [request])) == tokens(before)

    with pytest.raises(ValueError, match=r"unknown parameter name 'model\.layers\.0\.self_attn\.q_proj\.wieght'"):
        await engine.update_weights([("model.layers.0.self_attn.q_proj.wieght", torch.zeros(1))], version=5)
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=rf"shape mismatch for '{name}': got \(3, 3\)"):
        await engine.update_weights([(name, torch.zeros(3, 3))], version=5)
    assert engine.version == 4


async def test_abort_ends_running_and_pending_requests(model_path: Path) -> None:
    engine = TorchEngine(model_path, max_batch_size=2)
    requests = [req("short", PROMPTS[0], max_new_tokens=3, ignore_eos=True, seed=0),
                req("running", PROMPTS[1], max_new_tokens=400, ignore_eos=True, seed=0),
                req("pending", PROMPTS[2], max_new_tokens=400, ignore_eos=True, seed=0)]
    results = {}
    async for result in engine.generate(requests):
        results[result.request_id] = result.samples[0]
        if result.request_id == "short":
            engine.abort()
    assert results["short"].finish_reason == "length"
    running, pending = results["running"], results["pending"]
    assert running.finish_reason == pending.finish_reason == "abort"
    assert 0 < len(running.response_ids) < 400 and len(running.logprobs) == len(running.response_ids)
    assert pending.response_ids == [] and pending.logprobs == []
    # a later call is not affected
    again = await run(engine, [req("x", PROMPTS[0], max_new_tokens=4, ignore_eos=True)])
    assert again["x"].samples[0].finish_reason == "length"


async def test_sleep_wake_round_trip(engine: TorchEngine) -> None:
    requests = [req(str(i), p, temperature=1.0, max_new_tokens=8, seed=i) for i, p in enumerate(PROMPTS)]
    before = await run(engine, requests)
    await engine.sleep()
    with pytest.raises(EngineAsleepError, match="wake"):
        await run(engine, requests)
    await engine.wake()
    assert tokens(await run(engine, requests)) == tokens(before)


async def test_to_rollout_samples(engine: TorchEngine) -> None:
    result = (await run(engine, [req("r", PROMPTS[0], max_new_tokens=6, n=2, seed=3)]))["r"]
    samples = to_rollout_samples(result, engine.tokenizer)
    assert len(samples) == 2
    for out, s in zip(samples, result.samples, strict=True):
        assert out.response_ids.dtype == np.int32 and out.logprobs.dtype == np.float32
        assert out.response_ids.tolist() == s.response_ids and out.finish_reason == s.finish_reason
        assert out.version == s.version
        assert out.text == engine.tokenizer.decode(s.response_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "bad", [{"temperature": -1.0}, {"top_p": 0.0}, {"max_new_tokens": 0}, {"n": 0}]
)
def test_sampling_params_validation(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_empty_prompt_rejected() -> None:
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        GenerateRequest(request_id="e", prompt_ids=[])


async def test_the_documented_echo_backend_is_an_engine() -> None:
    """docs/backends.md's minimal backend satisfies the protocol, generates, and takes a weight session."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "backends.md").read_text()
    block = doc.split("A minimal (echo) backend")[1].split("```python\n")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(block, "docs/backends.md", "exec"), namespace)  # noqa: S102 - our own documentation
    echo = namespace["EchoEngine"]()
    assert isinstance(echo, RolloutEngine)
    for name in [n for n in dir(RolloutEngine) if not n.startswith("_") and callable(getattr(RolloutEngine, n))]:
        expected = list(inspect.signature(getattr(RolloutEngine, name)).parameters)
        assert list(inspect.signature(getattr(type(echo), name)).parameters) == expected, name  # (isinstance: names)
    out = await run(echo, [req("a", [3, 4], max_new_tokens=2, n=2)])
    assert [s.response_ids for s in out["a"].samples] == [[4, 4], [4, 4]]
    await echo.update_weights([("w", torch.zeros(1))], version=3)
    assert echo.version == 3


async def test_a_small_first_batch_finishes_its_requests_first_and_samples_the_same(model_path: Path) -> None:
    """`first_batch_size`: the call's first batch holds only that many rows, so its requests come back first (here
    request 0, whose rows are the longest and would finish last in one batch of all); every sample stays the same."""
    requests = [req("0", PROMPTS[0], n=2, max_new_tokens=10, ignore_eos=True, seed=0)] + [
        req(str(i), PROMPTS[i % 3], n=2, max_new_tokens=2, ignore_eos=True, seed=i) for i in range(1, 4)]
    one_batch = TorchEngine(model_path, max_batch_size=8)
    ramped = TorchEngine(model_path, max_batch_size=8, first_batch_size=2)
    assert (one_batch.first_batch_size, ramped.first_batch_size) == (8, 2)
    whole = [r async for r in one_batch.generate(requests)]
    first = [r async for r in ramped.generate(requests)]
    assert whole[-1].request_id == "0" and first[0].request_id == "0"
    assert tokens({r.request_id: r for r in whole}) == tokens({r.request_id: r for r in first})
    with pytest.raises(ValueError, match="first_batch_size"):
        TorchEngine(model_path, first_batch_size=0)


async def test_the_decode_steps_and_prefills_are_timed_by_batch_size(model_path: Path) -> None:
    """Every step samples a token for each row decoding: the rows x steps recorded add up to the tokens generated;
    each distinct prompt is prefilled once (a request's samples share it)."""
    engine = TorchEngine(model_path, max_batch_size=4, first_batch_size=2)
    requests = [req(str(i), p, n=3, max_new_tokens=6 + 3 * i, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS)]
    results = await run(engine, requests)
    timing = engine.timing.take()
    generated = sum(len(s.response_ids) for r in results.values() for s in r.samples)
    assert sum(rows * steps for rows, steps, _ in timing["decode_steps"]) == generated
    assert all(1 <= rows <= 4 and seconds > 0 for rows, _, seconds in timing["decode_steps"])
    # batches of 2, 4, 3 rows (9 samples): prompt 0's; 0's and 1's; 2's: each prefilled once per batch
    assert timing["prefill"][0] == len(PROMPTS[0]) + (len(PROMPTS[0]) + len(PROMPTS[1])) + len(PROMPTS[2])
    assert timing["prefill"][1] > 0
    assert timing["decode_calls"] >= len({len(s.response_ids) for r in results.values() for s in r.samples})
    assert engine.timing.take() == {"decode_steps": [], "prefill": [0, 0.0], "decode_calls": 0}  # (started again)
