"""Llama-family causal LMs (Llama, Qwen2, Qwen3) loaded from a local folder without transformers' model classes.

Importing transformers' model modules loads TorchDynamo, DTensor and FSDP: 2-3 s of CPU in every rollout worker's
launch (docs/benchmarks.md), for a module whose forward `TorchEngine` does not call: it generates through
`LlamaForward`, which reads only the module's weights and rotary embedding. `load_lean_model` builds a module with
transformers' parameter names, shapes and ties (so `state_dict()` and weight updates by name are the same), its
rotary embedding computed as transformers' (the default one, or Llama 3's scaled one: `models.rotary`), and loads
the folder's safetensors into it. It returns None for what it does not build the same (another model type, another
rotary scaling, sliding windows, a `.bin` checkpoint, quantized weights, tensors missing or unexpected): the engine
then loads the model with transformers.

    model = load_lean_model(folder, torch.float32)   # None: use AutoModelForCausalLM.from_pretrained(folder)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlinf_pipe.models.hf_config import Llama3Scaling, light_hf_config, read_json, rope_of, weight_files
from rlinf_pipe.models.rotary import inverse_frequencies

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class LeanConfig:
    """What the lean model and `LlamaForward` read of a folder's `config.json`, under transformers' names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool  # q, k, v projections
    output_bias: bool  # o projection
    mlp_bias: bool
    eos_token_id: int | list[int] | None
    hidden_act: str = "silu"
    qk_norm: bool = False  # Qwen3's RMSNorm over each query and key head
    rope_llama3: Llama3Scaling | None = None


def lean_config(raw: dict[str, Any]) -> LeanConfig | None:
    """The lean config of a `config.json`'s contents, or None where the lean model would not be transformers'."""
    kind = raw.get("model_type")
    rope = rope_of(raw)
    # (a Llama or Qwen2 with every size stated, not defaulted: transformers' defaults differ by model type, e.g.
    # Qwen2's 32 key/value heads; `light_hf_config` is the one judge of that)
    llama3 = rope.kind == "llama3" and rope.llama3 is not None and rope.partial_factor == 1.0
    if light_hf_config(raw) is None or raw.get("hidden_act") != "silu" or not (rope.plain or llama3):
        return None
    if raw.get("quantization_config") or raw.get("pretraining_tp", 1) != 1 or raw.get("use_sliding_window"):
        return None
    if any(t != "full_attention" for t in raw.get("layer_types") or ()):
        return None
    heads = raw["num_attention_heads"]
    llama, qwen3 = kind == "llama", kind == "qwen3"
    biased = bool(raw.get("attention_bias", False))
    return LeanConfig(
        model_type=kind, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, rms_norm_eps=float(raw["rms_norm_eps"]),
        rope_theta=rope.theta, tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        attention_bias=biased if llama or qwen3 else True,
        output_bias=biased if llama or qwen3 else False,
        mlp_bias=bool(raw.get("mlp_bias", False)) if llama else False,
        eos_token_id=raw.get("eos_token_id"),
        qk_norm=qwen3,
        rope_llama3=rope.llama3 if llama3 else None,
    )


def _unset(*shape: int) -> nn.Parameter:
    """A parameter without storage, until `load_lean_model` assigns the folder's tensor. (`nn.Linear` and
    `nn.Embedding` would initialise theirs, which on the meta device imports TorchDynamo.)"""
    return nn.Parameter(torch.empty(*shape, device="meta"))


class RMSNorm(nn.Module):
    """A norm's weight and epsilon under transformers' names (`LlamaForward` computes the norm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _unset(size)
        self.variance_epsilon = eps


class Rotary(nn.Module):
    """transformers' rotary embedding of the default or the `llama3` type: the same inverse frequencies and the same
    cosines and sines (neither type scales them)."""

    def __init__(self, theta: float, head_dim: int, llama3: Llama3Scaling | None = None):
        super().__init__()
        self.rope_type = "default" if llama3 is None else "llama3"
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, llama3), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class _Weights(nn.Module):
    """A linear projection's or an embedding's `weight` (and `bias`, None without one)."""

    def __init__(self, outputs: int, inputs: int, bias: bool = False):
        super().__init__()
        self.weight = _unset(outputs, inputs)
        self.bias = _unset(outputs) if bias else None


def _linear(inputs: int, outputs: int, bias: bool) -> _Weights:
    return _Weights(outputs, inputs, bias)


class _Attention(nn.Module):
    def __init__(self, c: LeanConfig):
        super().__init__()
        self.q_proj = _linear(c.hidden_size, c.num_attention_heads * c.head_dim, c.attention_bias)
        self.k_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.v_proj = _linear(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.o_proj = _linear(c.num_attention_heads * c.head_dim, c.hidden_size, c.output_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)


class _MLP(nn.Module):
    def __init__(self, c: LeanConfig):
        super().__init__()
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size, c.mlp_bias)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size, c.mlp_bias)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size, c.mlp_bias)


class _Layer(nn.Module):
    def __init__(self, c: LeanConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class _Decoder(nn.Module):
    def __init__(self, c: LeanConfig):
        super().__init__()
        self.embed_tokens = _Weights(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = Rotary(c.rope_theta, c.head_dim, c.rope_llama3)


class LeanCausalLM(nn.Module):
    """A Llama-family decoder's weights in transformers' module tree (`model.layers.N.self_attn.q_proj`, ...,
    `lm_head`), built on the meta device until `load_lean_model` assigns the folder's tensors. It has no forward
    of its own: `LlamaForward.build(model)` computes with it."""

    def __init__(self, config: LeanConfig):
        super().__init__()
        self.config = config
        self.model = _Decoder(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With `tie_word_embeddings`, the output projection is the embedding's parameter itself (as in
        transformers: `state_dict()` names it twice, and loading either name loads both)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def _stored_floats(files: list[Path]) -> set[str] | None:
    """The tensor names the safetensors files hold (read from their headers), or None if one is not floating."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as stored:
            for name in stored.keys():
                if not stored.get_slice(name).get_dtype().startswith(("F", "BF")):
                    return None  # (integer or boolean tensors: quantized or not a plain checkpoint)
                names.add(name)
    return names


def load_lean_model(path: str | os.PathLike[str], dtype: torch.dtype) -> LeanCausalLM | None:
    """The folder's Llama-family model as a `LeanCausalLM` with weights of `dtype` on the CPU, or None where it
    would differ from what transformers loads (see the module docstring). The tensors' names and dtypes are
    checked from the files' headers before any tensor is read."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_file, found = folder / CONFIG_FILE, weight_files(folder)
    if not config_file.is_file() or found is None:
        return None
    files = found.files
    config = lean_config(read_json(config_file))
    if config is None:
        return None
    model = LeanCausalLM(config)
    stored, expected = _stored_floats(files), set(model.state_dict())
    if stored is None or stored | ({"lm_head.weight"} if config.tie_word_embeddings else set()) != expected:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file, device="cpu"))
    embedding = tensors["model.embed_tokens.weight"]
    if config.tie_word_embeddings and not torch.equal(tensors.setdefault("lm_head.weight", embedding), embedding):
        return None  # (an output projection saved apart from the embedding it is tied to)
    model.load_state_dict({name: t.to(dtype) for name, t in tensors.items()}, assign=True)
    model.tie_weights()  # (assigning gave the two names two parameters)
    return model.eval()
