"""Item types for channel tests. msgspec Structs must be importable where they are decoded (Ray workers too)."""

from __future__ import annotations

import msgspec
import numpy as np
import torch
from support.light_items import Tagged

__all__ = ["BIG", "Big", "Inner", "Rich", "Tagged", "assert_exact", "assert_same", "big", "rich"]


class Inner(msgspec.Struct):
    name: str
    values: torch.Tensor
    mask: np.ndarray


class Rich(msgspec.Struct):
    """Nested structs, tensors of several dtypes (bf16 included), arrays, optionals, containers."""

    step: int
    inner: Inner
    tensors: list[torch.Tensor]
    by_name: dict[str, torch.Tensor]
    optional: torch.Tensor | None = None
    version: int = 0


BIG = 200_000  # bytes of a Big item's large tensor (over the arena's `SHARED_MIN_BYTES`)


class Big(msgspec.Struct):
    seq: int
    large: torch.Tensor  # BIG bytes: through the arena on one node
    array: np.ndarray  # 100 KB: through the arena too
    small: torch.Tensor  # 40 bytes: always a frame


def big(seq: int) -> Big:
    generator = torch.Generator().manual_seed(seq)
    return Big(
        seq,
        torch.randint(0, 255, (BIG,), dtype=torch.uint8, generator=generator),
        np.random.default_rng(seq).standard_normal(12_500),
        torch.arange(10, dtype=torch.float32) + seq,
    )


def assert_exact(item: Big) -> None:
    want = big(item.seq)
    assert torch.equal(item.large, want.large) and np.array_equal(item.array, want.array)
    assert torch.equal(item.small, want.small)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


def rich(step: int = 3) -> Rich:
    """A deterministic Rich item (the same in every process for the same step)."""
    generator = torch.Generator().manual_seed(step)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + step
    return Rich(
        step=step,
        inner=Inner("x", torch.randn(3, 5, generator=generator).to(torch.bfloat16), np.array([True, False, True])),
        tensors=[(torch.rand(7, generator=generator) * 100).to(dtype) for dtype in DTYPES],
        by_name={"noncontig": base.t(), "sliced": base[:, ::2], "empty": torch.empty(0, 3), "scalar": torch.tensor(5)},
        optional=None,
        version=9,
    )


def assert_same(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
