"""The byte layout of one weight version, shared by every transport.

The actor's HF-named tensors are packed back to back into buckets of about `runner.weight_bucket_mb`, split only
between the groups of tensors that convert together (`weight_map.hf_weight_groups`), so every bucket loads on its
own. A bucket is one flat byte buffer: the tensors' bytes in order with no padding (one dtype per version, so every
tensor is aligned to its element size: SGLang's "flattened bucket" format), then, when the layout has one, a
16-byte trailer (the version and a CRC32 or 0) that receivers check. A process group that SGLang engines join
carries no trailer (their receiving end takes exactly the tensors' bytes). The layout is planned from the model
architecture, so sender and receivers agree on it without sending names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlinf_pipe.weights.checks import WeightSyncError, bytes_crc32

NamedTensors = list[tuple[str, torch.Tensor]]
TRAILER_BYTES = 16  # int64 version, int64 CRC32 of the bucket's tensor bytes (0: not verified)


@dataclass(frozen=True)
class TensorSlot:
    """Where one HF tensor lies in its bucket buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    """The tensors of one bucket: `data_bytes` of tensor data, then `trailer_bytes` (0 or `TRAILER_BYTES`)."""

    slots: tuple[TensorSlot, ...]
    data_bytes: int
    trailer_bytes: int = TRAILER_BYTES

    @property
    def nbytes(self) -> int:
        return self.data_bytes + self.trailer_bytes


@dataclass(frozen=True)
class WeightLayout:
    """The byte layout of one weight version: its dtype and buckets, in stream order."""

    dtype: str
    buckets: tuple[BucketLayout, ...]

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data (what a version weighs, without trailers)."""
        return sum(b.data_bytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.slots) for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max(b.nbytes for b in self.buckets)

    @property
    def has_trailer(self) -> bool:
        return any(b.trailer_bytes for b in self.buckets)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def names(self) -> list[str]:
        return [s.name for b in self.buckets for s in b.slots]


def plan_weight_layout(arch: Any, dtype: torch.dtype, bucket_bytes: int, trailer: bool = True) -> WeightLayout:
    """Pack the HF tensors of `arch` (a `models.megatron_gpt.HfArch`) in stream order into buckets of at most
    `bucket_bytes` of data, never splitting a conversion group (a group larger than `bucket_bytes` gets a bucket
    of its own); `trailer` adds the version / CRC32 trailer to every bucket."""
    from rlinf_pipe.models.weight_map import hf_weight_groups, hf_weight_shape

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    element = torch.empty(0, dtype=dtype).element_size()
    trailer_bytes = TRAILER_BYTES if trailer else 0
    buckets: list[BucketLayout] = []
    slots: list[TensorSlot] = []
    offset = 0
    for group in hf_weight_groups(arch):
        shapes = [hf_weight_shape(arch, name) for name in group]
        sizes = [torch.Size(shape).numel() * element for shape in shapes]
        if slots and offset + sum(sizes) > bucket_bytes:
            buckets.append(BucketLayout(tuple(slots), offset, trailer_bytes))
            slots, offset = [], 0
        for name, shape, nbytes in zip(group, shapes, sizes, strict=True):
            slots.append(TensorSlot(name, shape, offset, nbytes))
            offset += nbytes
    if slots:
        buckets.append(BucketLayout(tuple(slots), offset, trailer_bytes))
    return WeightLayout(str(dtype).removeprefix("torch."), tuple(buckets))


def check_layout(layout: WeightLayout, arch: Any, who: str) -> None:
    """`WeightSyncError` unless `layout` streams exactly the HF tensors of `arch`, with their shapes, in order."""
    from rlinf_pipe.models.weight_map import hf_weight_names, hf_weight_shape

    sent = [(s.name, s.shape) for b in layout.buckets for s in b.slots]
    wanted = [(name, hf_weight_shape(arch, name)) for name in hf_weight_names(arch)]
    if sent == wanted:
        return
    first = next((i for i, (a, b) in enumerate(zip(sent, wanted, strict=False)) if a != b), min(len(sent), len(wanted)))
    got = f"{sent[first][0]!r} {sent[first][1]}" if first < len(sent) else "nothing more"
    want = f"{wanted[first][0]!r} {wanted[first][1]}" if first < len(wanted) else "nothing more"
    raise WeightSyncError(
        f"{who}: the actor's weight stream does not match this worker's model: tensor {first} is {got}, this model "
        f"needs {want}. The actor and the rollout/inference models must have the same architecture "
        "(actor.model_path, rollout.model_path)."
    )


def tensor_views(bucket: BucketLayout, buffer: torch.Tensor, dtype: torch.dtype) -> NamedTensors:
    """The bucket's tensors as views into its flat uint8 `buffer` (on any device)."""
    return [(s.name, buffer[s.offset : s.offset + s.nbytes].view(dtype).view(s.shape)) for s in bucket.slots]


def data_crc32(bucket: BucketLayout, buffer: torch.Tensor) -> int:
    """CRC32 of a bucket's tensor bytes (on any device)."""
    return bytes_crc32(buffer[: bucket.data_bytes].cpu())


def pack_bucket(
    bucket: BucketLayout, buffer: torch.Tensor, views: NamedTensors, stream: Iterator[tuple[str, torch.Tensor]],
    version: int, checksum: bool,
) -> int | None:
    """Copy the bucket's tensors from `stream` (HF-named, in layout order; each is copied before the next is drawn,
    so views of live parameters are fine) into `buffer` through its `views` (`tensor_views`, which a sender may
    keep for a buffer it reuses) and write the trailer, if the bucket has one. Returns the CRC32 of the tensor bytes
    with `checksum`, else None."""
    for (name, view), want in zip(views, bucket.slots, strict=True):
        got_name, tensor = next(stream, (None, None))
        if got_name != name or tuple(tensor.shape) != want.shape:
            got = "the end of the stream" if got_name is None else f"{got_name!r} {tuple(tensor.shape)}"
            raise WeightSyncError(f"weight sync: the layout expects {name!r} {want.shape}, got {got}")
        view.copy_(tensor)
    crc = data_crc32(bucket, buffer) if checksum else None
    if bucket.trailer_bytes:
        trailer = torch.tensor([version, crc or 0], dtype=torch.int64)
        buffer[bucket.data_bytes : bucket.nbytes].copy_(trailer.view(torch.uint8))
    return crc


def check_bucket(index: int, bucket: BucketLayout, buffer: torch.Tensor, version: int, verify: bool) -> str | None:
    """What is wrong with a received bucket (its trailer's version, its CRC32 when `verify`), or None. A bucket
    without a trailer carries neither (the driver checks versions; `verify` then falls to the receiver)."""
    if not bucket.trailer_bytes:
        return None
    sent_version, crc = buffer[bucket.data_bytes : bucket.nbytes].cpu().view(torch.int64).tolist()
    if sent_version != version:
        return f"bucket {index} carries version {sent_version}, expected {version}"
    if verify and crc != bytes_crc32(buffer[: bucket.data_bytes].cpu()):
        return f"bucket {index} fails its CRC32 check" + ("" if crc else " (the sender sent none)")
    return None


def end_of_stream(stream: Iterator[tuple[str, torch.Tensor]]) -> None:
    """`WeightSyncError` if the stream has a tensor the layout does not (the model changed since it was planned)."""
    extra = next(stream, None)
    if extra is not None:
        raise WeightSyncError(f"weight sync: {extra[0]!r} is not in the layout (the model changed?)")
