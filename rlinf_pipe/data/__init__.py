"""Prompts in, training batches out: datasets, prompt templates, sampling, and the structs that flow in channels.

See docs/data.md. Typical use::

    data = build_prompt_dataset(cfg.data, tokenizer, seed=cfg.runner.seed)
    sampler = build_sampler(cfg.data, data, seed=cfg.runner.seed)
    prompts = sampler.next_batch()                      # list[PromptItem]
    ...
    batch = pack_train_batch(scored_groups, tokenizer.pad_token_id)

The names below load their modules on first use: the structs and batch packing import torch (about 2 s of CPU),
which the checks a run passes before Ray starts (`runner.preflight`: dataset files) do not need."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinf_pipe.utils.lazy import lazy_exports

if TYPE_CHECKING:
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
        render_items,
    )
    from rlinf_pipe.data.errors import AnswerParseError, DataError, MalformedDataError, RecordIssue, TemplateError
    from rlinf_pipe.data.factory import build_prompt_dataset, build_renderer, build_sampler
    from rlinf_pipe.data.gsm8k import GSM8K_REQUIREMENT, gsm8k_test_path, load_gsm8k
    from rlinf_pipe.data.packing import pack_train_batch, row_chunks, split_train_batch
    from rlinf_pipe.data.record_items import record_to_item
    from rlinf_pipe.data.sampler import PromptSampler, epoch_permutation
    from rlinf_pipe.data.schemas import SCHEMAS, RecordSchema, SchemaDetector
    from rlinf_pipe.data.structs import (
        ChatMessage,
        FinishReason,
        PromptItem,
        RolloutGroup,
        RolloutSample,
        ScoredGroup,
    )
    from rlinf_pipe.data.train_batch import TrainBatch
    from rlinf_pipe.data.templates import CHAT, DEFAULT_SYSTEM_PROMPT, PromptRenderer, check_format_template

_EXPORTS = {
    "ANSWER_FORMATS": "answers", "AnswerFormat": "answers", "AnswerParseError": "errors",
    "ArithmeticDataset": "arithmetic", "ArithmeticSpec": "arithmetic", "CHAT": "templates", "ChatMessage": "structs",
    "DEFAULT_SYSTEM_PROMPT": "templates", "DataError": "errors", "FileDataset": "datasets", "FinishReason": "structs",
    "GSM8K_REQUIREMENT": "gsm8k", "LoadReport": "datasets", "MalformedDataError": "errors", "Problem": "arithmetic",
    "PromptDataset": "datasets", "PromptItem": "structs", "PromptRenderer": "templates", "PromptSampler": "sampler",
    "RecordIssue": "errors", "RecordSchema": "schemas", "RolloutGroup": "structs", "SCHEMAS": "schemas",
    "SchemaDetector": "schemas", "RolloutSample": "structs", "ScoredGroup": "structs",
    "TemplateError": "errors", "TrainBatch": "train_batch", "build_prompt_dataset": "factory",
    "build_renderer": "factory", "build_sampler": "factory", "check_format_template": "templates",
    "epoch_permutation": "sampler", "filter_by_prompt_length": "datasets", "generate_problem": "arithmetic",
    "gsm8k_test_path": "gsm8k", "load_gsm8k": "gsm8k", "load_prompt_dataset": "datasets",
    "pack_train_batch": "packing", "parse_boxed_answer": "answers", "parse_gsm8k_answer": "answers",
    "parse_plain_answer": "answers", "parse_reference_answer": "answers", "read_prompt_items": "datasets",
    "record_to_item": "record_items", "render_items": "datasets", "row_chunks": "packing",
    "split_train_batch": "packing",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
