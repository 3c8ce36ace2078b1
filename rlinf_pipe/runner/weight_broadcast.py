"""Weight sync over a direct process group (`runner.weight_sync: broadcast`, disaggregated mode).

The actor's gathering rank (rank 0) and every rollout and log-prob worker join one gloo group (its own TCPStore;
separate from each component's torch.distributed world). A sync streams the HF-named buckets: for each bucket the
root broadcasts a header (the tensors' names, shapes and dtypes, pickled) and then the bucket as one flat byte
buffer; an empty header ends the version. Receivers unflatten views of the buffer and load them.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightBroadcastGroup:
    """A gloo group of `world` processes for weight broadcasts from rank 0 (this process is `rank`)."""

    def __init__(self, addr: str, port: int, rank: int, world: int, timeout_s: float = 300.0):
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(addr, port, world, rank == 0, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.rank, self.world = rank, world

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()

    def _broadcast_bytes(self, payload: bytes | None) -> bytes:
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self._broadcast(size)
        buffer = torch.empty(int(size), dtype=torch.uint8)
        if payload is not None and len(payload):
            buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if int(size):
            self._broadcast(buffer)
        return buffer.numpy().tobytes()

    def send(self, buckets: Iterable[NamedTensors]) -> int:
        """Root: broadcast every bucket, then the end marker; returns the bytes sent."""
        sent = 0
        for bucket in buckets:
            specs = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket]
            self._broadcast_bytes(pickle.dumps(specs))
            flat = torch.cat([t.detach().contiguous().cpu().reshape(-1).view(torch.uint8) for _, t in bucket])
            self._broadcast(flat)
            sent += flat.numel()
        self._broadcast_bytes(b"")
        return sent

    def receive(self) -> Iterator[NamedTensors]:
        """Receivers: yield the buckets of one version as they arrive."""
        while True:
            header = self._broadcast_bytes(None)
            if not header:
                return
            specs = pickle.loads(header)  # noqa: S301 - from our own actor, inside the job
            sizes = [torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, dt)).element_size()
                     for _, shape, dt in specs]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            self._broadcast(flat)
            bucket, offset = [], 0
            for (name, shape, dt), size in zip(specs, sizes, strict=True):
                bucket.append((name, flat[offset : offset + size].view(getattr(torch, dt)).reshape(shape)))
                offset += size
            yield bucket
