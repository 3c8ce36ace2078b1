"""The engine's lean Llama-family forward (`rlinf_pipe.engines.rollout.llama_forward`) against transformers' own:
prefill of left-padded prompts of different lengths, then decode steps through its preallocated cache (rows
dropped on the way, as the engine does when rows finish), for both architectures and grouped-query attention."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlinf_pipe.engines.rollout.llama_forward import LlamaForward
from rlinf_pipe.models import ensure_tiny_model

PROMPTS = [[5, 9, 13, 2, 7, 11], [3, 4], [8, 8, 8, 21]]


def reference_logits(model, sequence: list[int]) -> torch.Tensor:
    """transformers' next-token logits after `sequence`, the row run alone (no padding, no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence])).logits[0, -1]


@pytest.mark.parametrize("arch,kv_heads", [("qwen2", 2), ("llama", 2), ("qwen2", 4)])
def test_lean_forward_matches_transformers_through_prefill_decode_and_dropped_rows(tmp_path, arch, kv_heads):
    folder = ensure_tiny_model(tmp_path, arch=arch, num_heads=4, num_kv_heads=kv_heads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    lean = LlamaForward.build(model)
    assert lean is not None and (lean.heads, lean.kv_heads) == (4, kv_heads)
    width, steps = max(map(len, PROMPTS)), 5
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    cache = lean.new_cache(len(PROMPTS), width + steps)
    logits = lean(ids, (mask.cumsum(-1) - 1).clamp(min=0), mask, cache)
    sequences = [list(p) for p in PROMPTS]
    for step in range(steps):
        for row, sequence in enumerate(sequences):
            torch.testing.assert_close(logits[row], reference_logits(model, sequence), atol=1e-5, rtol=1e-4)
        if step == 2:  # the middle row finishes: the batch goes on without it
            keep = torch.tensor([0, 2])
            cache.select(keep)
            mask, logits, sequences = mask[keep], logits[keep], [sequences[0], sequences[2]]
        tokens = logits.argmax(-1)
        for sequence, token in zip(sequences, tokens.tolist(), strict=True):
            sequence.append(token)
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        logits = lean(tokens[:, None], mask.sum(-1, keepdim=True) - 1, mask, cache)


def test_other_models_keep_transformers_forward(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(tmp_path), dtype=torch.float32).eval()
    model.config.hidden_act = "gelu"
    assert LlamaForward.build(model) is None
    model.config.hidden_act, model.config.model_type = "silu", "gpt2"
    assert LlamaForward.build(model) is None
