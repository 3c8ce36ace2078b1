"""Channel wire encoding: every item type round-trips with identical contents; tensors travel out of band."""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import pytest
import torch
from support.channel_items import Inner, Rich, assert_same, rich

from rlinf_pipe.channels.codec import Codec


def roundtrip(item, item_type):
    codec = Codec(item_type)
    frames = codec.encode(item)
    # what a socket delivers: independent copies of every frame
    return codec.decode([bytes(memoryview(f)) for f in frames]), frames


def test_nested_struct_with_every_dtype_roundtrips():
    item = rich()
    out, _ = roundtrip(item, Rich)
    assert out.step == 3 and out.version == 9 and out.optional is None and out.inner.name == "x"
    assert_same(out.inner.values, item.inner.values)
    assert np.array_equal(out.inner.mask, item.inner.mask) and out.inner.mask.dtype == np.bool_
    for got, want in zip(out.tensors, item.tensors, strict=True):
        assert_same(got, want)
    for key in item.by_name:
        assert_same(out.by_name[key], item.by_name[key])


def test_tensors_travel_as_out_of_band_frames():
    item = Inner("big", torch.ones(1024, 1024), np.zeros((2, 3), dtype=np.int16))
    frames = Codec(Inner).encode(item)
    assert len(frames) == 3
    assert len(frames[0]) < 200  # the header holds no tensor bytes
    assert memoryview(frames[1]).nbytes == 4 * 1024 * 1024 and memoryview(frames[2]).nbytes == 12


def test_contiguous_tensor_is_not_copied_on_encode():
    tensor = torch.arange(1000, dtype=torch.float32)
    frames = Codec(Inner).encode(Inner("v", tensor, np.zeros(1)))
    assert np.asarray(frames[1]).ctypes.data == tensor.data_ptr()


def test_decoded_tensor_views_the_received_frame():
    codec = Codec(Inner)
    frames = [bytearray(memoryview(f)) for f in codec.encode(Inner("v", torch.arange(4.0), np.zeros(1)))]
    out = codec.decode(frames)
    out.values += 1  # writable, and backed by the frame's memory
    assert torch.equal(torch.frombuffer(frames[1], dtype=torch.float32), torch.arange(1.0, 5.0))


def test_large_tensor_roundtrips():
    item = Inner("large", torch.randn(2048, 2048), np.arange(1_000_000, dtype=np.float64))
    out, _ = roundtrip(item, Inner)
    assert_same(out.values, item.values) and np.array_equal(out.mask, item.mask)


def test_non_contiguous_and_empty_numpy_arrays():
    array = np.arange(20, dtype=np.int32).reshape(4, 5)[:, 1::2]
    out, _ = roundtrip(Inner("a", torch.zeros(1), array), Inner)
    assert np.array_equal(out.mask, array) and out.mask.dtype == np.int32
    out, _ = roundtrip(Inner("e", torch.zeros(0), np.zeros((0, 4), dtype=np.float32)), Inner)
    assert out.mask.shape == (0, 4) and out.values.shape == (0,)


def test_untyped_codec_roundtrips_plain_containers():
    out, _ = roundtrip({"a": [1, 2, {"t": torch.tensor([1.5])}], "b": "s"}, object)
    assert out["b"] == "s" and torch.equal(out["a"][2]["t"], torch.tensor([1.5]))


def test_requires_grad_tensor_is_detached():
    out, _ = roundtrip(Inner("g", torch.ones(2, requires_grad=True), np.zeros(1)), Inner)
    assert not out.values.requires_grad and torch.equal(out.values, torch.ones(2))


def test_unsupported_values_are_clear_errors():
    with pytest.raises(TypeError, match="numpy arrays of Python objects"):
        Codec(Inner).encode(Inner("o", torch.zeros(1), np.array([object()])))
    with pytest.raises(TypeError, match="cannot carry lock"):
        Codec(object).encode({"s": threading.Lock()})


def test_decode_validates_against_the_channel_type():
    codec = Codec(object)
    frames = codec.encode({"name": 1, "values": torch.zeros(1), "mask": np.zeros(1)})
    with pytest.raises(msgspec.ValidationError, match="Expected `str`, got `int`"):
        Codec(Inner).decode([bytes(memoryview(f)) for f in frames])
