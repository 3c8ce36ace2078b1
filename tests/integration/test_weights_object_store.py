"""The object-store weight transport on a real local Ray: buckets published by one process load exactly in
another, checksums are verified there, and a receiver refuses a version or a bucket count it was not built for."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from support.weights import make_arch, random_weights

from rlinf_pipe.weights import WeightSyncError, WeightVersion, plan_weight_layout
from rlinf_pipe.weights.object_store import ObjectStoreReceiver
from rlinf_pipe.weights.transports import open_receiver, open_sender

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class Receiver:
    """Another process's receiving end: loads what it receives into a dict (copying inside each load call)."""

    def __init__(self, layout, arch):
        self.receiver = open_receiver("object_store", layout, arch, "rollout/0")

    async def receive(self, published: WeightVersion, verify: bool) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}

        async def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            got.update((n, t.clone()) for n, t in bucket)

        loaded = await self.receiver.receive(published, load, verify)
        assert loaded.num_tensors == len(got) and loaded.checksums == published.checksums
        return got


@pytest.fixture(scope="module")
def local_ray():
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_published_buckets_load_exactly_in_another_process(local_ray):
    arch = make_arch()
    layout = plan_weight_layout(arch, torch.float32, 2_000)
    sender = open_sender("object_store", layout)
    receiver = Receiver.remote(layout, arch)
    for version in (0, 1):
        weights = random_weights(arch, seed=version)
        published = sender.publish(version, [(n, t.t().contiguous().t()) for n, t in weights], checksum=True)
        assert len(published.handles) == len(layout.buckets) > 4 and published.num_bytes == layout.num_bytes
        got = ray.get(receiver.receive.remote(published, True))
        assert list(got) == [n for n, _ in weights] and all(torch.equal(got[n], t) for n, t in weights)


async def test_a_receiver_refuses_what_it_was_not_built_for(local_ray):
    arch = make_arch(num_layers=1)
    layout = plan_weight_layout(arch, torch.float32, 1 << 20)
    published = open_sender("object_store", layout).publish(4, random_weights(arch, seed=0), checksum=False)
    receiver = ObjectStoreReceiver(layout)

    async def ignore(bucket: list[tuple[str, torch.Tensor]]) -> None:
        pass

    with pytest.raises(WeightSyncError, match=r"fails its CRC32 check \(the sender sent none\)"):
        await receiver.receive(published, ignore, verify=True)
    with pytest.raises(WeightSyncError, match="carries version 4, expected 5"):
        await receiver.receive(WeightVersion(5, published.num_bytes, published.num_tensors, published.handles), ignore)
    smaller = ObjectStoreReceiver(plan_weight_layout(arch, torch.float32, 1_000))
    with pytest.raises(WeightSyncError, match="buckets were published"):
        await smaller.receive(published, ignore)
