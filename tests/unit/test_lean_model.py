"""The engine's Llama-family model without transformers' model classes (`rlinf_pipe.engines.rollout.lean_model`)
against what transformers loads from the same folder: the same parameter names, order, values, dtypes and ties,
the same rotary tables, the same lean-forward logits to the bit; and a refusal (None: the engine loads the model
with transformers) for every folder it would not load the same."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from rlinf_pipe.engines.rollout import GenerateRequest, SamplingParams, TorchEngine
from rlinf_pipe.engines.rollout.lean_model import LeanCausalLM, lean_config, load_lean_model
from rlinf_pipe.engines.rollout.llama_forward import LlamaForward
from rlinf_pipe.models import ensure_tiny_model
from rlinf_pipe.models.hf_config import ModelFolderError

PROMPTS = [[5, 9, 13, 2, 7, 11], [3, 4]]


def hf_model(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def lean_logits(model: torch.nn.Module, steps: int = 4) -> list[torch.Tensor]:
    """The lean forward's logits for a left-padded prefill of `PROMPTS`, then `steps` greedy decode steps."""
    forward = LlamaForward.build(model)
    assert forward is not None
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    cache = forward.new_cache(len(PROMPTS), width + steps)
    out = [forward(ids, (mask.cumsum(-1) - 1).clamp(min=0), mask, cache)]
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones((len(PROMPTS), 1))], dim=-1)
        out.append(forward(out[-1].argmax(-1)[:, None], mask.sum(-1, keepdim=True) - 1, mask, cache))
    return out


def assert_loads_as_transformers(folder: Path, dtype: torch.dtype = torch.float32) -> LeanCausalLM:
    reference, lean = hf_model(folder, dtype), load_lean_model(folder, dtype)
    assert isinstance(lean, LeanCausalLM)
    want, got = reference.state_dict(keep_vars=True), lean.state_dict(keep_vars=True)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        assert isinstance(got[name], torch.nn.Parameter)
    tied = reference.lm_head.weight is reference.model.embed_tokens.weight
    assert (lean.lm_head.weight is lean.model.embed_tokens.weight) == tied
    x, positions = torch.zeros(1, dtype=dtype), torch.arange(300)[None]
    for a, b in zip(reference.model.rotary_emb(x, positions), lean.model.rotary_emb(x, positions), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(lean_logits(reference), lean_logits(lean), strict=True):
        assert torch.equal(a, b)
    return lean


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,tied,kv_heads", [("qwen2", True, 2), ("qwen2", False, 4), ("llama", True, 2),
                                                ("llama", False, 1), ("qwen3", True, 2), ("qwen3", False, 1),
                                                ("llama3", True, 2), ("llama3", False, 4)])
def test_a_tiny_model_loads_as_transformers_loads_it(tmp_path, arch, tied, kv_heads, dtype):
    folder = ensure_tiny_model(tmp_path, arch=arch, tie_word_embeddings=tied, num_kv_heads=kv_heads)
    assert_loads_as_transformers(folder, dtype)


def test_llama_biases_and_a_head_size_of_its_own(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                         mlp_bias=True, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 500.0})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    lean = assert_loads_as_transformers(tmp_path)
    assert lean.model.layers[0].self_attn.o_proj.bias is not None and lean.model.layers[0].mlp.up_proj.bias is not None


def test_a_config_in_the_older_rope_theta_format(tmp_path):
    folder = Path(shutil.copytree(ensure_tiny_model(tmp_path / "cache", arch="llama"), tmp_path / "old"))
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 321.0
    config["rope_scaling"] = None
    del config["rope_parameters"]
    (folder / "config.json").write_text(json.dumps(config))
    lean = assert_loads_as_transformers(folder)
    assert lean.config.rope_theta == 321.0


def test_weights_in_shards_load_as_one_file(tmp_path):
    folder = Path(shutil.copytree(ensure_tiny_model(tmp_path / "cache"), tmp_path / "sharded"))
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, folder / shard, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {n: shard for shard, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_loads_as_transformers(folder)


BASE = {"model_type": "qwen2", "hidden_act": "silu", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.mark.parametrize("change", [
    {"model_type": "gpt2"}, {"hidden_act": "gelu"}, {"use_sliding_window": True},
    {"layer_types": ["sliding_attention"]}, {"quantization_config": {"quant_method": "gptq"}},
    {"pretraining_tp": 2}, {"tie_word_embeddings": None},
    {"num_key_value_heads": None},  # (transformers' Qwen2 would take 32, not the attention heads)
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    {"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
    {"rope_parameters": None},  # no stated base
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}},  # (its other values missing)
    {"model_type": "qwen3"},  # (no head_dim stated: transformers' Qwen3 takes 128, not hidden / heads)
])
def test_configs_it_would_not_load_as_transformers_are_refused(change):
    assert lean_config(BASE) is not None
    assert lean_config({**BASE, **change}) is None


def _edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["bin", "extra", "missing", "untied_head", "integer"])
def test_folders_it_would_not_load_as_transformers_are_refused(tmp_path, monkeypatch, case):
    folder = Path(shutil.copytree(ensure_tiny_model(tmp_path / "cache"), tmp_path / case))
    if case == "bin":
        torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
    elif case == "extra":
        _edit_weights(folder, lambda t: t.update(extra=torch.zeros(2)))
    elif case == "missing":
        _edit_weights(folder, lambda t: t.pop("model.norm.weight"))
    elif case == "untied_head":  # tied in the config, yet saved with an output projection of its own
        _edit_weights(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    else:
        _edit_weights(folder, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].long()}))
    reads: list[Path] = []
    monkeypatch.setattr("safetensors.torch.load_file", lambda file, device: reads.append(file) or load_file(file))
    assert load_lean_model(folder, torch.float32) is None
    # Names and dtypes are refused from the files' headers; only a tie needs the tensors' values.
    assert reads == ([folder / "model.safetensors"] if case == "untied_head" else [])


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_a_damaged_json_file_is_named(tmp_path, file):
    folder = Path(shutil.copytree(ensure_tiny_model(tmp_path / "cache"), tmp_path / "damaged"))
    if file.endswith("index.json"):
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / file).write_text('{"weight_map": ')
    with pytest.raises(ModelFolderError, match=f"damaged/{file} is not valid JSON"):
        load_lean_model(folder, torch.float32)


def test_the_engine_loads_what_the_lean_model_refuses_with_transformers(tmp_path):
    folder = Path(shutil.copytree(ensure_tiny_model(tmp_path / "cache"), tmp_path / "scaled"))
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    engine = TorchEngine(folder, cpu_threads=1)
    assert not isinstance(engine.model, LeanCausalLM) and type(engine.model).__name__ == "Qwen2ForCausalLM"
    request = GenerateRequest(request_id="r", prompt_ids=PROMPTS[0],
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))

    async def tokens() -> list[int]:
        return [r async for r in engine.generate([request])][0].samples[0].response_ids

    sequence = list(PROMPTS[0])
    for token in asyncio.run(tokens()):  # the scaled rotary embedding, through transformers' own module
        with torch.no_grad():
            assert token == int(engine.model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax())
        sequence.append(token)
