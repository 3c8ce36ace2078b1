"""The weight-sync interface: a sender publishes a version, receivers load it bucket by bucket.

    sender.publish(version, hf_tensors, checksum) -> WeightVersion     # on the actor's gathering rank
    receiver.receive(published, load_bucket, verify) -> LoadedWeights   # on every engine / log-prob worker

`WeightVersion` is what a receiver needs to find a version (small: it passes through the driver); with the
process-group transports sender and receivers run at the same time and the receivers need only
`WeightVersion(version)`. `load_bucket(bucket)` gets the HF-named tensors of one bucket as views into the
transport's memory and must be done with them when it returns (the transport then reuses that memory for a later
bucket): copy or load them inside the call, never keep them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rlinf_pipe.weights.layout import NamedTensors

LoadBucket = Callable[[NamedTensors], None]


@dataclass(frozen=True)
class WeightVersion:
    """One published version as receivers find it: its number, size, and the transport's handles (the object
    store: one object reference per bucket; none for a process group)."""

    version: int
    num_bytes: int = 0
    num_tensors: int = 0
    handles: tuple[Any, ...] = ()


@dataclass(frozen=True)
class LoadedWeights:
    """What a receiver loaded: the version, bytes and tensors of tensor data, and the buckets they came in."""

    version: int
    num_bytes: int
    num_tensors: int
    num_buckets: int


class WeightSender(ABC):
    """The sending end of a transport, on the actor's gathering rank."""

    transport: ClassVar[str]

    @abstractmethod
    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> WeightVersion:
        """Send `version`: the HF-named `tensors` in layout order (views of live parameters are fine: each is copied
        before the next is drawn). With `checksum`, every bucket carries a CRC32 that receivers can verify."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release the transport's resources."""


class WeightReceiver(ABC):
    """The receiving end of a transport, on an engine or log-prob worker."""

    transport: ClassVar[str]

    @abstractmethod
    def receive(self, published: WeightVersion, load_bucket: LoadBucket, verify: bool = False) -> LoadedWeights:
        """Receive `published` and hand each bucket to `load_bucket` (see the module docstring). Raises
        `WeightSyncError` on a wrong version or (with `verify`) a failed checksum, after the transport has taken in
        the whole version, so the next version starts clean."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release the transport's resources."""
