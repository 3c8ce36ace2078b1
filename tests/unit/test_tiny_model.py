"""Tiny HF models and the tiny tokenizer: built locally, loadable with Auto classes, deterministic, cached."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlinf_pipe.models.tiny import (
    count_parameters,
    create_tiny_model,
    ensure_tiny_model,
)
from rlinf_pipe.models.tokenizer import BOS, EOS, PAD, train_tiny_tokenizer
from rlinf_pipe.utils.folders import COMPLETE

ARCHS = ("qwen2", "llama")


def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: create_tiny_model(root / arch, arch=arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_with_auto_classes_and_gives_logits(folders: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(folders[arch])
    tokenizer = AutoTokenizer.from_pretrained(folders[arch])
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tokenizer) < 1000
    ids = tokenizer(["What is 3 + 4?", "What is 12 * 5?"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (2, ids["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    assert count_parameters(folders[arch]) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_tokenizer_encodes_like_the_trained_one(folders: dict[str, Path], arch: str) -> None:
    # For qwen2, AutoTokenizer rebuilds a Qwen2Tokenizer from vocab + merges; it must not change the ids.
    loaded, trained = AutoTokenizer.from_pretrained(folders[arch]), train_tiny_tokenizer()
    text = "<|im_start|>user\nWhat is 123 + (-45) * 6?<|im_end|>\nThe answer is \\boxed{-147}. héllo ✓"
    assert loaded(text)["input_ids"] == trained(text)["input_ids"]
    assert loaded.get_vocab() == trained.get_vocab()
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == (PAD, BOS, EOS)
    assert loaded.chat_template == trained.chat_template


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_config_and_generate(folders: dict[str, Path], arch: str) -> None:
    gen = json.loads((folders[arch] / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folders[arch])
    assert gen["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(EOS)
    assert gen["pad_token_id"] == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids(PAD)
    model = AutoModelForCausalLM.from_pretrained(folders[arch])
    prompt = tokenizer("What is 1 + 1?", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 4)


def test_qwen2_has_qkv_bias_llama_does_not(folders: dict[str, Path]) -> None:
    for arch, has_bias in (("qwen2", True), ("llama", False)):
        attn = AutoModelForCausalLM.from_pretrained(folders[arch]).model.layers[0].self_attn
        assert all((proj.bias is not None) == has_bias for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        assert attn.o_proj.bias is None


@pytest.mark.parametrize("arch", ARCHS)
def test_gqa_shapes(folders: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(folders[arch])
    cfg, attn = model.config, model.model.layers[0].self_attn
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, head_dim) == (4, 2, 16)
    assert attn.q_proj.weight.shape == (4 * head_dim, 64)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (2 * head_dim, 64)


def test_same_seed_same_weights_other_seed_differs(folders: dict[str, Path], tmp_path: Path) -> None:
    again = create_tiny_model(tmp_path / "again", arch="qwen2", seed=0)
    other = create_tiny_model(tmp_path / "other", arch="qwen2", seed=1)
    assert _digest(again) == _digest(folders["qwen2"])
    assert _digest(other) != _digest(folders["qwen2"])


def test_creation_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    create_tiny_model(tmp_path / "m", arch="llama", num_layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_knobs_reach_the_config(tmp_path: Path) -> None:
    folder = create_tiny_model(
        tmp_path / "m", arch="llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=48, max_position_embeddings=128, tie_word_embeddings=False,
    )
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (32, 1, 2)
    assert (cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["max_position_embeddings"]) == (1, 48, 128)
    assert cfg["tie_word_embeddings"] is False and cfg["rope_parameters"]["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match="num_kv_heads"):
        create_tiny_model(tmp_path / "bad", num_heads=4, num_kv_heads=3)


def test_ensure_reuses_the_folder_and_rebuilds_one_without_marker(tmp_path: Path) -> None:
    first = ensure_tiny_model(tmp_path, arch="llama", num_layers=1)
    assert (first / COMPLETE).is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path, arch="llama", num_layers=1) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert ensure_tiny_model(tmp_path, arch="llama", num_layers=2) != first  # other knobs, other folder

    (first / COMPLETE).unlink()  # as if a build had been interrupted
    (first / "model.safetensors").write_bytes(b"truncated")
    assert ensure_tiny_model(tmp_path, arch="llama", num_layers=1) == first
    assert (first / COMPLETE).is_file()
    AutoModelForCausalLM.from_pretrained(first)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left


def test_tokenizer_round_trips_arithmetic_and_stays_small() -> None:
    tokenizer = train_tiny_tokenizer()
    assert len(tokenizer) <= 512
    for text in ("What is 12 + (-7) * 3?", "48 / 6 - 2 = 6. The answer is \\boxed{6}.", "héllo, wörld! ✓"):
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert len(tokenizer("What is 12 + 7?")["input_ids"]) < len("What is 12 + 7?")  # merges learned
    assert [tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token] == [PAD, BOS, EOS]
    with pytest.raises(ValueError, match="vocab_size"):
        train_tiny_tokenizer(vocab_size=5000)


def test_tokenizer_chat_template() -> None:
    tokenizer = train_tiny_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert plain == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids(EOS)) == 2 and ids[0] == tokenizer.bos_token_id


def test_tokenizer_is_deterministic_across_processes() -> None:
    code = (
        "import hashlib; from rlinf_pipe.models.tokenizer import train_tiny_tokenizer as t; "
        "print(hashlib.sha256(t(['extra 123']).backend_tokenizer.to_str().encode()).hexdigest())"
    )
    here = hashlib.sha256(train_tiny_tokenizer(["extra 123"]).backend_tokenizer.to_str().encode()).hexdigest()
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there
    assert train_tiny_tokenizer(["extra 123"]).get_vocab() != train_tiny_tokenizer(vocab_size=300).get_vocab()
