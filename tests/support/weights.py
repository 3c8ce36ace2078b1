"""Small architectures and random HF-named weights for the weight-sync tests."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2Config

from rlinf_pipe.models.weight_map import hf_weight_names, hf_weight_shape
from rlinf_pipe.models.arch import hf_arch


def make_arch(num_layers: int = 3, tied: bool = True) -> Any:
    return hf_arch(Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=64,
    ))


def random_weights(arch: Any, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(hf_weight_shape(arch, n), generator=g)) for n in hf_weight_names(arch)]
