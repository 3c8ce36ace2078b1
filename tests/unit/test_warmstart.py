"""Warm start of the tiny model: SFT lowers the loss, the result loads, the cache is reused, accuracy is a fraction."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlinf_pipe.config.schema import ArithmeticConfig, DataConfig
from rlinf_pipe.engines.rollout.evaluate import measure_accuracy
from rlinf_pipe.models.tiny import ensure_tiny_model
from rlinf_pipe.models.warmstart import (
    WarmStartSpec,
    ensure_warm_tiny_model,
    target_text,
    warm_start,
)
from rlinf_pipe.utils.folders import COMPLETE

SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}
DATA = DataConfig(arithmetic=ArithmeticConfig(min_value=1, max_value=5))
SPEC = WarmStartSpec(steps=6, lr=3e-3, batch_size=8, warmup_steps=1)


def test_target_text_boxes_the_answer_or_not() -> None:
    assert target_text("7 - 9", -2) == "7 - 9 = -2. \\boxed{-2}"
    assert target_text("7 - 9", -2, boxed=False) == "7 - 9 = -2."


def test_warm_start_lowers_the_loss_and_loads(tmp_path: Path) -> None:
    base = ensure_tiny_model(tmp_path / "cache", **SMALL)
    out = tmp_path / "warm"
    stats = warm_start(base, out, DATA, steps=30, lr=3e-3, batch_size=8, warmup_steps=2)
    assert stats["final_loss"] < stats["first_loss"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.hidden_size == SMALL["hidden_size"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_warm_start_rejects_other_datasets(tmp_path: Path) -> None:
    base = ensure_tiny_model(tmp_path / "cache", **SMALL)
    with pytest.raises(ValueError, match="arithmetic"):
        warm_start(base, tmp_path / "warm", DataConfig(dataset="gsm8k"), steps=1)


def test_ensure_warm_tiny_model_caches(tmp_path: Path) -> None:
    first = ensure_warm_tiny_model(tmp_path, DATA, spec=SPEC, tiny_knobs=SMALL)
    assert (first / COMPLETE).is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    again = ensure_warm_tiny_model(tmp_path, DATA, spec=SPEC, tiny_knobs=SMALL)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    other = ensure_warm_tiny_model(tmp_path, DataConfig(arithmetic=ArithmeticConfig(max_value=6)), spec=SPEC,
                                   tiny_knobs=SMALL)
    assert other != first  # data knobs are part of the digest


def test_measure_accuracy_is_a_fraction(tmp_path: Path) -> None:
    model = ensure_warm_tiny_model(tmp_path, DATA, spec=SPEC, tiny_knobs=SMALL)
    for temperature in (0.0, 1.0):
        accuracy = measure_accuracy(model, DATA, n_prompts=8, temperature=temperature, seed=3, max_new_tokens=12)
        assert 0.0 <= accuracy <= 1.0
    assert measure_accuracy(model, DATA, n_prompts=8, temperature=1.0, seed=3, max_new_tokens=12) == accuracy


def test_warm_start_is_deterministic(tmp_path: Path) -> None:
    base = ensure_tiny_model(tmp_path / "cache", **SMALL)
    for name in ("a", "b"):
        warm_start(base, tmp_path / name, DATA, steps=3, batch_size=4, seed=5)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
