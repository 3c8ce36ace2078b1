"""rlinf_pipe.models.megatron_cpu: patch registry checks and a 1-process gloo training run.

test_patch_targets_unchanged is the guard against megatron-core upgrades: it fails with
the name of the patch whose call site changed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from support.megatron_train import train_tiny_gpt

from rlinf_pipe.models import megatron_cpu
from rlinf_pipe.utils.net import free_port

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only compatibility layer")



@pytest.fixture
def gloo_world_of_one():
    from megatron.core import parallel_state

    megatron_cpu.enable_cpu_compat()
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
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
    assert "update rlinf_pipe/models/megatron_cpu_patches.py" in msg


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
    result = train_tiny_gpt(tp=1, pp=1, dist_opt=False, num_micro=1, steps=5)
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(norm is not None and norm > 0 for norm in result["grad_norms"])
    assert losses[-1] < losses[0], losses


def test_model_construction_patches_applied():
    """The GPT-model call sites (RoPE table, tied-embedding copy with PP>1) are patched on the class, so every
    GPTModel built after enable_cpu_compat() runs on CPU (the PP=2 tied-embedding path itself is exercised by
    tests/integration/test_megatron_parity.py)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.language_module.language_module import LanguageModule

    assert megatron_cpu.enable_cpu_compat() is True
    names = megatron_cpu.check_patches()
    assert {"rotary-get-emb", "language-module-tied-embedding"} <= set(names)
    assert RotaryEmbedding.get_emb.__rlinf_cpu_patch__ == "rotary-get-emb"
    assert LanguageModule.setup_embeddings_and_output_layer.__rlinf_cpu_patch__ == "language-module-tied-embedding"


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_table_stays_on_cpu(interleaved):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    assert megatron_cpu.enable_cpu_compat() is True
    rope = RotaryEmbedding(
        kv_channels=8, rotary_percent=1.0, rotary_interleaved=interleaved, rotary_base=10000,
        use_cpu_initialization=True,
    )
    emb = rope(6)
    assert emb.device.type == "cpu" and rope.inv_freq.device.type == "cpu"
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    angles = torch.outer(torch.arange(6, dtype=torch.float32), inv_freq)
    expected = (torch.stack((angles, angles), dim=-1).reshape(6, -1) if interleaved
                else torch.cat((angles, angles), dim=-1))
    assert emb.shape == (6, 1, 1, 8)
    torch.testing.assert_close(emb[:, 0, 0, :], expected)
