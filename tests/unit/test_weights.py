"""The weights package over real gloo groups: the layout plan, the process-group transport's ring (many buckets
per version, two receivers, a sender two buckets ahead), version and checksum errors that leave the group usable,
layout checks at start-up, and what the driver checks of what was loaded.

The members of a group run as threads of this process, each with its own TCPStore client and ProcessGroupGloo:
exactly what the workers build. (The object-store transport needs Ray: tests/integration/test_weights_object_store.py.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support.weights import make_arch, random_weights

from rlinf_pipe.models.convert import hf_weight_groups, hf_weight_names, hf_weight_shape
from rlinf_pipe.runner.weight_sync import _check_loaded
from rlinf_pipe.utils.net import free_port
from rlinf_pipe.weights import LoadedWeights, WeightSyncError, WeightVersion, plan_weight_layout
from rlinf_pipe.weights.layout import ALIGN
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transports import open_receiver, open_sender


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
    """A sender and `receivers` receivers of the broadcast transport (their constructors join at once)."""
    layout = plan_weight_layout(arch, torch.float32, bucket_bytes)
    rendezvous = Rendezvous("127.0.0.1", free_port(), 1 + receivers)
    members = [lambda: open_sender("broadcast", layout, rendezvous)]
    for rank in range(1, receivers + 1):
        members.append(lambda rank=rank: open_receiver(
            "broadcast", layout, receiver_arch or arch, f"receiver {rank}", rendezvous, rank))
    return run_members(*members)


def receive_all(receiver: Any, version: int, verify: bool = False) -> dict[str, torch.Tensor]:
    """Copy each tensor inside the load call (the contract: views are reused once it returns)."""
    got: dict[str, torch.Tensor] = {}

    def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
        got.update((name, t.clone()) for name, t in bucket)

    loaded = receiver.receive(WeightVersion(version), load, verify)
    assert loaded.version == version and loaded.num_tensors == len(got)
    return got


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
    layout = sender.ring.layout
    assert len(layout.buckets) > 4  # the rings are reused many times per version
    for version in (0, 1, 2):
        weights = random_weights(arch, seed=version)
        # the sender gets views (non-contiguous transposes of contiguous storage), as the actor's stream gives
        views = [(n, t.t().contiguous().t()) for n, t in weights]
        sent, *received = run_members(
            lambda v=version, w=views: sender.publish(v, w, checksum=True),
            *[lambda r=r, v=version: receive_all(r, v, verify=True) for r in receivers],
        )
        assert (sent.version, sent.num_bytes, sent.num_tensors) == (version, layout.num_bytes, len(weights))
        for got in received:
            assert list(got) == [n for n, _ in weights]
            assert all(torch.equal(got[n], t) for n, t in weights)


def test_a_bucket_stays_intact_while_it_loads_though_the_sender_is_ahead():
    """The receiver posts bucket i+2 into bucket i's ring slot only after loading bucket i returned: a slow load
    sees bucket i's bytes while the sender has already packed bucket i+2 and waits to send it."""
    arch = make_arch()
    sender, receiver = form_group(arch, receivers=1, bucket_bytes=2_000)
    buckets = sender.ring.layout.buckets
    weights = random_weights(arch, seed=5)
    first_of_bucket_2 = buckets[2].slots[0].name
    sender_ahead = threading.Event()
    intact: list[bool] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name == first_of_bucket_2:
                sender_ahead.set()
            yield name, tensor

    expected = dict(weights)

    def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
        if not intact:  # bucket 0: hold it until the sender reads bucket 2's tensors
            assert sender_ahead.wait(timeout=60)
        intact.append(all(torch.equal(t, expected[name]) for name, t in bucket))

    run_members(lambda: sender.publish(0, stream()), lambda: receiver.receive(WeightVersion(0), load))
    assert sender_ahead.is_set() and intact == [True] * len(buckets)


def test_a_wrong_version_fails_after_draining_and_the_group_stays_usable():
    arch = make_arch(num_layers=2)
    sender, receiver = form_group(arch, receivers=1, bucket_bytes=2_000)
    weights = random_weights(arch, seed=0)
    _, error = run_members(lambda: sender.publish(7, weights), lambda: receive_all(receiver, 8))
    assert isinstance(error, WeightSyncError) and "carries version 7, expected 8" in str(error)
    _, got = run_members(lambda: sender.publish(8, weights), lambda: receive_all(receiver, 8))
    assert all(torch.equal(got[n], t) for n, t in weights)


def test_verification_needs_the_sender_checksums():
    arch = make_arch(num_layers=1)
    sender, receiver = form_group(arch, receivers=1, bucket_bytes=1 << 20)
    weights = random_weights(arch, seed=1)
    _, error = run_members(lambda: sender.publish(0, weights, checksum=False),
                           lambda: receive_all(receiver, 0, verify=True))
    assert isinstance(error, WeightSyncError) and "CRC32" in str(error) and "sent none" in str(error)


def test_a_receiver_with_another_architecture_is_refused_when_it_opens():
    layout = plan_weight_layout(make_arch(num_layers=2), torch.float32, 1 << 20)
    for transport in ("object_store", "broadcast"):
        with pytest.raises(WeightSyncError, match="does not match this worker's model") as info:
            open_receiver(transport, layout, make_arch(num_layers=3), "rollout/0",
                          Rendezvous("127.0.0.1", free_port(), 2), rank=1)
        assert "model.layers.2" in str(info.value)
    untied = plan_weight_layout(make_arch(tied=False), torch.float32, 1 << 20)
    with pytest.raises(WeightSyncError, match="'lm_head.weight'"):
        open_receiver("object_store", untied, make_arch(), "inference/0")


def test_the_sender_rejects_a_stream_that_does_not_follow_the_layout():
    arch = make_arch(num_layers=1)
    (sender,) = form_group(arch, receivers=0, bucket_bytes=1 << 20)
    weights = random_weights(arch, seed=2)
    with pytest.raises(WeightSyncError, match="expects 'model.embed_tokens.weight'"):
        sender.publish(0, weights[1:])
    with pytest.raises(WeightSyncError, match="the end of the stream"):
        sender.publish(0, weights[:-1])
    with pytest.raises(WeightSyncError, match="'extra' is not in the layout"):
        sender.publish(0, [*weights, ("extra", torch.zeros(1))])


def test_the_driver_refuses_a_receiver_that_loaded_something_else():
    sent = WeightVersion(3, num_bytes=100, num_tensors=4)
    _check_loaded(sent, [LoadedWeights(3, 100, 4, 1), LoadedWeights(3, 100, 4, 2)])
    with pytest.raises(WeightSyncError, match="receiver 2 loaded version 2"):
        _check_loaded(sent, [LoadedWeights(3, 100, 4, 1), LoadedWeights(2, 100, 4, 1)])
    with pytest.raises(WeightSyncError, match="90 bytes"):
        _check_loaded(sent, [LoadedWeights(3, 90, 4, 1)])
