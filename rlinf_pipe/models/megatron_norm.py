"""The norms of our Megatron layer spec: torch's `RMSNorm`, as megatron-core's local spec builds without Transformer
Engine or apex, but allowed under sequence parallelism (its `WrappedTorchNorm` refuses it).

Under sequence parallelism each tensor-parallel rank normalises its slice of the sequence, so a norm's weight gets
a partial gradient on each rank: `SequenceRMSNorm` marks its weight `sequence_parallel`, which Megatron's
`finalize_model_grads` sums over the TP group (as Transformer Engine's norms mark theirs). Qwen3's per-head query /
key norms (`HeadRMSNorm`) run after the projections have gathered the whole sequence: their gradients are partial
over heads instead, which Megatron sums for `qk_layernorm` by name; they carry no mark, or they would be summed
twice.
"""

from __future__ import annotations

from typing import Any

import torch


class SequenceRMSNorm:
    """A layer's or the final RMSNorm: `torch.nn.RMSNorm`, its weight marked for sequence parallelism when on."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.RMSNorm:  # type: ignore[misc]
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        setattr(norm.weight, "sequence_parallel", bool(config.sequence_parallel))
        return norm


class HeadRMSNorm:
    """A per-head query or key RMSNorm (Qwen3): `torch.nn.RMSNorm` over one head's features."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.RMSNorm:  # type: ignore[misc]
        return torch.nn.RMSNorm(hidden_size, eps=eps)
