"""rlinf_pipe.models.megatron_cpu: patch registry checks and a 1-process gloo training run.

test_patch_targets_unchanged is the guard against megatron-core upgrades: it fails with
the name of the patch whose call site changed.
"""

from __future__ import annotations

import socket
import warnings

import pytest
import torch

from rlinf_pipe.models import megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only compatibility layer")

SEQ, VOCAB, MBS = 16, 128, 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_world_of_one():
    from megatron.core import parallel_state

    megatron_cpu.enable_cpu_compat()
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_patch_targets_unchanged():
    names = megatron_cpu.check_patches()
    assert names and len(names) == len(set(names))
    described = megatron_cpu.describe_patches()
    assert [d["name"] for d in described] == names
    for d in described:
        assert d["reason"].strip(), d["name"]
        assert ":" in d["target"], d["name"]


def test_enable_is_idempotent_and_checks_still_pass():
    assert megatron_cpu.enable_cpu_compat() is True
    from megatron.core.utils import GlobalMemoryBuffer

    first = GlobalMemoryBuffer.get_tensor
    assert megatron_cpu.enable_cpu_compat() is True
    assert GlobalMemoryBuffer.get_tensor is first
    assert megatron_cpu.is_enabled()
    megatron_cpu.check_patches()  # targets are checked against the saved originals


def test_changed_target_fails_loudly(monkeypatch):
    bad = megatron_cpu.Patch(
        name="probe",
        target="megatron.core.utils:GlobalMemoryBuffer.get_tensor",
        kind="edit",
        edits=(("device='no-such-fragment'", "x", 1),),
        reason="test",
    )
    monkeypatch.setattr(megatron_cpu, "PATCHES", [*megatron_cpu.PATCHES, bad])
    with pytest.raises(megatron_cpu.MegatronCpuCompatError) as exc:
        megatron_cpu.check_patches()
    msg = str(exc.value)
    assert "probe" in msg and megatron_cpu.megatron_core_version() in msg
    assert "update rlinf_pipe/models/megatron_cpu.py" in msg


def test_unsupported_version_only_warns(monkeypatch):
    megatron_cpu.disable_cpu_compat()
    monkeypatch.setattr(megatron_cpu, "megatron_core_version", lambda: "9.9.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert megatron_cpu.enable_cpu_compat() is True
    assert any("9.9.0" in str(w.message) for w in caught)


def test_noop_when_cuda_available(monkeypatch):
    megatron_cpu.disable_cpu_compat()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_cpu.enable_cpu_compat() is False
    assert not megatron_cpu.is_enabled()


def test_gpt_trains_with_megatron_optimizer(gloo_world_of_one):
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    model = DistributedDataParallel(
        config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), [model])

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ),
        "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1),
    }

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    fwd_bwd = get_forward_backward_func()
    losses = []
    for _ in range(5):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm is not None and grad_norm > 0
        losses.append(float(out[0]["loss"]))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
