"""Weight transport through Ray's object store: each bucket is one object; receivers fetch them by reference.

Works everywhere Ray does (any node, no process group to form), at the cost of a copy into the store and one out
of it on every node: the fallback when no process group or IPC can be used.
"""

from __future__ import annotations

from collections.abc import Iterable

import ray
import torch

from rlinf_pipe.weights.api import LoadBucket, LoadedWeights, WeightReceiver, WeightSender, WeightVersion
from rlinf_pipe.weights.checks import WeightSyncError
from rlinf_pipe.weights.layout import (
    WeightLayout,
    check_bucket,
    data_crc32,
    end_of_stream,
    pack_bucket,
    tensor_views,
)
from rlinf_pipe.weights.record import VersionRecord


class ObjectStoreSender(WeightSender):
    """Packs each bucket of `layout` into a flat host buffer and puts it into the object store."""

    transport = "object_store"

    def __init__(self, layout: WeightLayout):
        self.layout = layout

    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> WeightVersion:
        stream = iter(tensors)
        record = VersionRecord(self.layout, checksum)
        handles = []
        for bucket in self.layout.buckets:
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
            views = tensor_views(bucket, buffer, self.layout.torch_dtype)
            record.packed(views, pack_bucket(bucket, buffer, views, stream, version, checksum))
            handles.append(ray.put(buffer))
        end_of_stream(stream)
        return record.version(version, tuple(handles))


class ObjectStoreReceiver(WeightReceiver):
    """Fetches the buckets of a published version one at a time; `layout` is the sender's (checked at start-up)."""

    transport = "object_store"

    def __init__(self, layout: WeightLayout):
        self.layout = layout

    async def receive(self, published: WeightVersion, load_bucket: LoadBucket, verify: bool = False) -> LoadedWeights:
        if len(published.handles) != len(self.layout.buckets):
            raise WeightSyncError(
                f"weight sync of version {published.version}: {len(published.handles)} buckets were published, this "
                f"worker's layout has {len(self.layout.buckets)} (the actor's and this worker's models differ, or "
                "runner.weight_bucket_mb differs between them)"
            )
        errors, crcs = [], []
        for index, (bucket, handle) in enumerate(zip(self.layout.buckets, published.handles, strict=True)):
            buffer = await handle
            error = check_bucket(index, bucket, buffer, published.version, verify)
            if error:
                errors.append(error)
            elif not errors:
                if verify:
                    crcs.append(data_crc32(bucket, buffer))
                await load_bucket(tensor_views(bucket, buffer, self.layout.torch_dtype))
        if errors:
            raise WeightSyncError(f"weight sync of version {published.version}: " + "; ".join(errors))
        return LoadedWeights(published.version, self.layout.num_bytes, self.layout.num_tensors,
                             len(self.layout.buckets), tuple(crcs),
                             "crc32" if verify else "")
