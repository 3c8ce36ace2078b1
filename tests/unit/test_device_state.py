"""Offload / onload (`DeviceState`): storages are freed and refilled in place (views stay valid), the host copies
are allocated once and reused every cycle."""

from __future__ import annotations

import torch

from rlinf_pipe.engines.policy.optimizer import DeviceState


def test_offload_frees_refills_in_place_and_reuses_its_host_buffers():
    weight = torch.randn(64, 32)
    grads = torch.zeros(3000)
    view = grads[1000:2000]  # a view into a storage, as DDP's grad buffer hands out
    view.fill_(2.0)
    state = DeviceState(lambda: [weight, grads, view], torch.device("cpu"))
    expected_weight, expected_grads = weight.clone(), grads.clone()
    assert state.offload(force=True) == weight.numel() * 4 + grads.numel() * 4
    assert weight.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
    buffers = {key: id(buffer) for key, buffer in state.backups.items()}
    assert state.onload() == weight.numel() * 4 + grads.numel() * 4
    assert torch.equal(weight, expected_weight) and torch.equal(grads, expected_grads) and bool((view == 2).all())
    weight.add_(1)
    state.offload(force=True)
    state.onload()
    assert {key: id(buffer) for key, buffer in state.backups.items()} == buffers  # no new host allocation
    assert torch.equal(weight, expected_weight + 1)


def test_on_cpu_the_state_stays_unless_moving_is_asked_for():
    weight = torch.randn(8, 8)
    assert DeviceState(lambda: [weight], torch.device("cpu")).offload() == weight.numel() * 4  # reported, not moved
    assert weight.untyped_storage().nbytes() == weight.numel() * 4
    state = DeviceState(lambda: [weight], torch.device("cpu"), move_on_cpu=True)  # as on a GPU
    expected = weight.clone()
    state.offload()
    # no storage behind it, as on a GPU: whatever reads it now (a checkpoint saved outside a device phase did, on the
    # first GPU run) fails (on CPU, by a crash of the process: kernels read through the null pointer)
    assert weight.untyped_storage().nbytes() == 0
    state.onload()
    assert torch.equal(weight, expected)


def test_host_buffers_of_storages_gone_since_the_last_offload_are_dropped():
    weight, moments = torch.randn(16), torch.randn(16)
    tensors = [weight, moments]
    state = DeviceState(lambda: tensors, torch.device("cpu"))
    state.offload(force=True)
    state.onload()
    old = tensors[1]  # (kept alive: its storage's identity is not reused)
    tensors[1] = torch.randn(16)  # new optimizer moments (a restored rollback point allocates them)
    state.offload(force=True)
    state.onload()
    assert set(state.backups) == {t.untyped_storage()._cdata for t in tensors}  # the old moments' buffer went
    assert old.untyped_storage()._cdata not in state.backups


def test_a_storage_of_zeros_is_not_copied_and_comes_back_as_zeros():
    """The gradient buffer, zeroed after every optimizer step, is as large as the fp32 weights: it gets no host
    buffer and no copy either way; a storage with one byte set is copied as before."""
    weight, grads, moments = torch.randn(32), torch.zeros(4096), torch.zeros(64)
    moments[-1] = -0.0  # (a sign bit set: not all zero bytes)
    state = DeviceState(lambda: [weight, grads, grads[100:200], moments], torch.device("cpu"), move_on_cpu=True)
    expected = weight.clone()
    assert state.offload() == (32 + 4096 + 64) * 4  # bytes freed on the device, the zeros' too
    assert grads.untyped_storage().nbytes() == 0
    assert set(state.backups) == {weight.untyped_storage()._cdata, moments.untyped_storage()._cdata}
    assert state.onload() == (32 + 4096 + 64) * 4
    assert torch.equal(weight, expected) and torch.equal(grads, torch.zeros(4096))
    assert str(moments[-1].item()) == "-0.0"
    grads[7] = 1.5  # a gradient left in the buffer (a step cut short) is kept
    state.offload()
    state.onload()
    assert grads[7] == 1.5 and int((grads != 0).sum()) == 1
