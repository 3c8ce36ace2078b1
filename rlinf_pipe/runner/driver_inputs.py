"""What the driver reads before it launches the workers (`driver_inputs`): the model folders, the tokenizer, the
prompt sets (the record schema of a dataset file said in one line), and the checks that need them (the context
length, the tokenizer's round trip), and the reward settings that depend on the prompts (`reward.thinking`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.datasets import PromptDataset
from rlinf_pipe.data.factory import (
    build_prompt_dataset,
    build_sampler,
    dataset_line,
    split_validation,
    warm_start_data,
)
from rlinf_pipe.data.sampler import PromptSampler
from rlinf_pipe.data.structs import PromptItem
from rlinf_pipe.engines.reward.extract import resolve_thinking
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.models.hf_config import load_hf_config
from rlinf_pipe.models.resolve import resolve_model_path
from rlinf_pipe.runner.model_fit import check_context_length
from rlinf_pipe.utils.folders import absolute


def run_model_path(name: str, cfg: Config) -> str:
    """The model folder of a run (`resolve_model_path` with the run's data: `tiny` is the tiny model warm-started
    on it, or on arithmetic problems for a dataset file (`warm_start_data`), built once and cached); an unusable
    name is a `ConfigError`."""
    try:  # (symlinks kept: a link may differ by node)
        return str(absolute(resolve_model_path(name, data=warm_start_data(cfg.data))))
    except ValueError as exc:
        raise ConfigError(f"actor.model_path / rollout.model_path: {exc}") from None


@dataclass
class DriverInputs:
    """What the driver reads itself before it launches the workers: the model folders (the tiny model built on first
    use), the prompts (training sampler and validation set) and the tokenizer's pad id."""

    model_path: str
    rollout_path: str
    sampler: PromptSampler
    val_prompts: list[PromptItem]
    pad_token_id: int


def driver_inputs(cfg: Config) -> DriverInputs:
    """Resolve the model folders, load the tokenizer and build the prompt sets (a `ConfigError` or `DataError` for
    unusable ones)."""
    from transformers import AutoTokenizer

    from rlinf_pipe.workers.logprob_stage import pad_id_of

    model_path = run_model_path(cfg.actor.model_path, cfg)
    rollout_path = model_path if cfg.rollout.model_path in (None, cfg.actor.model_path) else run_model_path(
        cfg.rollout.model_path, cfg
    )
    for path in dict.fromkeys((model_path, rollout_path)):  # (built-in models' folders exist only from here)
        check_context_length(cfg, load_hf_config(path), path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    check_round_trip(tokenizer, model_path)
    resolve_thinking(cfg, tokenizer)
    dataset = build_prompt_dataset(cfg.data, tokenizer, cfg.runner.seed)
    say_dataset("data.dataset", dataset)
    val_prompts: list[PromptItem] = []
    if cfg.runner.val_interval or cfg.runner.val_before_train:
        dataset, val_prompts = split_validation(cfg.data, tokenizer, cfg.runner.seed, dataset, say_dataset)
    return DriverInputs(model_path, rollout_path, build_sampler(cfg.data, dataset, cfg.runner.seed), val_prompts,
                        pad_id_of(tokenizer))


def say_dataset(key: str, dataset: PromptDataset) -> None:
    """Print, in one line, the record schema detected in a dataset file and what was loaded from it."""
    line = dataset_line(key, dataset)
    if line is not None:
        print(f"[rlinf_pipe] {line}", flush=True)


ROUND_TRIP_PROBE = "What is 12 + 30? The answer is 42."


def check_round_trip(tokenizer: Any, model_path: str) -> None:
    """A `ConfigError` when the tokenizer does not give back the words it encodes. Some transformers 5 releases load
    a ByteLevel tokenizer whose tokenizer_config.json names `LlamaTokenizerFast` (DeepSeek-R1-Distill-Qwen's) as
    a Llama tokenizer that drops every space, silently: every prompt would be garbled."""
    import transformers

    back = tokenizer.decode(tokenizer(ROUND_TRIP_PROBE, add_special_tokens=False).input_ids)
    if back.split() != ROUND_TRIP_PROBE.split():
        raise ConfigError(
            f"the tokenizer of {model_path} ({type(tokenizer).__name__}, transformers {transformers.__version__}) "
            f"does not give back the text it encodes: {ROUND_TRIP_PROBE!r} -> {back!r}. Install a transformers that "
            "loads it as its model type's tokenizer (5.19 and 5.24 do for Qwen2 models whose tokenizer_config.json "
            "names LlamaTokenizerFast), or correct `tokenizer_class` in the folder's tokenizer_config.json"
        )


