"""`PackedRows` (rlinf_pipe/models/packed_rows.py): where each real token of a right-padded batch goes in the packed
stream and back, with filler, and the errors for batches it cannot pack."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlinf_pipe.models.packed_rows import PackedRows


def _mask(lengths: list[int], width: int | None = None) -> torch.Tensor:
    width = width or max(lengths)
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def test_stream_layout_of_three_rows():
    rows = PackedRows.of(_mask([3, 1, 2], width=4))
    assert rows.lengths == (3, 1, 2) and rows.total == 6 and rows.rows == 3 and rows.max_length == 3
    assert rows.cu_seqlens.tolist() == [0, 3, 4, 6] and rows.cu_seqlens.dtype == torch.int32
    assert rows.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert rows.gather.tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 4]]
    assert rows.gather_valid.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 0, 0]])
    assert rows.pack(ids).tolist() == [5, 6, 7, 8, 9, 10]
    assert torch.equal(rows.unpack(rows.pack(ids)), ids)


def test_filler_makes_the_stream_longer_and_is_never_unpacked():
    rows = PackedRows.of(_mask([3, 1]), total=11)
    assert rows.lengths == (3, 1, 3, 3, 1)  # filler sequences of at most the batch's width
    assert rows.total == 11 and rows.cu_seqlens.tolist() == [0, 3, 4, 7, 10, 11]
    ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    stream = rows.pack(ids, fill=-1)
    assert stream.tolist() == [1, 2, 3, 4] + [-1] * 7
    assert torch.equal(rows.unpack(stream), ids)


def test_unpack_carries_trailing_dimensions_and_gradients():
    rows = PackedRows.of(_mask([2, 3]))
    values = torch.arange(10.0).view(5, 2).requires_grad_()
    out = rows.unpack(values)
    assert out.shape == (2, 3, 2) and out[0, 2].tolist() == [0.0, 0.0] and out[1, 2].tolist() == [8.0, 9.0]
    out.sum().backward()
    assert values.grad.tolist() == [[1.0, 1.0]] * 5  # every real token once; padding sends nothing back


def test_rows_it_cannot_pack_are_named():
    with pytest.raises(ValueError, match="right-padded"):
        PackedRows.of(torch.tensor([[False, True], [True, True]]))
    with pytest.raises(ValueError, match="at least one real token"):
        PackedRows.of(_mask([2, 0], width=2))
    with pytest.raises(ValueError, match="cannot hold"):
        PackedRows.of(_mask([2, 2]), total=3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.integers(0, 12))
def test_pack_then_unpack_is_the_identity_on_real_tokens(lengths, extra):
    mask = _mask(lengths)
    rows = PackedRows.of(mask, total=sum(lengths) + extra)
    values = torch.randint(1, 100, mask.shape).masked_fill(~mask, 0)
    assert rows.total == sum(lengths) + extra and len(rows.lengths) >= len(lengths)
    assert torch.equal(rows.unpack(rows.pack(values)), values)
    # every stream position is some sequence's position, once
    stream = torch.arange(rows.total)
    assert torch.equal(rows.gather[rows.gather_valid], stream)
    starts = rows.cu_seqlens[:-1].long().repeat_interleave(torch.tensor(rows.lengths))
    assert torch.equal(rows.positions, stream - starts)
