"""What every weight transport checks: versions only move forward, and bucket bytes are what the sender sent."""

from __future__ import annotations

import zlib

import torch

from rlinf_pipe.errors import RlinfPipeError


class WeightSyncError(RlinfPipeError):
    """A weight transfer failed its checks (layout, version order, checksum)."""


def bytes_crc32(data: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU uint8 tensor."""
    return zlib.crc32(memoryview(data.numpy()))


def check_version(current: int, incoming: int, who: str) -> None:
    """Versions only move forward (a repeated version is a no-op reload, allowed)."""
    if incoming < current:
        raise WeightSyncError(f"{who}: got weights of version {incoming} after version {current}")
