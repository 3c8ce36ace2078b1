"""A lean forward pass for Llama-family decoders (Llama, Qwen2, Qwen3: the tiny models, SmolLM2, Qwen2.5) in
`TorchEngine`.

It runs the Hugging Face model's own modules' weights (so weight updates, sleep and wake apply unchanged) through
the same math as transformers' forward: RMSNorm (and Qwen3's per-head query / key norms), rotary embeddings from the model's own rotary module, grouped-query
attention with a key/value cache, SiLU-gated MLP. What it leaves out is transformers' per-call machinery (cache
objects, mask builders, output capturing, keyword plumbing), which on a small model costs more than the tensor
work: the cache is one preallocated tensor per layer for the whole batch, filled in place, and the mask comes from
the batch's 2D padding mask. Results equal transformers' within float rounding (tests/unit/test_llama_forward.py).

    forward = LlamaForward.build(model)   # None: the model is another kind; use model(...) instead
    cache = forward.new_cache(batch, capacity)
    logits = forward(ids, positions, mask, cache)   # last position's logits; the cache grows by ids.shape[1]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlinf_pipe.models.hf_config import MODEL_TYPES  # (the Llama family: Llama, Qwen2, Qwen3)

TABLE_ROPES = ("default", "llama3")  # rotary types whose cosines and sines depend on the position alone


PACK_BYTES = 2 * 1024 * 1024  # CPU float32 weights from this size (and >= PACK_MIN_IN inputs) go through oneDNN
PACK_MIN_IN = 256


class Projection:
    """One linear projection over a module's own `weight` / `bias`. On a CPU, a float32 weight of at least
    `PACK_BYTES` with at least `PACK_MIN_IN` inputs is also copied into oneDNN's format and multiplied by oneDNN
    instead of `F.linear`'s BLAS call: a decode step multiplies a few rows by every weight, so its time is the time
    to stream the weights from memory, which oneDNN does up to 3x faster at these shapes (SmolLM2-135M generates
    1.6x the tokens/s; docs/benchmarks.md#rollout-engine). Results differ from `F.linear` by float rounding (another
    summation order). The copy costs the weight's size again in memory; `refresh` renews it after a weight update.
    Smaller weights stay on `F.linear`, whose call costs less than oneDNN's conversions."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.refresh()

    def packs(self) -> bool:
        w = self.weight
        return (w.device.type == "cpu" and w.dtype == torch.float32 and w.shape[1] >= PACK_MIN_IN
                and w.numel() * w.element_size() >= PACK_BYTES and torch.backends.mkldnn.is_available())

    def refresh(self) -> None:
        """Copy the weight into oneDNN's format again (after the module's weight changed), if it is packed."""
        if not self.packs():
            self.packed = None
            return
        bias = self.bias.detach() if self.bias is not None else self.weight.new_zeros(self.weight.shape[0])
        self.packed = (self.weight.detach().to_mkldnn(), bias.to_mkldnn())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1]).to_mkldnn()
        y = torch._C._nn.mkldnn_linear(flat, *self.packed).to_dense()
        return y.view(*x.shape[:-1], y.shape[-1])


@dataclass
class _Layer:
    norm1: torch.Tensor
    norm2: torch.Tensor
    eps: float
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    gate: Projection
    up: Projection
    down: Projection
    q_norm: torch.Tensor | None = None  # (Qwen3: RMSNorm weights over each query / key head)
    k_norm: torch.Tensor | None = None

    def projections(self) -> list[Projection]:
        return [self.q, self.k, self.v, self.o, self.gate, self.up, self.down]


class KVCache:
    """Keys and values of every layer for a batch, `[rows, kv_heads, capacity, head_dim]` each; `length` positions
    are filled (the same for every row: prompts are left-padded). `rope`: the rotary cosines and sines of every
    position up to the capacity (`[capacity, head_dim]` each), when the model's rotary embedding is a plain table."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.keys, self.values, self.rope = keys, values, rope
        self.length = 0

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (those still generating)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]


def _linear(module: Any) -> Projection:
    return Projection(module.weight, module.bias)


def _norm_weight(attention: Any, name: str) -> torch.Tensor | None:
    norm = getattr(attention, name, None)
    return None if norm is None else norm.weight


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama / Qwen2 RMSNorm: normalised in float32, cast back, then scaled."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaForward:
    """The forward pass of one Llama-family model (see the module docstring)."""

    def __init__(self, model: Any):
        config = model.config
        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        # a plain table of positions: computed once per batch (dynamic variants depend on the positions asked for)
        self.rotary_table = getattr(self.rotary, "rope_type", "default") in TABLE_ROPES
        self.final_norm, self.final_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = Projection(model.lm_head.weight)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.layers = [
            _Layer(
                norm1=layer.input_layernorm.weight, norm2=layer.post_attention_layernorm.weight,
                eps=layer.input_layernorm.variance_epsilon,
                q=_linear(layer.self_attn.q_proj), k=_linear(layer.self_attn.k_proj),
                v=_linear(layer.self_attn.v_proj), o=_linear(layer.self_attn.o_proj),
                gate=_linear(layer.mlp.gate_proj), up=_linear(layer.mlp.up_proj), down=_linear(layer.mlp.down_proj),
                q_norm=_norm_weight(layer.self_attn, "q_norm"), k_norm=_norm_weight(layer.self_attn, "k_norm"),
            )
            for layer in inner.layers
        ]

    @classmethod
    def build(cls, model: Any) -> LlamaForward | None:
        """The lean forward for `model`, or None when it is not a plain Llama-family decoder (another model type,
        sliding-window attention, another activation): the caller then uses transformers' forward."""
        config = model.config
        if getattr(config, "model_type", None) not in MODEL_TYPES or getattr(config, "hidden_act", None) != "silu":
            return None
        if getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", None) and any(
                t == "sliding_attention" for t in getattr(config, "layer_types", None) or ()):
            return None
        if getattr(config, "pretraining_tp", 1) != 1:
            return None
        return cls(model)

    def refresh(self, changed: list[torch.Tensor] | None = None) -> None:
        """Renew the oneDNN copies of the weights (`Projection`) after the model's weights changed: those of the
        projections whose weight or bias is one of `changed` (the tensors themselves), or all."""
        ids = None if changed is None else {id(t) for t in changed}  # (one set look-up per tensor of a projection)
        for projection in [p for layer in self.layers for p in layer.projections()] + [self.lm_head]:
            own = (projection.weight,) if projection.bias is None else (projection.weight, projection.bias)
            if ids is None or any(id(t) in ids for t in own):
                projection.refresh()

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        like = self.embed
        rope = None
        if self.rotary_table:  # the model's own rotary module, once for every position (the same values)
            cos, sin = self.rotary(like, torch.arange(capacity, device=like.device)[None])
            rope = (cos[0], sin[0])
        return KVCache([like.new_empty(shape) for _ in self.layers], [like.new_empty(shape) for _ in self.layers],
                       rope)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits `[rows, vocab]` at the last of `ids`' positions. `ids`, `positions`: `[rows, new]` (the new
        tokens, written into the cache after its `length`); `mask`: `[rows, length + new]`, 1 where a position
        holds a real token (0: left padding)."""
        rows, new = ids.shape
        start, end = cache.length, cache.length + new
        x = F.embedding(ids, self.embed)
        cos, sin = (cache.rope[0][positions], cache.rope[1][positions]) if cache.rope else self.rotary(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        attend = self._attention_mask(mask.bool(), new)
        for layer, keys, values in zip(self.layers, cache.keys, cache.values, strict=True):
            h = _rms_norm(x, layer.norm1, layer.eps)
            q = layer.q(h).view(rows, new, self.heads, self.head_dim)
            k = layer.k(h).view(rows, new, self.kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q, k = _rms_norm(q, layer.q_norm, layer.eps), _rms_norm(k, layer.k_norm, layer.eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = layer.v(h).view(rows, new, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            keys[:, :, start:end] = k * cos + _rotate_half(k) * sin
            values[:, :, start:end] = v
            a = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=attend,
                                               scale=self.scaling, enable_gqa=self.heads != self.kv_heads)
            x = x + layer.o(a.transpose(1, 2).reshape(rows, new, self.heads * self.head_dim))
            h = _rms_norm(x, layer.norm2, layer.eps)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        cache.length = end
        return self.lm_head(_rms_norm(x[:, -1], self.final_norm, self.final_eps))

    @staticmethod
    def _attention_mask(valid: torch.Tensor, new: int) -> torch.Tensor:
        """Which keys each new query sees, `[rows, 1, new, keys]`: real tokens at or before it. A query at a padding
        position also sees itself, so that no row of the softmax is empty (its output is never used)."""
        keys = valid.shape[1]
        if new == 1:
            return valid[:, None, None, :]
        query_pos = torch.arange(keys - new, keys, device=valid.device)[:, None]
        causal = torch.arange(keys, device=valid.device)[None, :] <= query_pos
        itself = torch.arange(keys, device=valid.device)[None, :] == query_pos
        return ((causal & valid[:, None, :]) | itself[None]).unsqueeze(1)
