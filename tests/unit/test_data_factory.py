"""Building the dataset and sampler from the `data` config section (defaults need no files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.tiny_tokenizer import tiny_tokenizer

from rlinf_pipe.config.schema import ArithmeticConfig, DataConfig
from rlinf_pipe.data import (
    ArithmeticDataset,
    FileDataset,
    TemplateError,
    build_prompt_dataset,
    build_sampler,
)


def test_default_trains_on_arithmetic_with_the_chat_template():
    data = DataConfig()
    dataset = build_prompt_dataset(data, tiny_tokenizer(), seed=1)
    assert isinstance(dataset, ArithmeticDataset) and dataset.size is None
    batch = build_sampler(data, dataset, seed=1).next_batch()
    assert len(batch) == data.rollout_batch_size == 16
    assert all(item.prompt_ids and len(item.prompt_ids) <= data.max_prompt_length for item in batch)
    assert tiny_tokenizer().decode(batch[0].prompt_ids).startswith("<|im_start|>system\n")


def test_arithmetic_knobs_and_a_file_dataset(tmp_path):
    data = DataConfig(template="{prompt}", arithmetic=ArithmeticConfig(num_operands=3, operators=["*"], max_value=5))
    item = build_prompt_dataset(data, tiny_tokenizer(), seed=0)[0]
    assert item.prompt.count("*") == 2
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"problem": "2+2?", "solution": "\\boxed{4}"}) + "\n")
    data = DataConfig(dataset=str(path), prompt_key="problem", answer_key="solution", shuffle=False, rollout_batch_size=2)
    dataset = build_prompt_dataset(data, tiny_tokenizer(), seed=0)
    assert isinstance(dataset, FileDataset) and dataset[0].answer == "4"
    assert [i.epoch for i in build_sampler(data, dataset, seed=0).next_batch()] == [0, 1]


def test_chat_template_missing_is_reported_before_loading():
    with pytest.raises(TemplateError, match="no chat template"):
        build_prompt_dataset(DataConfig(), tiny_tokenizer(chat_template=False), seed=0)


def test_docs_example_runs():
    snippet = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text().split("```python\n", 1)[1]
    scope = {"tokenizer": tiny_tokenizer()}
    exec(compile(snippet.split("```", 1)[0], "docs/data.md", "exec"), scope)  # noqa: S102 - our own docs
    assert len(scope["prompts"]) == 16 and scope["state"]["position"] == 16


def test_a_prompt_length_limit_below_the_generated_prompts_fails_when_the_dataset_is_built():
    from rlinf_pipe.data.errors import DataError

    with pytest.raises(DataError, match=r"arithmetic: prompt 0 .* over data.max_prompt_length=1; raise it"):
        build_prompt_dataset(DataConfig(max_prompt_length=1), tiny_tokenizer(), seed=1)


def test_dataset_files_are_checked_without_reading_them(tmp_path):
    """`check_data_files` (a run's preflight): a missing file or an unreadable suffix is a DataError naming its key;
    the validation set only when the run validates; built-in sources need no file."""
    from rlinf_pipe.data.errors import DataError
    from rlinf_pipe.data.factory import check_data_files

    good = tmp_path / "train.jsonl"
    good.write_text('{"prompt": "1+1", "answer": "2"}\n')
    check_data_files(DataConfig(), validates=True)  # arithmetic; val heldout
    check_data_files(DataConfig(dataset=str(good), val_dataset="gsm8k"), validates=True)
    with pytest.raises(DataError, match=r"data.dataset: .*missing.jsonl does not exist"):
        check_data_files(DataConfig(dataset=str(tmp_path / "missing.jsonl")), validates=False)
    with pytest.raises(DataError, match=r"data.dataset: .* is a folder"):
        check_data_files(DataConfig(dataset=str(tmp_path)), validates=False)
    wrong = DataConfig(dataset=str(good), val_dataset=str(tmp_path / "val.csv"))
    check_data_files(wrong, validates=False)  # not read by this run
    (tmp_path / "val.csv").write_text("x\n")
    with pytest.raises(DataError, match=r"data.val_dataset: .*val.csv has an unsupported suffix '.csv'"):
        check_data_files(wrong, validates=True)
