"""The item types of the channel examples (a module of its own: msgspec Structs must be importable by workers)."""

import msgspec
import torch


class Sample(msgspec.Struct):
    producer: int
    index: int
    tokens: torch.Tensor  # travels as an out-of-band frame


class Block(msgspec.Struct):
    """An item with one large tensor (of the example `large_tensors.py`)."""

    index: int
    data: torch.Tensor
