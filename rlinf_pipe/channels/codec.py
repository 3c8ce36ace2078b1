"""Wire encoding of channel items: msgspec msgpack for structure, tensors and arrays as out-of-band frames.

`encode(item)` returns `[header, buffer0, buffer1, ...]`: the header is msgpack in which every torch CPU tensor
and numpy array is an Ext pointing at a buffer index; the buffers are views of the tensors' memory (a copy is
made only for non-contiguous inputs). `decode(frames)` rebuilds the item against the channel's item type, with
tensors and arrays that view the received frames (no copy).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Sequence

import msgspec
import numpy as np

from rlinf_pipe.channels import traffic

EXT_TENSOR = 1
EXT_NDARRAY = 2


def _buffer_of(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame  # zmq.Frame or bytes-like


class Codec:
    """Encoder/decoder of one item type. Thread-safe (per-thread scratch state)."""

    def __init__(self, item_type: Any = Any):
        self.item_type = item_type
        self._local = threading.local()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(type=item_type, ext_hook=self._ext_hook, dec_hook=self._dec_hook)

    def encode(self, item: Any) -> list[Any]:
        buffers: list[Any] = []
        self._local.buffers = buffers
        try:
            header = self._encoder.encode(item)
        finally:
            self._local.buffers = None
        traffic.record(sum(map(len, buffers)))  # (flat uint8 arrays and b"": their length is their size)
        return [header, *buffers]

    def decode(self, frames: Sequence[Any]) -> Any:
        self._local.frames = frames
        try:
            return self._decoder.decode(_buffer_of(frames[0]))
        finally:
            self._local.frames = None

    # --- hooks ----------------------------------------------------------------------------------------------
    def _enc_hook(self, obj: Any) -> Any:
        buffers = self._local.buffers
        if traffic.is_tensor(obj):
            import torch  # (already loaded: obj is one of its tensors)

            if obj.device.type != "cpu":
                raise TypeError(f"channel items carry CPU tensors; got a tensor on {obj.device} (call .cpu() first)")
            tensor = obj.detach().contiguous()
            buffers.append(tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b"")
            meta = (str(tensor.dtype).removeprefix("torch."), list(tensor.shape), len(buffers) - 1)
            return msgspec.msgpack.Ext(EXT_TENSOR, msgspec.msgpack.encode(meta))
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError("channel items cannot carry numpy arrays of Python objects")
            array = np.ascontiguousarray(obj)
            buffers.append(array.reshape(-1).view(np.uint8) if array.size else b"")
            meta = (array.dtype.str, list(array.shape), len(buffers) - 1)
            return msgspec.msgpack.Ext(EXT_NDARRAY, msgspec.msgpack.encode(meta))
        raise TypeError(f"channel items cannot carry {type(obj).__name__} (use msgspec-encodable values, tensors, arrays)")

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        dtype, shape, index = msgspec.msgpack.decode(data)
        buffer = _buffer_of(self._local.frames[index + 1])  # frame 0 is the header
        traffic.record(memoryview(buffer).nbytes)
        if code == EXT_TENSOR:
            import torch

            torch_dtype = getattr(torch, dtype)
            if not len(buffer):
                return torch.empty(shape, dtype=torch_dtype)
            with warnings.catch_warnings():
                # The frame's memory is private to this process once received, so writing to it is safe;
                # torch only warns because zmq exposes it through a read-only buffer.
                warnings.simplefilter("ignore")
                return torch.frombuffer(buffer, dtype=torch.uint8).view(torch_dtype).reshape(shape)
        if code == EXT_NDARRAY:
            return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
        raise ValueError(f"unknown channel ext code {code}")

    @staticmethod
    def _dec_hook(tp: type, obj: Any) -> Any:
        if isinstance(obj, tp):
            return obj
        raise NotImplementedError(f"cannot decode {type(obj).__name__} as {tp}")
