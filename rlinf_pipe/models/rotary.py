"""The inverse frequencies of a model's rotary embedding, as transformers computes them: the default table
(`theta ** (-2i / head_dim)`) and Llama 3.x's scaled one (`rope_type: llama3`). The Megatron builder and the lean
engine both take theirs from here, so the two rotate queries and keys as the HF model does
(tests/unit/test_rotary.py compares with transformers' own functions)."""

from __future__ import annotations

import math

import torch

from rlinf_pipe.models.hf_config import Llama3Scaling


def inverse_frequencies(head_dim: int, theta: float, llama3: Llama3Scaling | None = None) -> torch.Tensor:
    """`[head_dim / 2]` float32 inverse frequencies of a rotary embedding over whole heads."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    return inv_freq if llama3 is None else _llama3(inv_freq, llama3)


def _llama3(inv_freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    """Stretch the low frequencies by `s.factor`, keep the high ones, and blend those between linearly in the
    ratio of the original context to the wavelength."""
    context = s.original_max_position_embeddings
    longest_kept, shortest_stretched = context / s.high_freq_factor, context / s.low_freq_factor
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > shortest_stretched, inv_freq / s.factor, inv_freq)
    blend = (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * stretched / s.factor + blend * stretched
    between = (wavelength >= longest_kept) & (wavelength <= shortest_stretched)
    return torch.where(between, blended, stretched)
