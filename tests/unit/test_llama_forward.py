"""The engine's lean Llama-family forward (`rlinf_pipe.engines.rollout.llama_forward`) against transformers' own:
prefill of left-padded prompts of different lengths, then decode steps through its preallocated cache (rows
dropped on the way, as the engine does when rows finish), for both architectures and grouped-query attention, with
the projections on `F.linear` and on oneDNN copies of the weights (`Projection`: forced for every weight here,
the tiny model's being under the size where the engine packs them)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlinf_pipe.engines.rollout import GenerateRequest, SamplingParams, TorchEngine, llama_forward
from rlinf_pipe.engines.rollout.llama_forward import LlamaForward
from rlinf_pipe.models import ensure_tiny_model

PROMPTS = [[5, 9, 13, 2, 7, 11], [3, 4], [8, 8, 8, 21]]


def reference_logits(model, sequence: list[int]) -> torch.Tensor:
    """transformers' next-token logits after `sequence`, the row run alone (no padding, no cache)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence])).logits[0, -1]


def pack_everything(monkeypatch) -> None:
    """Every float32 CPU projection goes through oneDNN, whatever its size."""
    monkeypatch.setattr(llama_forward, "PACK_BYTES", 0)
    monkeypatch.setattr(llama_forward, "PACK_MIN_IN", 0)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("arch,kv_heads", [("qwen2", 2), ("llama", 2), ("qwen2", 4), ("qwen3", 2), ("llama3", 1)])
def test_lean_forward_matches_transformers_through_prefill_decode_and_dropped_rows(tmp_path, arch, kv_heads, packed,
                                                                                   monkeypatch):
    if packed:
        pack_everything(monkeypatch)
    folder = ensure_tiny_model(tmp_path, arch=arch, num_heads=4, num_kv_heads=kv_heads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    lean = LlamaForward.build(model)
    assert lean is not None and (lean.heads, lean.kv_heads) == (4, kv_heads)
    assert (lean.lm_head.packed is not None) == packed
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


def test_default_packing_takes_only_large_cpu_float32_weights():
    wide = llama_forward.Projection(torch.zeros(1536, 576))  # 3.4 MiB, 576 inputs: packed
    assert wide.packed is not None and wide.packed[0].is_mkldnn
    assert llama_forward.Projection(torch.zeros(151936, 64)).packed is None  # large, but 64 inputs
    assert llama_forward.Projection(torch.zeros(192, 576)).packed is None  # 0.4 MiB
    assert llama_forward.Projection(torch.zeros(1536, 576, dtype=torch.bfloat16)).packed is None


def test_packed_weights_follow_a_weight_update(tmp_path, monkeypatch):
    pack_everything(monkeypatch)
    engine = TorchEngine(ensure_tiny_model(tmp_path), cpu_threads=1)
    assert engine.lean is not None and engine.lean.lm_head.packed is not None
    generator = torch.Generator().manual_seed(3)
    new = [(name, torch.randn(t.shape, generator=generator) * 0.1) for name, t in engine.model.state_dict().items()]

    def greedy(prompt: list[int]) -> list[int]:
        params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        request = GenerateRequest(request_id="r", prompt_ids=prompt, sampling=params)

        async def run():
            return [r async for r in engine.generate([request])]

        return asyncio.run(run())[0].samples[0].response_ids

    before = greedy(PROMPTS[0])
    asyncio.run(engine.update_weights(new, version=1))
    reference = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(tmp_path), dtype=torch.float32).eval()
    reference.load_state_dict(engine.model.state_dict())
    sequence = list(PROMPTS[0])
    for token in greedy(PROMPTS[0]):  # each greedy token is the argmax of transformers' logits on the new weights
        assert token == int(reference_logits(reference, sequence).argmax())
        sequence.append(token)
    assert sequence[len(PROMPTS[0]):] != before


def test_rows_of_one_prompt_prefill_it_once_and_decode_as_if_alone(tmp_path, monkeypatch):
    """A request's samples share their prompt: the batch prefills each distinct prompt once, and every row then
    holds the keys, values and logits it would have computed alone (and samples the same tokens)."""
    from rlinf_pipe.engines.rollout.batch import DecodeBatch, SampleState

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(tmp_path), dtype=torch.float32).eval()
    lean = LlamaForward.build(model)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[1]]

    def batch() -> DecodeBatch:
        rows = [SampleState(i, 0, p, torch.Generator().manual_seed(i), 1.0, 0, 1.0, 6, frozenset(), 0)
                for i, p in enumerate(prompts)]
        return DecodeBatch(model, rows, 0, torch.device("cpu"), lean)

    prefilled_rows = []
    call = LlamaForward.__call__
    monkeypatch.setattr(LlamaForward, "__call__", lambda self, ids, *a: prefilled_rows.append(ids.shape) or call(
        self, ids, *a))
    shared = batch()
    shared.prefill()
    assert prefilled_rows == [(3, 6)]  # the three distinct prompts, once each
    alone = batch()
    alone._forward(alone._ids, (alone.mask.cumsum(-1) - 1).clamp_(min=0), logits_to_keep=1)  # every row itself
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(shared.logits[row], reference_logits(model, prompt), atol=1e-5, rtol=1e-4)
    assert shared.cache.length == alone.cache.length == 6
    for a, b in zip(shared.cache.keys + shared.cache.values, alone.cache.keys + alone.cache.values, strict=True):
        torch.testing.assert_close(a[:, :, :6], b[:, :, :6], atol=1e-6, rtol=1e-5)
    samples = [list(shared.rows), list(alone.rows)]
    while shared.active or alone.active:
        shared.step()
        alone.step()
    assert [r.tokens for r in samples[0]] == [r.tokens for r in samples[1]]
    assert all(len(r.tokens) == 6 for r in samples[0])


def test_a_bucket_refreshes_the_packed_copies_of_what_it_loaded_even_when_it_fails_part_way(tmp_path, monkeypatch):
    pack_everything(monkeypatch)
    engine = TorchEngine(ensure_tiny_model(tmp_path), cpu_threads=1)
    q, k = engine.lean.layers[0].q, engine.lean.layers[0].k
    stale_k = k.packed[0].to_dense().clone()
    new = torch.full(q.weight.shape, 0.5)
    with pytest.raises(ValueError, match="unknown parameter name 'nope'"):
        asyncio.run(engine.update_weights([("model.layers.0.self_attn.q_proj.weight", new), ("nope", new)], 1))
    assert torch.equal(q.packed[0].to_dense(), new)  # loaded, then renewed in the same call
    assert torch.equal(k.packed[0].to_dense(), stale_k) and engine.version == 0  # untouched; the version unchanged
