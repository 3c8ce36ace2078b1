"""Weight sync: the actor publishes its weights as HF-named buckets; engines and log-prob workers fetch them.

The actor's gathering rank (data-parallel replica 0, tensor and pipeline rank 0) turns each bucket from
`iter_hf_weight_buckets` into one Ray object (`publish_buckets`) and returns a `WeightManifest`: the object
references, the version, the bytes and (optionally) a CRC32 per bucket. Receivers iterate
`fetch_buckets(manifest, verify=...)`; objects move once per node through Ray's object store (shared memory
within a node). Versions are checked by the receivers: an engine never holds a half-loaded version.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rlinf_pipe.errors import RlinfPipeError

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightSyncError(RlinfPipeError):
    """A weight transfer failed its checks (version order, checksum)."""


def tensor_crc32(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """CRC32 over names and raw bytes of the tensors, in order."""
    crc = 0
    for name, t in tensors:
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes(), crc)
    return crc


@dataclass
class WeightManifest:
    """What a receiver needs to load one version: bucket object refs, sizes and optional checksums."""

    version: int
    refs: list[Any] = field(default_factory=list)
    num_bytes: int = 0
    num_tensors: int = 0
    checksums: list[int] | None = None


def publish_buckets(buckets: Iterable[NamedTensors], version: int, checksum: bool = False) -> WeightManifest:
    """Put each bucket into Ray's object store; returns the manifest (call on the gathering rank)."""
    import ray

    manifest = WeightManifest(version=version, checksums=[] if checksum else None)
    for bucket in buckets:
        bucket = [(n, t.detach().contiguous().cpu()) for n, t in bucket]
        manifest.refs.append(ray.put(bucket))
        manifest.num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        manifest.num_tensors += len(bucket)
        if manifest.checksums is not None:
            manifest.checksums.append(tensor_crc32(bucket))
    return manifest


async def fetch_buckets(manifest: WeightManifest, verify: bool = False) -> list[NamedTensors]:
    """The manifest's buckets (awaited from the object store), checksum-verified when `verify` and available."""
    buckets = []
    for i, ref in enumerate(manifest.refs):
        bucket = await ref
        if verify and manifest.checksums is not None:
            got = tensor_crc32(bucket)
            if got != manifest.checksums[i]:
                raise WeightSyncError(
                    f"weight bucket {i} of version {manifest.version} is corrupted: crc32 {got:#x}, "
                    f"sender had {manifest.checksums[i]:#x}"
                )
        buckets.append(bucket)
    return buckets


def check_version(current: int, incoming: int, who: str) -> None:
    """Versions only move forward (a repeated version is a no-op reload, allowed)."""
    if incoming < current:
        raise WeightSyncError(f"{who}: got weights of version {incoming} after version {current}")


def flatten(buckets: Iterable[NamedTensors]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        yield from bucket
