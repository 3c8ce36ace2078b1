"""Prompts in, training batches out: datasets, prompt templates, sampling, and the structs that flow in channels.

See docs/data.md. Typical use::

    data = build_prompt_dataset(cfg.data, tokenizer, seed=cfg.runner.seed)
    sampler = build_sampler(cfg.data, data, seed=cfg.runner.seed)
    prompts = sampler.next_batch()                      # list[PromptItem]
    ...
    batch = pack_train_batch(scored_groups, tokenizer.pad_token_id)
"""

from rlinf_pipe.data.answers import (
    ANSWER_FORMATS,
    AnswerFormat,
    parse_boxed_answer,
    parse_gsm8k_answer,
    parse_plain_answer,
    parse_reference_answer,
)
from rlinf_pipe.data.arithmetic import ArithmeticDataset, ArithmeticSpec, Problem, generate_problem
from rlinf_pipe.data.datasets import (
    FileDataset,
    LoadReport,
    PromptDataset,
    filter_by_prompt_length,
    load_prompt_dataset,
    read_prompt_items,
    record_to_item,
    render_items,
)
from rlinf_pipe.data.errors import AnswerParseError, DataError, MalformedDataError, RecordIssue, TemplateError
from rlinf_pipe.data.factory import build_prompt_dataset, build_renderer, build_sampler
from rlinf_pipe.data.gsm8k import GSM8K_REQUIREMENT, gsm8k_test_path, load_gsm8k
from rlinf_pipe.data.packing import pack_train_batch, row_chunks, split_train_batch
from rlinf_pipe.data.sampler import PromptSampler, epoch_permutation
from rlinf_pipe.data.structs import FinishReason, PromptItem, RolloutGroup, RolloutSample, ScoredGroup, TrainBatch
from rlinf_pipe.data.templates import CHAT, DEFAULT_SYSTEM_PROMPT, PromptRenderer, check_format_template

__all__ = [
    "ANSWER_FORMATS",
    "CHAT",
    "DEFAULT_SYSTEM_PROMPT",
    "GSM8K_REQUIREMENT",
    "AnswerFormat",
    "AnswerParseError",
    "ArithmeticDataset",
    "ArithmeticSpec",
    "DataError",
    "FileDataset",
    "FinishReason",
    "LoadReport",
    "MalformedDataError",
    "Problem",
    "PromptDataset",
    "PromptItem",
    "PromptRenderer",
    "PromptSampler",
    "RecordIssue",
    "RolloutGroup",
    "RolloutSample",
    "ScoredGroup",
    "TemplateError",
    "TrainBatch",
    "build_prompt_dataset",
    "build_renderer",
    "build_sampler",
    "check_format_template",
    "epoch_permutation",
    "filter_by_prompt_length",
    "generate_problem",
    "gsm8k_test_path",
    "load_gsm8k",
    "load_prompt_dataset",
    "pack_train_batch",
    "parse_boxed_answer",
    "parse_gsm8k_answer",
    "parse_plain_answer",
    "parse_reference_answer",
    "read_prompt_items",
    "record_to_item",
    "render_items",
    "row_chunks",
    "split_train_batch",
]
