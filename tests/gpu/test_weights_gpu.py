"""Weight transport on GPUs, between real processes: what every receiver loads equals what was sent, bit for bit,
over CUDA IPC (one GPU: the sender's slot mapped by another process) and over an NCCL broadcast (two GPUs), in
bf16, with the CRC32 of every bucket verified on arrival."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from support.gpu import backend, device, needs_gpus
from support.weights import make_arch, random_weights

from rlinf_pipe.utils.net import free_port
from rlinf_pipe.weights import WeightVersion, plan_weight_layout
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.record import check_loaded
from rlinf_pipe.weights.transports import open_receiver, open_sender

pytestmark = pytest.mark.gpu

BUCKET_BYTES = 4_000  # many buckets: both ring / slot entries are reused within a version
DTYPE = torch.bfloat16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int16)


def _receiver(transport: str, rendezvous: Rendezvous, rank: int, gpu: int, versions: list[int], out: Any) -> None:
    if device().type == "cuda":
        torch.cuda.set_device(gpu)
    arch = make_arch()
    layout = plan_weight_layout(arch, DTYPE, BUCKET_BYTES)
    receiver = open_receiver(transport, layout, arch, f"rollout/{rank}", rendezvous, rank)
    for version in versions:
        got: dict[str, torch.Tensor] = {}

        async def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            assert all(t.device.type == device().type for _, t in bucket)  # no host round trip on the GPU path
            got.update((name, _bits(t).clone()) for name, t in bucket)

        loaded = asyncio.run(receiver.receive(WeightVersion(version), load, verify=True))
        out.put((rank, version, {n: t.numpy() for n, t in got.items()}, loaded))


def _run(transport: str, receivers: list[int]) -> None:
    """Send two versions from GPU 0 to a receiver process per entry of `receivers` (its GPU); check every byte."""
    arch = make_arch()
    layout = plan_weight_layout(arch, DTYPE, BUCKET_BYTES)
    assert len(layout.buckets) > 4
    group_backend = backend() if transport == "broadcast" else "gloo"
    rendezvous = Rendezvous("127.0.0.1", free_port(), 1 + len(receivers), group_backend, f"gpu-test-{transport}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(transport, rendezvous, rank, gpu, [0, 1], out))
             for rank, gpu in enumerate(receivers, start=1)]
    for p in procs:
        p.start()
    try:
        sender = open_sender(transport, layout, rendezvous)
        sent = {}
        for version in (0, 1):
            weights = [(n, t.to(device(), DTYPE)) for n, t in random_weights(arch, seed=version)]
            published = sender.publish(version, iter(weights), checksum=True)
            sent[version] = (published, {n: _bits(t).numpy() for n, t in weights})
        results = [out.get(timeout=300) for _ in range(2 * len(receivers))]
    finally:
        for p in procs:
            p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs)
    for rank, version, got, loaded in results:
        published, expected = sent[version]
        check_loaded(published, loaded, f"rollout/{rank}")  # counts, version and every bucket's CRC32
        assert loaded.verified_by == "crc32" and set(got) == set(expected)
        for name, bits in expected.items():
            assert (got[name] == bits).all(), f"rank {rank} version {version}: {name} differs"


def test_ipc_weights_load_bitwise_in_another_process_on_the_same_gpu():
    _run("ipc", receivers=[0])


@needs_gpus(2)
def test_nccl_broadcast_weights_load_bitwise_on_another_gpu():
    _run("broadcast", receivers=[1])
