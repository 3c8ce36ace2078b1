"""The IPC weight transport between real processes (spawned, as Ray's workers are separate processes): the sender
packs each bucket into one of two shared slots and hands out handles over a gloo control group; every receiver
maps the slot and loads from it without a copy between processes. On CPU the slots are POSIX shared memory (the
CUDA path, the same protocol with CUDA IPC handles, runs in tests/gpu)."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from support.weights import make_arch, random_weights

from rlinf_pipe.utils.net import free_port
from rlinf_pipe.weights import WeightSyncError, WeightVersion, plan_weight_layout
from rlinf_pipe.weights.ipc import _attach, read_handle
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transports import open_receiver, open_sender

BUCKET_BYTES = 2_000
VERSIONS = (0, 1)


def receiver_process(rendezvous: Rendezvous, rank: int, versions: list[int], results: Any, sender_at_bucket_1: Any,
                     verify: bool, bucket_bytes: int = BUCKET_BYTES) -> None:
    """One receiver: loads each version (copying inside the load call) and reports what it got, or its error. Its
    first load holds bucket 0 until the sender is packing bucket 1 (if any), then checks bucket 0 is still intact."""
    arch = make_arch()
    layout = plan_weight_layout(arch, torch.float32, bucket_bytes)
    receiver = open_receiver("ipc", layout, arch, f"rollout/{rank}", rendezvous, rank)
    for version in versions:
        got: dict[str, torch.Tensor] = {}
        intact: list[bool] = []

        async def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            before = [t.clone() for _, t in bucket]
            if not got and len(layout.buckets) > 1:
                assert await asyncio.to_thread(sender_at_bucket_1.wait, 60)
            intact.append(all(torch.equal(a, t) for a, (_, t) in zip(before, bucket, strict=True)))
            got.update((name, t.clone()) for name, t in bucket)

        try:
            loaded = asyncio.run(receiver.receive(WeightVersion(version), load, verify))
            results.put((rank, version, {n: t.numpy() for n, t in got.items()}, intact, loaded.checksums))
        except Exception as exc:  # (reported, not raised: the test fails at once instead of waiting for a result)
            results.put((rank, version, f"{type(exc).__name__}: {exc}", intact, ()))


def start_receivers(rendezvous: Rendezvous, versions: list[int], verify: bool = False,
                    bucket_bytes: int = BUCKET_BYTES) -> tuple[list[Any], Any, Any]:
    ctx = mp.get_context("spawn")
    results, event = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=receiver_process,
                         args=(rendezvous, rank, versions, results, event, verify, bucket_bytes))
             for rank in range(1, rendezvous.world)]
    for p in procs:
        p.start()
    return procs, results, event


def stream(weights: list[tuple[str, torch.Tensor]], first_of_bucket_1: str, event: Any):
    for name, tensor in weights:
        if name == first_of_bucket_1:
            event.set()
        yield name, tensor


def stop(procs: list[Any]) -> None:
    """Kill the receivers still running (a failed assertion left them waiting for versions never sent)."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def collect(results: Any, procs: list[Any], count: int) -> list[Any]:
    out = [results.get(timeout=120) for _ in range(count)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def test_versions_load_exactly_in_two_other_processes_and_a_wrong_one_fails_after_draining():
    arch = make_arch()
    layout = plan_weight_layout(arch, torch.float32, BUCKET_BYTES)
    assert len(layout.buckets) > 4  # two slots, reused many times per version
    rendezvous = Rendezvous("127.0.0.1", free_port(), 3)
    expected = [0, 1, 2, 3]
    procs, results, event = start_receivers(rendezvous, expected, verify=True)
    sender = open_sender("ipc", layout, rendezvous)
    try:
        sent = {}
        for version in (0, 1, 1, 3):  # the receivers expect version 2 third
            weights = random_weights(arch, seed=version)
            published = sender.publish(version, stream(weights, layout.buckets[1].slots[0].name, event), checksum=True)
            sent.setdefault(version, (weights, published))
            event.clear()
        reports = collect(results, procs, 2 * len(expected))
        assert sorted((rank, version) for rank, version, *_ in reports) == [(r, v) for r in (1, 2) for v in expected]
        for rank, version, got, intact, checksums in reports:
            if version == 2:
                assert got == "WeightSyncError: weight IPC of version 2: " + "; ".join(
                    f"bucket {i} carries version 1, expected 2" for i in range(len(layout.buckets)))
                continue
            weights, published = sent[version]
            assert list(got) == [n for n, _ in weights], (rank, version)
            assert all(torch.equal(torch.from_numpy(got[n]), t) for n, t in weights)
            assert intact == [True] * len(layout.buckets)
            assert checksums == published.checksums and len(checksums) == len(layout.buckets)
        assert_unnamed(sender)
    finally:
        sender.close()
        stop(procs)


def assert_unnamed(sender: Any) -> None:
    """No slot of the sender can be found by name any more: a killed run leaves nothing in /dev/shm."""
    assert sender.slots
    for slot in sender.slots:
        assert not slot.named
        with pytest.raises(FileNotFoundError):
            _attach(slot.shm.name)


def test_a_one_bucket_layout_shares_one_slot_whose_name_is_gone_once_mapped():
    arch = make_arch()
    bucket_bytes = 64 << 20
    layout = plan_weight_layout(arch, torch.float32, bucket_bytes)
    assert len(layout.buckets) == 1
    # (a short timeout: a receiver that fails without reaching its barrier leaves the sender waiting in it)
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2, timeout_s=30)
    procs, results, event = start_receivers(rendezvous, [0, 1, 2], bucket_bytes=bucket_bytes)
    sender = open_sender("ipc", layout, rendezvous)
    try:
        assert len(sender.slots) == 1 and sender.slots[0].named
        sent = {}
        # The receiver expects version 0 first and gets 9: it refuses that bucket, yet maps its block, whose name
        # is gone afterwards; versions 1 and 2 then load from the block it mapped.
        for version in (9, 1, 2):
            sent[version] = random_weights(arch, seed=version)
            sender.publish(version, iter(sent[version]))
            if version == 9:
                assert_unnamed(sender)
        reports = {version: got for _, version, got, _, _ in collect(results, procs, 3)}
        assert reports[0] == "WeightSyncError: weight IPC of version 0: bucket 0 carries version 9, expected 0"
        for version in (1, 2):
            assert all(torch.equal(torch.from_numpy(reports[version][n]), t) for n, t in sent[version]), version
    finally:
        sender.close()
        stop(procs)


class Foreign:
    """A class no handle of ours names."""


def test_a_handle_may_name_nothing_but_tensors_and_their_metadata():
    with pytest.raises(WeightSyncError, match="Foreign"):
        read_handle(pickle.dumps({"shm": "x", "nbytes": 1, "metadata": [Foreign()]}))
    payload = read_handle(pickle.dumps({"shm": "x", "nbytes": 1, "metadata": [], "dtype": torch.bfloat16,
                                        "shape": torch.Size([2, 3])}))
    assert payload["dtype"] is torch.bfloat16 and payload["shape"] == torch.Size([2, 3])
