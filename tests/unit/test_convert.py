"""HF <-> Megatron weight conversion: bit-exact round trips over TP x PP, the layouts megatron-core expects,
the checkpoint folder format, and `rlinf-pipe convert` (round trip through files, user errors exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rlinf_pipe.cli import main
from rlinf_pipe.models.convert import ConversionError, hf_to_megatron, megatron_to_hf
from rlinf_pipe.models.weight_map import hf_weight_names
from rlinf_pipe.models.megatron_checkpoint import (
    CheckpointError,
    load_safetensors,
    model_shard_path,
    read_megatron_meta,
    save_hf_safetensors,
)
from rlinf_pipe.models.arch import hf_arch, padded_vocab_size
from rlinf_pipe.models.tiny import ensure_tiny_model

# num_kv_heads=4 lets TP=4 divide every model; the GQA models (2 kv heads) go up to TP=2.
MODELS = {
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True, num_kv_heads=4),
    "qwen2-untied": dict(arch="qwen2", tie_word_embeddings=False, num_kv_heads=4),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True, num_kv_heads=4),
    "llama-untied": dict(arch="llama", tie_word_embeddings=False, num_kv_heads=4),
    "qwen2-gqa": dict(arch="qwen2", tie_word_embeddings=True, num_kv_heads=2),
    "llama-gqa": dict(arch="llama", tie_word_embeddings=False, num_kv_heads=2),
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True, num_kv_heads=4),
    "qwen3-gqa": dict(arch="qwen3", tie_word_embeddings=False, num_kv_heads=2),
    "llama3-tied": dict(arch="llama3", tie_word_embeddings=True, num_kv_heads=2),
    "llama3-untied": dict(arch="llama3", tie_word_embeddings=False, num_kv_heads=4),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def _model(cache: Path, name: str):
    path = ensure_tiny_model(cache, **MODELS[name])
    return path, hf_arch(AutoConfig.from_pretrained(path)), load_safetensors(path / "model.safetensors")


def _split(state, arch, tp, pp):
    return {
        (t, p): hf_to_megatron(state, arch, tp=tp, pp=pp, tp_rank=t, pp_rank=p) for t in range(tp) for p in range(pp)
    }


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_is_bit_exact(cache, name, tp, pp):
    _, arch, state = _model(cache, name)
    if tp > arch.num_kv_heads:
        with pytest.raises(ConversionError, match=f"tensor_parallel_size {tp} must divide num_key_value_heads"):
            _split(state, arch, tp, pp)
        return
    shards = _split(state, arch, tp, pp)
    back = megatron_to_hf(shards, arch, tp=tp, pp=pp)
    assert list(back) == hf_weight_names(arch)
    assert back.keys() == state.keys()  # tied: no lm_head.weight on either side
    for key, tensor in state.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_shard_names_shapes_and_vocab_padding(cache):
    _, arch, state = _model(cache, "qwen2-gqa")
    assert arch.vocab_size % 2 == 1  # 437: TP=2 pads one row
    shards = _split(state, arch, 2, 2)
    v_pad, h, hd = padded_vocab_size(arch.vocab_size, 2), arch.hidden_size, arch.head_dim
    first, last = shards[(1, 0)], shards[(1, 1)]
    assert first["embedding.word_embeddings.weight"].shape == (v_pad // 2, h)
    assert torch.count_nonzero(first["embedding.word_embeddings.weight"][-1]) == 0  # the padding row
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * hd // 2
    assert first["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (qkv_rows, h)
    assert first["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (qkv_rows,)
    assert first["decoder.layers.0.mlp.linear_fc1.weight"].shape == (arch.intermediate_size, h)
    assert first["decoder.layers.0.mlp.linear_fc2.weight"].shape == (h, arch.intermediate_size // 2)
    assert "decoder.final_layernorm.weight" not in first and "output_layer.weight" not in first
    # stage 1 holds global layer 1 as local layer 0, the final norm, and (tied, pp > 1) the embedding copy
    assert {k.split(".")[2] for k in last if k.startswith("decoder.layers.")} == {"0"}
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"], state["model.layers.1.input_layernorm.weight"])
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    # tied with pp == 1: the output layer shares the embedding, nothing extra is stored
    assert "output_layer.weight" not in hf_to_megatron(state, arch, tp=1, pp=1, tp_rank=0, pp_rank=0)


def test_qkv_and_fc1_layouts_follow_megatron(cache):
    """linear_qkv: per query group, its q heads then k then v; linear_fc1 per TP rank: [gate shard; up shard]."""
    _, arch, state = _model(cache, "llama-gqa")  # 4 q heads, 2 kv heads: 2 q heads per group
    hd, i = arch.head_dim, arch.intermediate_size
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    gate, up = state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    for tp_rank in range(2):
        shard = hf_to_megatron(state, arch, tp=2, pp=1, tp_rank=tp_rank, pp_rank=0)
        qkv = shard["decoder.layers.0.self_attention.linear_qkv.weight"]
        g = tp_rank  # one query group per rank
        expected = torch.cat([q[2 * g * hd:(2 * g + 2) * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]])
        assert torch.equal(qkv, expected)
        fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
        rows = slice(tp_rank * i // 2, (tp_rank + 1) * i // 2)
        assert torch.equal(fc1, torch.cat([gate[rows], up[rows]]))


def test_weight_names_order(cache):
    _, arch, _ = _model(cache, "qwen2-untied")
    names = hf_weight_names(arch)
    assert names[:5] == [
        "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
    ]
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert len(names) == len(set(names)) == 1 + arch.num_layers * 12 + 2


def test_non_dividing_tp_and_pp_errors(cache):
    _, arch, state = _model(cache, "qwen2-gqa")
    with pytest.raises(ConversionError, match="tensor_parallel_size 3 must divide num_attention_heads 4, "
                                               "num_key_value_heads 2"):
        hf_to_megatron(state, arch, tp=3, pp=1, tp_rank=0, pp_rank=0)
    with pytest.raises(ConversionError, match="pipeline_parallel_size 3 must divide num_hidden_layers 2"):
        hf_to_megatron(state, arch, tp=1, pp=3, tp_rank=0, pp_rank=0)
    missing = {k: t for k, t in state.items() if k != "model.norm.weight"}
    with pytest.raises(ConversionError, match="no tensor 'model.norm.weight'"):
        hf_to_megatron(missing, arch, tp=1, pp=1, tp_rank=0, pp_rank=0)


def test_sharded_hf_safetensors_round_trip(cache, tmp_path):
    from rlinf_pipe.models.megatron_checkpoint import LazySafetensors

    _, _, state = _model(cache, "llama-untied")
    save_hf_safetensors(state, tmp_path, max_shard_bytes=60_000)
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    lazy = LazySafetensors(tmp_path)
    assert set(lazy) == set(state) and all(torch.equal(lazy[k], t) for k, t in state.items())


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["convert", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", ["qwen2-gqa", "llama-gqa"])
def test_cli_round_trip_hf_megatron_hf(cache, tmp_path, capsys, name):
    path, arch, state = _model(cache, name)
    mdir, hdir = tmp_path / "megatron", tmp_path / "hf"
    code, out, err = _cli(capsys, "--to", "megatron", "--tp", 2, "--pp", 2, path, mdir)
    assert code == 0, err
    meta = json.loads((mdir / "megatron.json").read_text())
    assert meta == {"format": "rlinf_pipe.megatron", "version": 1, "tp": 2, "pp": 2, "model_type": arch.model_type}
    assert read_megatron_meta(mdir).tp == 2
    assert all(model_shard_path(mdir, t, p).is_file() for t in range(2) for p in range(2))
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {f.name for f in (mdir / "hf").iterdir()}
    assert not list(tmp_path.glob(".*"))  # no temporary folder left

    code, out, err = _cli(capsys, "--to", "hf", mdir, hdir)
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(hdir)
    reloaded = model.state_dict()
    for key, tensor in state.items():
        assert torch.equal(reloaded[key], tensor), key
    assert load_safetensors(hdir / "model.safetensors").keys() == state.keys()
    if arch.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer, original = AutoTokenizer.from_pretrained(hdir), AutoTokenizer.from_pretrained(path)
    assert tokenizer.encode("What is 7 + 5?") == original.encode("What is 7 + 5?")
    assert model.generation_config.eos_token_id == original.eos_token_id


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--to", "megatron", "--tp", "3", "{model}", "{out}"], "--tp 3 must divide num_attention_heads 4"),
        (["--to", "megatron", "{tmp}/nope", "{out}"], "nope does not exist or is not a folder"),
        (["--to", "hf", "{model}", "{out}"], "is not a Megatron checkpoint (no megatron.json)"),
        (["--to", "megatron", "{tmp}", "{out}"], "is not a Hugging Face model folder (no config.json)"),
        (["--to", "megatron", "{gpt2}", "{out}"], "model_type 'gpt2' is not supported"),
        (["--to", "megatron", "{model}", "{tmp}"], "already exists and is not empty"),
        (["--to", "hf", "--tp", "2", "{model}", "{out}"], "--tp/--pp only apply to --to megatron"),
    ],
)
def test_cli_user_errors_exit_2(cache, tmp_path, capsys, args, expected):
    path, _, _ = _model(cache, "qwen2-gqa")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    subs = {"model": str(path), "out": str(tmp_path / "out"), "tmp": str(tmp_path), "gpt2": str(gpt2)}
    capsys.readouterr()  # (what building the model printed, when this test builds it first)
    code, out, err = _cli(capsys, *(a.format(**subs) for a in args))
    assert code == 2 and out == ""
    assert err.startswith("error: ") and expected in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_read_megatron_meta_rejects_other_formats(tmp_path):
    (tmp_path / "megatron.json").write_text(json.dumps({"format": "other", "version": 1, "tp": 1, "pp": 1}))
    with pytest.raises(CheckpointError, match="format is 'other'"):
        read_megatron_meta(tmp_path)

