"""The broadcast weight-sync protocol (`rlinf_pipe.runner.weight_broadcast`) over real gloo groups.

The members of a group run as threads of this process (each with its own TCPStore client and ProcessGroupGloo,
exactly what the workers build): the layout plan, the layout agreement and its checks, many-bucket versions
through the two-buffer rings, version and checksum errors that leave the group usable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import Qwen2Config

from rlinf_pipe.models.convert import hf_weight_groups, hf_weight_names, hf_weight_shape
from rlinf_pipe.models.megatron_gpt import hf_arch
from rlinf_pipe.runner.weight_broadcast import (
    ALIGN,
    WeightBroadcastGroup,
    join_as_receiver,
    join_as_sender,
    plan_weight_layout,
)
from rlinf_pipe.runner.weight_sync import WeightSyncError
from rlinf_pipe.utils.net import free_port


def make_arch(num_layers: int = 3, tied: bool = True) -> Any:
    return hf_arch(Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, max_position_embeddings=64,
    ))


def random_weights(arch: Any, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(hf_weight_shape(arch, n), generator=g)) for n in hf_weight_names(arch)]


def run_members(*members: Callable[[], Any]) -> list[Any]:
    """Run each member in its own thread; returns results (or the exceptions raised)."""
    results: list[Any] = [None] * len(members)

    def call(i: int) -> None:
        try:
            results[i] = members[i]()
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a group member hung"
    return results


def form_group(arch: Any, receivers: int, bucket_bytes: int, receiver_arch: Any = None) -> list[Any]:
    port = free_port()
    members = [lambda: join_as_sender("127.0.0.1", port, 1 + receivers, arch, torch.float32, bucket_bytes)]
    for rank in range(1, receivers + 1):
        members.append(lambda rank=rank: join_as_receiver(
            "127.0.0.1", port, rank, 1 + receivers, receiver_arch or arch, f"receiver {rank}"))
    return run_members(*members)


def receive_all(group: WeightBroadcastGroup, version: int, verify: bool = False) -> dict[str, torch.Tensor]:
    """Copy each tensor out before asking for the next bucket (the contract)."""
    return {name: t.clone() for bucket in group.receive(version, verify) for name, t in bucket}


def test_layout_never_splits_a_conversion_group_and_bounds_buckets():
    arch = make_arch()
    bucket_bytes = 3_000
    layout = plan_weight_layout(arch, torch.float32, bucket_bytes)
    assert layout.names() == hf_weight_names(arch)
    bucket_of = {s.name: i for i, b in enumerate(layout.buckets) for s in b.slots}
    for group in hf_weight_groups(arch):
        assert len({bucket_of[n] for n in group}) == 1, group
    group_of = {n: g for g in hf_weight_groups(arch) for n in g}
    for bucket in layout.buckets:
        groups = {group_of[s.name] for s in bucket.slots}
        assert bucket.data_bytes <= bucket_bytes or len(groups) == 1  # only a group too big alone overflows
        assert all(s.offset % ALIGN == 0 for s in bucket.slots)
        ends = [s.offset + s.nbytes for s in bucket.slots]
        assert ends == sorted(ends) and ends[-1] <= bucket.data_bytes
    assert layout.num_bytes == sum(torch.Size(hf_weight_shape(arch, n)).numel() * 4 for n in hf_weight_names(arch))
    assert len(layout.buckets) > 4
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_weight_layout(arch, torch.float32, 0)


def test_versions_arrive_exactly_through_two_receivers_and_many_buckets():
    arch = make_arch()
    sender, *receivers = form_group(arch, receivers=2, bucket_bytes=2_000)
    assert len(sender.layout.buckets) > 4  # the rings are reused many times per version
    for version in (0, 1, 2):
        weights = random_weights(arch, seed=version)
        # the sender gets views (non-contiguous transposes of contiguous storage), as the actor's stream gives
        views = [(n, t.t().contiguous().t()) for n, t in weights]
        sent, *received = run_members(
            lambda v=version, w=views: sender.send(v, w, checksum=True),
            *[lambda r=r, v=version: receive_all(r, v, verify=True) for r in receivers],
        )
        assert sent == sender.layout.num_bytes
        for got in received:
            assert list(got) == [n for n, _ in weights]
            assert all(torch.equal(got[n], t) for n, t in weights)


def test_a_wrong_version_fails_after_draining_and_the_group_stays_usable():
    arch = make_arch(num_layers=2)
    sender, receiver = form_group(arch, receivers=1, bucket_bytes=2_000)
    weights = random_weights(arch, seed=0)
    _, error = run_members(lambda: sender.send(7, weights), lambda: receive_all(receiver, 8))
    assert isinstance(error, WeightSyncError) and "carries version 7, expected 8" in str(error)
    _, got = run_members(lambda: sender.send(8, weights), lambda: receive_all(receiver, 8))
    assert all(torch.equal(got[n], t) for n, t in weights)


def test_verification_needs_the_sender_checksums():
    arch = make_arch(num_layers=1)
    sender, receiver = form_group(arch, receivers=1, bucket_bytes=1 << 20)
    weights = random_weights(arch, seed=1)
    _, error = run_members(lambda: sender.send(0, weights, checksum=False),
                           lambda: receive_all(receiver, 0, verify=True))
    assert isinstance(error, WeightSyncError) and "CRC32" in str(error) and "sent none" in str(error)


def test_a_receiver_with_another_architecture_fails_when_the_group_forms():
    results = form_group(make_arch(num_layers=2), receivers=1, bucket_bytes=1 << 20,
                         receiver_arch=make_arch(num_layers=3))
    error = results[1]
    assert isinstance(error, WeightSyncError)
    assert "does not match this worker's model" in str(error) and "model.layers.2" in str(error)
    untied = form_group(make_arch(tied=False), receivers=1, bucket_bytes=1 << 20, receiver_arch=make_arch())
    assert isinstance(untied[1], WeightSyncError) and "'lm_head.weight'" in str(untied[1])


def test_the_sender_rejects_a_stream_that_does_not_follow_the_layout():
    arch = make_arch(num_layers=1)
    (sender,) = form_group(arch, receivers=0, bucket_bytes=1 << 20)
    weights = random_weights(arch, seed=2)
    with pytest.raises(WeightSyncError, match="expects 'model.embed_tokens.weight'"):
        sender.send(0, weights[1:])
    with pytest.raises(WeightSyncError, match="the end of the stream"):
        sender.send(0, weights[:-1])
    with pytest.raises(WeightSyncError, match="'extra' is not in the layout"):
        sender.send(0, [*weights, ("extra", torch.zeros(1))])
