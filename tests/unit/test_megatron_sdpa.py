"""`SdpaAttention` (rlinf_pipe/models/megatron_sdpa.py) against megatron-core's own `DotProductAttention`: the same
context and the same gradients for a causal mask, with and without grouped-query attention, and Megatron's path
where SDPA does not apply (attention dropout in training); packed sequences against the same rows padded; and the
model's final norm, the layers' own whatever Megatron finds installed."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from rlinf_pipe.models.megatron_gpt import init_model_parallel
from rlinf_pipe.models.megatron_sdpa import SdpaAttention, model_supports_packing, packed_params
from rlinf_pipe.models.packed_rows import PackedRows
from rlinf_pipe.utils.net import free_port

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU attention")


@pytest.fixture(scope="module")
def model_parallel_of_one():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                         world_size=1)
    init_model_parallel(1, 1)  # (with the CPU patches)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the RNG tracker that Megatron's dropout forks
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _pair(groups: int, dropout: float = 0.0) -> tuple[DotProductAttention, SdpaAttention]:
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
                               attention_dropout=dropout, params_dtype=torch.float32)
    return tuple(cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
                 for cls in (DotProductAttention, SdpaAttention))


def _inputs(groups: int, s: int = 7, b: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(groups)
    return [torch.randn(s, b, heads, 8, generator=generator, requires_grad=True) for heads in (4, groups, groups)]


@pytest.mark.parametrize("groups", [4, 2])
def test_sdpa_attention_equals_megatrons_in_context_and_gradients(model_parallel_of_one, groups):
    megatron, ours = _pair(groups)
    causal = torch.triu(torch.ones(1, 1, 7, 7, dtype=torch.bool), diagonal=1)  # True = masked, as the policy gives
    results = []
    for module in (megatron, ours):
        inputs = _inputs(groups)
        context = module(*inputs, attention_mask=causal)
        (context * torch.linspace(-1, 1, context.numel()).view_as(context)).sum().backward()
        results.append((context.detach(), [t.grad for t in inputs]))
    (ref, ref_grads), (out, grads) = results
    assert out.shape == ref.shape == (7, 3, 32)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)


def test_dropout_in_training_takes_megatrons_path(model_parallel_of_one, monkeypatch):
    _, ours = _pair(4, dropout=0.5)
    calls = []
    monkeypatch.setattr(DotProductAttention, "forward", lambda self, *args: calls.append(args) or args[0])
    ours.train()
    ours(*_inputs(4), attention_mask=None)
    ours.eval()  # no dropout outside training: SDPA again
    assert ours(*_inputs(4), attention_mask=None).shape == (7, 3, 32) and len(calls) == 1


@pytest.mark.parametrize("groups", [4, 2])
def test_packed_sequences_equal_the_same_rows_padded(model_parallel_of_one, groups):
    _, ours = _pair(groups)
    lengths = [7, 3, 5]
    valid = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]  # [b, s], right-padded
    rows = PackedRows.of(valid, total=17)  # 15 real tokens and a filler sequence of 2
    padded = [t.detach() for t in _inputs(groups)]  # [s, b, heads, d]
    causal = torch.triu(torch.ones(1, 1, 7, 7, dtype=torch.bool), diagonal=1)
    weights = torch.linspace(-1, 1, 7 * 3 * 32).view(7, 3, 32)
    results = []
    for packed in (False, True):
        if packed:  # [t, heads, d]: the real tokens row after row, then the filler
            inputs = [rows.pack(t.transpose(0, 1)).requires_grad_() for t in padded]
            context = ours(*inputs, attention_mask=None, packed_seq_params=packed_params(rows, None))
            assert context.shape == (17, 32)
            context = rows.unpack(context).transpose(0, 1)  # -> [s, b, hidden]
            grads = lambda: [rows.unpack(t.grad).transpose(0, 1) for t in inputs]  # noqa: E731
        else:
            inputs = [t.clone().requires_grad_() for t in padded]
            context = ours(*inputs, attention_mask=causal).masked_fill(~valid.T[..., None], 0)
            grads = lambda: [t.grad.masked_fill(~valid.T[..., None, None], 0) for t in inputs]  # noqa: E731
        (context * weights).sum().backward()
        results.append((context.detach(), grads()))
    (ref, ref_grads), (out, out_grads) = results
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for grad, ref_grad in zip(out_grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)


def test_packing_needs_the_sdpa_path(model_parallel_of_one):
    megatron, ours = _pair(4)
    assert model_supports_packing(torch.nn.ModuleList([ours]))
    assert not model_supports_packing(torch.nn.ModuleList([megatron, ours]))
    _, dropping = _pair(4, dropout=0.5)
    dropping.train()
    assert not model_supports_packing(torch.nn.ModuleList([dropping]))
    rows = PackedRows.of(torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed sequences only"):
        dropping(*[t[:, 0] for t in _inputs(4, s=3, b=1)], attention_mask=None,
                 packed_seq_params=packed_params(rows, None))


def test_the_final_norm_is_the_layers_whatever_megatron_finds_installed(model_parallel_of_one, tmp_path, monkeypatch):
    """Given a layer spec, Megatron picks the block's final norm from what is installed: apex's FusedLayerNorm
    (which refuses RMSNorm: every last pipeline stage failed to build) or Transformer Engine's TENorm (another
    kernel than every CPU test's). The model passes its block spec, so the final norm is the layers' torch RMSNorm."""
    from megatron.core.transformer import transformer_block
    from transformers import AutoConfig

    from rlinf_pipe.models.megatron_gpt import build_gpt_model
    from rlinf_pipe.models.tiny import ensure_tiny_model

    class Refused(torch.nn.Module):  # what Megatron would find: FusedLayerNorm asserts LayerNorm
        def __init__(self, config, *args, **kwargs):
            super().__init__()
            raise AssertionError(f"({config.normalization}) is not supported in FusedLayerNorm")

    monkeypatch.setattr(transformer_block, "LayerNormImpl", Refused)
    model = build_gpt_model(AutoConfig.from_pretrained(ensure_tiny_model(tmp_path)))
    final = model.decoder.final_layernorm
    assert isinstance(final, torch.nn.RMSNorm)
    assert type(final) is type(model.decoder.layers[0].input_layernorm)
