"""The torch engine on a GPU in bf16: a full cycle (generate, sleep, update while asleep, wake, generate, decode),
memory given back while asleep, and seeded sampling that repeats."""

from __future__ import annotations

import asyncio

import pytest
import torch
from support.gpu import allocated, device, measures_memory

from rlinf_pipe.engines.rollout import EngineAsleepError, GenerateRequest, SamplingParams, TorchEngine
from rlinf_pipe.models.tiny import ensure_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [99, 7, 250, 13, 8]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(ensure_tiny_model(tmp_path_factory.mktemp("models")))


async def _tokens(engine: TorchEngine, seed: int) -> list[list[list[int]]]:
    requests = [GenerateRequest(request_id=str(i), prompt_ids=p,
                                sampling=SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=seed + i))
                for i, p in enumerate(PROMPTS)]
    out = {r.request_id: [s.response_ids for s in r.samples] async for r in engine.generate(requests)}
    return [out[str(i)] for i in range(len(PROMPTS))]


def test_generate_sleep_update_wake_generate_decode(model_path):
    async def cycle() -> None:
        engine = TorchEngine(model_path, device=str(device()), dtype=torch.bfloat16, seed=3)
        original = [(n, t.detach().clone()) for n, t in engine.model.state_dict().items()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in engine.model.state_dict().values()}
        weight_bytes = sum(storages.values())  # distinct storages: tied embeddings are one tensor under two names
        first = await _tokens(engine, seed=11)
        assert await _tokens(engine, seed=11) == first  # per-sample seeds repeat on the GPU too
        assert any(a != b for a, b in first)  # the two samples of a request differ

        held = allocated()
        await engine.sleep()
        if measures_memory():
            print(f"\nsleep: {held - allocated()} of {weight_bytes} weight bytes given back")
            assert held - allocated() >= 0.9 * weight_bytes, "sleep did not give the weights' memory back"
        with pytest.raises(EngineAsleepError):
            await _tokens(engine, seed=11)
        g = torch.Generator().manual_seed(0)
        perturbed = [(n, t + 0.5 * torch.randn(t.shape, generator=g).to(t)) for n, t in original]
        await engine.update_weights(perturbed, version=1)  # while asleep
        await engine.wake()
        assert engine.version == 1
        assert all(p.device.type == device().type for p in engine.model.parameters())
        assert await _tokens(engine, seed=11) != first  # the new weights are in use

        await engine.update_weights(original, version=2)
        back = await _tokens(engine, seed=11)
        assert back == first and engine.version == 2
        text = engine.tokenizer.decode(back[0][0])
        assert isinstance(text, str) and text

    asyncio.run(cycle())
