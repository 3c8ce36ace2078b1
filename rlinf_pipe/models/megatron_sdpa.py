"""Megatron's local core attention through torch's fused `scaled_dot_product_attention`, for CPU runs.

megatron-core's local layer spec (no Transformer Engine) computes attention as `baddbmm`, a masked softmax and
`bmm` over a materialised `[b, heads, s, s]` score tensor, with copies around them for its sequence-first layout.
On a CPU, torch's SDPA kernel does the same math fused: the tiny model's Megatron training step took 1.25x a plain
HF + torch step with the local attention (docs/benchmarks.md). `SdpaAttention` is a `DotProductAttention` (same
constructor, same parameters, so checkpoints and selective recompute are unchanged) whose forward hands the
common case to SDPA and falls back to Megatron's own for what SDPA does not do here (attention dropout, a softmax
offset, sliding windows, packed sequences, attention bias, query-key layer scaling, other dtypes than
float32). The results equal Megatron's within float rounding:
Megatron fills masked scores with -10000 before the softmax and SDPA with -inf, which give the same zero weights
for any row with an unmasked key (every row of a causal mask).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SdpaAttention(DotProductAttention):
    """`DotProductAttention` on torch's SDPA kernel (see the module docstring)."""

    def _sdpa_applies(self, query: torch.Tensor, attention_bias: Any, packed_seq_params: Any) -> bool:
        return (query.dtype == torch.float32 and not self.config.apply_query_key_layer_scaling
                and attention_bias is None and packed_seq_params is None and self.softmax_offset is None
                and self.scale_mask_softmax.window_size is None
                and not (self.training and self.attention_dropout.p > 0))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None, attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """`[s, b, heads, d]` query / key / value (key and value with their query groups), `attention_mask` True
        where a query must not see a key (None: causal) -> the context `[s, b, heads * d]`."""
        if not self._sdpa_applies(query, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
        grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None, scale=self.softmax_scale, enable_gqa=grouped,
        )
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
