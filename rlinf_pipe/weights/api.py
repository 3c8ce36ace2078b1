"""The weight-sync interface: a sender publishes a version, receivers load it bucket by bucket.

    sender.publish(version, hf_tensors, checksum) -> WeightVersion            # the actor's gathering rank (blocking)
    await receiver.receive(published, load_bucket, verify) -> LoadedWeights   # every engine / log-prob worker

`WeightVersion` is what a receiver needs to find a version (small: it passes through the driver); with the
transports that send and receive at once (`broadcast`, `ipc`) the receivers need only `WeightVersion(version)`.
`await load_bucket(bucket)` gets the HF-named tensors of one bucket as views into the transport's memory and must
be done with them when it returns (the transport then reuses that memory for a later bucket): copy or load them
inside the call, never keep them. Receiving is async because engines such as SGLang are driven from the worker's
event loop; a transport's blocking waits run in threads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rlinf_pipe.weights.layout import NamedTensors

LoadBucket = Callable[[NamedTensors], Awaitable[None]]


@dataclass(frozen=True)
class WeightVersion:
    """One published version as receivers find it: its number, size, the transport's handles (the object store: one
    object reference per bucket; none for the others), and with checksums the CRC32 of every bucket's tensor bytes
    and a fingerprint (the first values of a few tensors, by name) for receivers that can only read back by name."""

    version: int
    num_bytes: int = 0
    num_tensors: int = 0
    handles: tuple[Any, ...] = ()
    checksums: tuple[int, ...] = ()
    fingerprint: tuple[tuple[str, tuple[float, ...]], ...] = ()


@dataclass(frozen=True)
class LoadedWeights:
    """What a receiver loaded: the version, bytes and tensors of tensor data, the buckets they came in, and with
    `verify` the CRC32 of every bucket it received (empty when it cannot see the bytes, e.g. SGLang's own ranks)
    and how it verified them (`crc32`, `name`: read back by name and compared with the fingerprint, or "": it
    could not)."""

    version: int
    num_bytes: int
    num_tensors: int
    num_buckets: int
    checksums: tuple[int, ...] = ()
    verified_by: str = ""


class WeightSender(ABC):
    """The sending end of a transport, on the actor's gathering rank."""

    transport: ClassVar[str]

    def cancel(self) -> None:
        """From another thread: make a `publish` blocked on a lost peer fail now (a step abandoned after a lost
        worker); the end is unusable afterwards and the transport is opened anew. Nothing blocks by default."""

    @abstractmethod
    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> WeightVersion:
        """Send `version`: the HF-named `tensors` in layout order (views of live parameters are fine: each is copied
        before the next is drawn). With `checksum`, every bucket carries a CRC32 that receivers can verify (when
        the layout has trailers)."""


def publish_whole(sender: WeightSender, version: int, tensors: Iterable[tuple[str, torch.Tensor]],
                  checksum: bool = False) -> WeightVersion:
    """`sender.publish(version, tensors, checksum)`, after which the rest of `tensors` is drawn whatever happened:
    a stream gathered from model-parallel peers is a collective that every rank must take to its end (a send that
    failed or was cancelled part-way would leave this rank's next collective paired with the peers' last ones)."""
    stream = iter(tensors)
    try:
        return sender.publish(version, stream, checksum)
    finally:
        for _ in stream:
            pass


class WeightReceiver(ABC):
    """The receiving end of a transport, on an engine or log-prob worker."""

    transport: ClassVar[str]

    def cancel(self) -> None:
        """From another thread: make a `receive` blocked on a lost peer fail now (see `WeightSender.cancel`)."""

    @abstractmethod
    async def receive(self, published: WeightVersion, load_bucket: LoadBucket, verify: bool = False) -> LoadedWeights:
        """Receive `published` and hand each bucket to `load_bucket` (see the module docstring). Raises
        `WeightSyncError` on a wrong version or (with `verify`) a failed checksum, after the transport has taken in
        the whole version, so the next version starts clean."""
