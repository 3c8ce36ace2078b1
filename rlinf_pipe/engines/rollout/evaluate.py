"""Offline accuracy of a model folder: sample with `TorchEngine`, score with the math reward."""

from __future__ import annotations

import asyncio
import os

from rlinf_pipe.config.schema import DataConfig
from rlinf_pipe.engines.reward.verify import score
from rlinf_pipe.engines.rollout.engine import GenerateRequest, SamplingParams
from rlinf_pipe.engines.rollout.torch_engine import TorchEngine
from rlinf_pipe.models.warmstart import arithmetic_dataset


def measure_accuracy(
    model_dir: str | os.PathLike[str],
    data: DataConfig | None = None,
    n_prompts: int = 256,
    temperature: float = 1.0,
    seed: int = 1234,
    max_new_tokens: int = 32,
    samples_per_prompt: int = 1,
) -> float:
    """Fraction of samples that the math reward scores correct on `n_prompts` arithmetic prompts.

    Prompts are items 0..n_prompts-1 of the generator seeded `seed`; sampling uses `TorchEngine` with
    `temperature` (0: greedy) and request seeds derived from `seed`, so the result is deterministic.
    """
    data = data or DataConfig()
    engine = TorchEngine(model_dir, max_batch_size=64, seed=seed)
    dataset = arithmetic_dataset(data, engine.tokenizer, seed=seed)
    items = dataset.take(n_prompts)
    answers = {str(i): item.answer for i, item in enumerate(items)}
    requests = [
        GenerateRequest(
            request_id=str(i), prompt_ids=list(item.prompt_ids or ()),
            sampling=SamplingParams(
                temperature=temperature, max_new_tokens=max_new_tokens, n=samples_per_prompt, seed=seed * 100_003 + i
            ),
        )
        for i, item in enumerate(items)
    ]

    async def run() -> tuple[int, int]:
        correct = total = 0
        async for result in engine.generate(requests):
            for sample in result.samples:
                text = engine.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
                correct += score(text, str(answers[result.request_id])).correct
                total += 1
        return correct, total

    correct, total = asyncio.run(run())
    return correct / max(1, total)
