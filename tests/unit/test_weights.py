"""The weights package over real gloo groups: the layout plan (no padding: SGLang's flattened buckets), the
process-group transport's ring (many buckets per version, two receivers, a sender two buckets ahead, a consumer that
reads ahead), version and checksum errors that leave the group usable, layout checks at start-up, and what the
driver checks of what was loaded.

The members of a group run as threads of this process, each with its own TCPStore client and ProcessGroupGloo:
exactly what the workers build; a receiver runs its own event loop, as a worker's does. (The IPC transport across
processes: tests/unit/test_weights_ipc.py; the object store needs Ray: tests/integration/test_weights_object_store.py.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support.weights import make_arch, random_weights

from rlinf_pipe.models.weight_map import hf_weight_groups, hf_weight_names, hf_weight_shape
from rlinf_pipe.utils.net import free_port
from rlinf_pipe.weights import (
    LoadedWeights,
    WeightSender,
    WeightSyncError,
    WeightVersion,
    plan_weight_layout,
    publish_whole,
)
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.layout import TRAILER_BYTES
from rlinf_pipe.weights.record import FINGERPRINT_VALUES, check_loaded
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

    async def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
        got.update((name, t.clone()) for name, t in bucket)

    loaded = asyncio.run(receiver.receive(WeightVersion(version), load, verify))
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
        # back to back, no padding: SGLang receives a bucket as the tensors' bytes concatenated
        assert [s.offset for s in bucket.slots] == [0, *[s.offset + s.nbytes for s in bucket.slots[:-1]]]
        assert bucket.slots[-1].offset + bucket.slots[-1].nbytes == bucket.data_bytes
        assert bucket.trailer_bytes == TRAILER_BYTES
    assert layout.num_bytes == sum(torch.Size(hf_weight_shape(arch, n)).numel() * 4 for n in hf_weight_names(arch))
    assert len(layout.buckets) > 4
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_weight_layout(arch, torch.float32, 0)
    bare = plan_weight_layout(arch, torch.bfloat16, bucket_bytes, trailer=False)
    assert not bare.has_trailer and all(b.nbytes == b.data_bytes for b in bare.buckets)
    assert bare.num_bytes == layout.num_bytes // 2


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


def test_a_bucket_stays_intact_while_the_next_ones_arrive():
    """The ring contract: bucket i's views hold its bytes for the whole (async) load call, however long it awaits,
    while the receiver reads ahead (bucket i+1 fully arrives into the other slot) and the sender packs bucket i+2.
    The receiver posts bucket i+2 into bucket i's slot only after loading bucket i returned."""
    arch = make_arch()
    sender, receiver = form_group(arch, receivers=1, bucket_bytes=2_000)
    buckets = sender.ring.layout.buckets
    weights = random_weights(arch, seed=5)
    first_of_bucket_2 = buckets[2].slots[0].name
    sender_ahead = threading.Event()
    arrivals: list[Any] = []  # the receiver's posted broadcasts, bucket by bucket
    post = receiver.ring.broadcast
    receiver.ring.broadcast = lambda index: arrivals.append(post(index)) or arrivals[-1]
    intact: list[bool] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name == first_of_bucket_2:
                sender_ahead.set()
            yield name, tensor

    expected = dict(weights)

    async def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
        before = all(torch.equal(t, expected[name]) for name, t in bucket)
        if not intact:  # bucket 0: hold it until bucket 1 has arrived and the sender reads bucket 2's tensors
            assert len(arrivals) == 2  # bucket 2 is not posted while bucket 0 loads
            await asyncio.to_thread(arrivals[1].wait)
            assert await asyncio.to_thread(sender_ahead.wait, 60)
        intact.append(before and all(torch.equal(t, expected[name]) for name, t in bucket))

    run_members(lambda: sender.publish(0, stream()), lambda: asyncio.run(receiver.receive(WeightVersion(0), load)))
    assert sender_ahead.is_set() and intact == [True] * len(buckets) and len(arrivals) == len(buckets)


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
    sent = WeightVersion(3, num_bytes=100, num_tensors=4, checksums=(11, 22))
    check_loaded(sent, LoadedWeights(3, 100, 4, 2, (11, 22), "crc32"), "rollout/0")
    check_loaded(sent, LoadedWeights(3, 100, 4, 2), "rollout/1")  # saw no bytes: verified elsewhere, if at all
    with pytest.raises(WeightSyncError, match="rollout/1 loaded version 2"):
        check_loaded(sent, LoadedWeights(2, 100, 4, 1), "rollout/1")
    with pytest.raises(WeightSyncError, match="90 bytes"):
        check_loaded(sent, LoadedWeights(3, 90, 4, 1), "rollout/0")
    with pytest.raises(WeightSyncError, match="bucket 1 that inference/0 loaded fails its CRC32 check"):
        check_loaded(sent, LoadedWeights(3, 100, 4, 2, (11, 23), "crc32"), "inference/0")


def test_without_trailers_receivers_report_crcs_for_the_driver_and_a_fingerprint_is_recorded():
    """The layout of a group SGLang engines join: the tensors' bytes only. A torch receiver beside them computes the
    CRC32 of what it got; the driver compares it with the sender's."""
    arch = make_arch(num_layers=2)
    layout = plan_weight_layout(arch, torch.float32, 2_000, trailer=False)
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2)
    sender, receiver = run_members(lambda: open_sender("broadcast", layout, rendezvous),
                                   lambda: open_receiver("broadcast", layout, arch, "inference/0", rendezvous, 1))
    weights = random_weights(arch, seed=9)
    loaded: list[LoadedWeights] = []

    async def receive() -> None:
        async def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            pass

        loaded.append(await receiver.receive(WeightVersion(0), load, True))

    sent, _ = run_members(lambda: sender.publish(0, weights, checksum=True), lambda: asyncio.run(receive()))
    assert len(sent.checksums) == len(layout.buckets) and loaded[0].checksums == sent.checksums
    check_loaded(sent, loaded[0], "inference/0")
    names = layout.names()
    assert [name for name, _ in sent.fingerprint] == [names[0], names[len(names) // 2], names[-1]]
    values = dict(weights)
    for name, first in sent.fingerprint:
        assert list(first) == values[name].reshape(-1)[:FINGERPRINT_VALUES].tolist()


def test_our_group_meets_a_member_that_joins_the_way_sglang_does():
    """SGLang's ranks join with torch's rendezvous, a PrefixStore named after the group and
    `_new_process_group_helper` (tests/support/sglang_standin/scheduler.py): our sender's store keys must meet
    theirs, and a flattened bucket (exactly the tensors' bytes) must arrive intact."""
    from support.sglang_standin.scheduler import _join_as_sglang, _receive_broadcast

    arch = make_arch(num_layers=1)
    layout = plan_weight_layout(arch, torch.float32, 1 << 20, trailer=False)
    port = free_port()
    rendezvous = Rendezvous("127.0.0.1", port, 2, "gloo", f"compat-{port}")
    sender, member = run_members(
        lambda: open_sender("broadcast", layout, rendezvous),
        lambda: _join_as_sglang("127.0.0.1", port, 1, 2, rendezvous.group_name, "gloo", registered=True))
    weights = random_weights(arch, seed=3)
    buffer = torch.empty(layout.buckets[0].data_bytes, dtype=torch.uint8)
    run_members(lambda: sender.publish(0, weights), lambda: _receive_broadcast(member, buffer, True))
    assert torch.equal(buffer, torch.cat([t.reshape(-1).view(torch.uint8) for _, t in weights]))


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_a_receiver_waiting_for_a_lost_sender_gives_up_once_cancelled(transport):
    """A receiver whose sender never sends (lost with the step) would wait until the group's timeout (minutes); a
    `cancel()` from another thread (a worker abandoning the step) ends its receive within a wait slice."""
    arch = make_arch(num_layers=2)
    layout = plan_weight_layout(arch, torch.float32, 2_000)
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2)
    _sender, receiver = run_members(lambda: open_sender(transport, layout, rendezvous),
                                    lambda: open_receiver(transport, layout, arch, "receiver", rendezvous, 1))
    started = time.monotonic()
    threading.Timer(0.5, receiver.cancel).start()
    (error,) = run_members(lambda: receive_all(receiver, 0))
    # (not the group's timeout, 300 s, whose error would not say "abandoned"; nor before the cancel)
    assert isinstance(error, WeightSyncError) and "abandoned" in str(error)
    assert time.monotonic() - started >= 0.5


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_a_receive_asked_for_long_before_the_sender_sends_outlasts_the_group_timeout(transport):
    """A pushed version's receive is asked for while the actor still trains it (`WeightSync.push`), which may take
    longer than the weight group's timeout: the receiver waits for the sender's announcement in the group's store,
    not in a collective (which would fail at the timeout), and gets the version intact."""
    arch = make_arch(num_layers=2)
    layout = plan_weight_layout(arch, torch.float32, 2_000)
    timeout_s = 2.0  # (it also bounds the store's connection and the group's forming: not shorter on a busy host)
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2, timeout_s=timeout_s)
    sender, receiver = run_members(lambda: open_sender(transport, layout, rendezvous),
                                   lambda: open_receiver(transport, layout, arch, "receiver", rendezvous, 1))
    weights = random_weights(arch, seed=5)

    def send_late() -> Any:
        time.sleep(2.5 * timeout_s)  # (the scenario itself: training outlasting the group's timeout)
        return sender.publish(4, weights)

    started = time.monotonic()
    sent, got = run_members(send_late, lambda: receive_all(receiver, 4))
    assert not isinstance(got, Exception), got
    assert time.monotonic() - started >= 2.5 * timeout_s and sent.version == 4
    for name, tensor in weights:
        assert torch.equal(got[name], tensor), name


class _NcclStream:
    """A CUDA stream's `synchronize`, recorded with the device asked for and the calling thread."""

    calls: list[tuple[Any, str]] = []

    def __init__(self, device: Any = None):
        self.device = device

    def synchronize(self) -> None:
        _NcclStream.calls.append((self.device, threading.current_thread().name))


class _NcclWork:
    """What `ProcessGroupNCCL` hands back: `wait()` returns at once (it only orders the stream)."""

    waited = 0

    def wait(self, *timeout: Any) -> None:
        assert not timeout  # (a timed NCCL wait that expires aborts the communicator)
        _NcclWork.waited += 1


def _nccl_member(monkeypatch) -> Any:
    from rlinf_pipe.weights.process_group import GroupMember

    _NcclStream.calls, _NcclWork.waited = [], 0
    monkeypatch.setattr(torch.cuda, "current_stream", _NcclStream)
    member = GroupMember.__new__(GroupMember)
    member.backend, member.device, member.cancelled = "nccl", torch.device("cuda", 1), threading.Event()
    member.count, member.awaiting = 0, False
    return member


def test_an_nccl_receiver_waits_on_the_host_and_a_sender_only_on_its_stream(monkeypatch):
    """On NCCL `work.wait()` returns at once and only orders the CUDA stream after the collective (torch's
    `WorkNCCL::wait`): a receiver, which reads the bucket's trailer on the host next, also synchronises the stream
    of its buffers' GPU; a cancel (which aborts the communicator) then fails it. CUDA is what is faked here."""
    member = _nccl_member(monkeypatch)
    member.wait(_NcclWork())  # the sender
    assert _NcclWork.waited == 1 and _NcclStream.calls == []
    member.wait(_NcclWork(), host=True)  # a receiver
    assert _NcclWork.waited == 2 and _NcclStream.calls == [(member.device, threading.current_thread().name)]
    member.cancelled.set()
    with pytest.raises(WeightSyncError, match="abandoned"):
        member.wait(_NcclWork(), host=True)


def test_an_nccl_receiver_synchronises_every_bucket_off_its_event_loop(monkeypatch):
    """`ProcessGroupReceiver.receive` waits for each bucket in a thread, on the host, before reading it."""
    from types import SimpleNamespace

    from rlinf_pipe.weights.layout import tensor_views
    from rlinf_pipe.weights.process_group import ProcessGroupReceiver

    member = _nccl_member(monkeypatch)
    member.versions = SimpleNamespace(get=lambda key: b"sending")
    arch = make_arch()
    layout = plan_weight_layout(arch, torch.float32, 4_000, trailer=False)
    assert len(layout.buckets) >= 3
    slots = [torch.zeros(layout.max_bucket_bytes, dtype=torch.uint8) for _ in range(2)]

    def buffer(index: int) -> torch.Tensor:
        return slots[index % 2][: layout.buckets[index].nbytes]

    receiver = ProcessGroupReceiver.__new__(ProcessGroupReceiver)
    receiver.ring = SimpleNamespace(member=member, layout=layout, buffer=buffer, broadcast=lambda index: _NcclWork(),
                                    views=[tensor_views(b, buffer(i), torch.float32)
                                           for i, b in enumerate(layout.buckets)])
    loaded: list[int] = []

    async def load(bucket: Any) -> None:
        loaded.append(len(_NcclStream.calls))  # (the bucket's bytes were waited for before it is read)

    async def receive() -> str:
        await receiver.receive(WeightVersion(1), load)
        return threading.current_thread().name

    loop_thread = asyncio.run(receive())
    assert loaded == list(range(1, len(layout.buckets) + 1))
    assert all(device == member.device and thread != loop_thread for device, thread in _NcclStream.calls)


class _FailsAfter(WeightSender):
    """A sender that takes `take` tensors of the stream, then fails (a lost receiver, a cancelled send)."""

    transport = "test"

    def __init__(self, take: int):
        self.take = take

    def publish(self, version, tensors, checksum=False):
        stream = iter(tensors)
        for _ in range(self.take):
            next(stream)
        raise WeightSyncError("weight transfer abandoned: a member of the weight group was lost")


def test_a_send_that_fails_part_way_still_takes_the_gathered_stream_to_its_end():
    """The actor's stream is a collective over its TP / PP peers (they gather and send every unit): the sending
    rank draws the rest after a failed send, or its next collective would pair with the peers' last ones."""
    drawn: list[str] = []

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        for name in ["embed", "layer0", "layer1", "norm"]:
            drawn.append(name)  # (a collective with the peers, in the real stream)
            yield name, torch.zeros(1)

    with pytest.raises(WeightSyncError, match="abandoned"):
        publish_whole(_FailsAfter(2), 7, gathered())
    assert drawn == ["embed", "layer0", "layer1", "norm"]

    def broken() -> Iterator[tuple[str, torch.Tensor]]:  # a stream that fails itself is not drawn again
        yield "embed", torch.zeros(1)
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        publish_whole(_FailsAfter(5), 7, broken())


def test_the_fingerprint_leaves_out_tensors_too_large_to_read_back_by_name():
    """sglang's `get_weights_by_name` turns a whole tensor into Python floats before it keeps the first values: an
    embedding or output layer of a large vocabulary is left out of the fingerprint (all tensors where none is
    small)."""
    from rlinf_pipe.weights.layout import BucketLayout, TensorSlot, WeightLayout
    from rlinf_pipe.weights.record import FINGERPRINT_MAX_ELEMENTS, fingerprint_names

    vocab = FINGERPRINT_MAX_ELEMENTS // 64 + 1
    shapes = {"embed": (vocab, 64), "norm0": (64,), "q": (64, 64), "k_bias": (16,), "lm_head": (vocab, 64)}
    slots = tuple(TensorSlot(name, shape, 0, 4) for name, shape in shapes.items())
    assert fingerprint_names(WeightLayout("float32", (BucketLayout(slots, 20),))) == ["norm0", "q", "k_bias"]
    large = tuple(s for s in slots if s.name in ("embed", "lm_head"))
    assert fingerprint_names(WeightLayout("float32", (BucketLayout(large, 8),))) == ["embed", "lm_head"]
