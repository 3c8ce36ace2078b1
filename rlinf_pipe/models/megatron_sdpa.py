"""Megatron's local core attention through torch's fused `scaled_dot_product_attention`, padded or packed.

megatron-core's local layer spec (no Transformer Engine) computes attention as `baddbmm`, a masked softmax and
`bmm` over a materialised `[b, heads, s, s]` score tensor, with copies around them for its sequence-first layout,
and it cannot take packed sequences (Megatron's `thd` layout, which it leaves to Transformer Engine). torch's SDPA
kernel does the same math fused, on a CPU (the tiny model's Megatron training step took 1.25x a plain HF + torch
step with the local attention, docs/benchmarks.md) and on a GPU (flash or memory-efficient kernels).
`SdpaAttention` is a `DotProductAttention` (same constructor, same parameters, so checkpoints and selective
recompute are unchanged) whose forward hands the common cases to SDPA:

- padded batches (`[s, b, heads, d]`, a causal or given mask);
- packed sequences (`packed_seq_params` a `PackedSeqParams` from `packed_params`: `[t, heads, d]`, every row
  attending causally to itself only, a prompt it shares with other rows included): each row is gathered into a
  padded row for one causal SDPA call and its own tokens scattered back (attention is the small part of a step at
  RL response lengths; the projections around it run on the packed tokens only).

What SDPA does not do here (attention dropout, a softmax offset, sliding windows, attention bias, query-key layer
scaling) goes to Megatron's own forward, which cannot take packed sequences: the policy packs only where
`supports_packing` says so. Results equal Megatron's within float rounding: Megatron fills masked scores with
-10000 before the softmax and SDPA with -inf, which give the same zero weights for any row with an unmasked key
(every row of a causal mask).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from rlinf_pipe.models.context_parallel import CpLayout, gather_keys
from rlinf_pipe.models.packed_rows import PackedRows


@dataclass
class RowPackedSeqParams(PackedSeqParams):
    """Megatron's packed-sequence parameters plus where each row's tokens are in the stream (`PackedRows.gather`,
    `gather_out`), which `SdpaAttention` uses to lay the rows out as padded rows and back."""

    gather: torch.Tensor | None = None
    gather_out: torch.Tensor | None = None


def packed_params(rows: PackedRows, cp_group: Any) -> RowPackedSeqParams:
    """The `packed_seq_params` of a Megatron forward over `rows`' stream (`cp_group`: the context-parallel group,
    which Megatron's packed rotary embedding asks for)."""
    return RowPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=rows.cu_seqlens, cu_seqlens_kv=rows.cu_seqlens, max_seqlen_q=rows.max_length,
        max_seqlen_kv=rows.max_length, cp_group=cp_group, gather=rows.gather, gather_out=rows.gather_out,
    )


@dataclass
class CpPackedSeqParams(PackedSeqParams):
    """Megatron's packed-sequence parameters of this rank's share of a stream under context parallelism (`cu_seqlens`
    the rank's blocks, carrying each token's position in its block), with its `CpLayout` and the causal mask of its
    queries over their blocks' keys (`CpLayout.attention_mask`, made once per micro-batch)."""

    layout: CpLayout | None = None
    mask: torch.Tensor | None = None


def cp_packed_params(layout: CpLayout, cp_group: Any) -> CpPackedSeqParams:
    """The `packed_seq_params` of a Megatron forward over this rank's share of a stream (`layout`)."""
    return CpPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=layout.cu_seqlens, cu_seqlens_kv=layout.cu_seqlens,
        max_seqlen_q=layout.max_length, max_seqlen_kv=layout.max_length, cp_group=cp_group, layout=layout,
        mask=layout.attention_mask(),
    )


def cp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: CpLayout, mask: torch.Tensor,
                 scale: float | None, grouped: bool) -> torch.Tensor:
    """This rank's queries `[local, heads, d]` over the whole group's keys and values `[M, groups, d]` (gathered,
    rank after rank): each block's queries and keys laid out as padded rows, one SDPA call with the causal `mask`,
    the results back in local order -> `[local, heads, d]`."""
    q = query[layout.q_index].transpose(1, 2)  # [S, heads, Q, d]
    k, v = (t[layout.kv_index].transpose(1, 2) for t in (key, value))  # [S, groups, W, d]
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=grouped)
    return context.transpose(1, 2).flatten(0, 1)[layout.out_index]


class SdpaAttention(DotProductAttention):
    """`DotProductAttention` on torch's SDPA kernel, for padded and packed batches (see the module docstring), and
    for packed streams split by context parallelism (`CpPackedSeqParams`: the keys and values gathered over the CP
    group)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # Megatron's local attention refuses context parallelism, which this one does on packed streams
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)
        self.config = config

    def supports_packing(self) -> bool:
        """Whether packed sequences take the SDPA path (Megatron's own forward cannot take them)."""
        return self._sdpa_applies(None)

    def _sdpa_applies(self, attention_bias: Any) -> bool:
        return (not self.config.apply_query_key_layer_scaling and attention_bias is None
                and self.softmax_offset is None and self.scale_mask_softmax.window_size is None
                and not (self.training and self.attention_dropout.p > 0))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None, attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """`[s, b, heads, d]` query / key / value (key and value with their query groups), `attention_mask` True
        where a query must not see a key (None: causal) -> the context `[s, b, heads * d]`; packed, `[t, heads, d]`
        -> `[t, heads * d]`."""
        if isinstance(packed_seq_params, CpPackedSeqParams):
            if not self._sdpa_applies(attention_bias):
                raise ValueError("context parallelism runs attention on SDPA only: without attention dropout, bias, "
                                 "softmax offset or sliding window")
            group = packed_seq_params.cp_group
            key, value = gather_keys(key, group), gather_keys(value, group)
            context = cp_attention(query, key, value, packed_seq_params.layout, packed_seq_params.mask,
                                   self.softmax_scale, self._grouped())
            return context.reshape(query.shape[0], self.hidden_size_per_partition)
        if packed_seq_params is not None:
            if not isinstance(packed_seq_params, RowPackedSeqParams) or not self._sdpa_applies(attention_bias):
                raise ValueError("SdpaAttention takes packed sequences only as RowPackedSeqParams (packed_params), "
                                 "without attention dropout, bias, softmax offset or sliding window")
            return self._packed(query, key, value, packed_seq_params)
        if not self._sdpa_applies(attention_bias):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None, scale=self.softmax_scale, enable_gqa=self._grouped(),
        )
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                params: RowPackedSeqParams) -> torch.Tensor:
        """Each row of the stream laid out as a padded row (`gather`), causal SDPA over the rows, each stream token's
        result back into the stream (`gather_out`; right padding: a real query never sees a padding key)."""
        q, k, v = (t[params.gather].transpose(1, 2) for t in (query, key, value))  # -> [rows, heads, width, d]
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=self._grouped())
        return context.transpose(1, 2)[params.gather_out].reshape(query.shape[0], self.hidden_size_per_partition)

    def _grouped(self) -> bool:
        return self.num_attention_heads_per_partition != self.num_query_groups_per_partition


def model_supports_packing(model: torch.nn.Module) -> bool:
    """Whether every core attention of `model` takes packed sequences (an `SdpaAttention` on its SDPA path)."""
    cores = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    return bool(cores) and all(isinstance(m, SdpaAttention) and m.supports_packing() for m in cores)
