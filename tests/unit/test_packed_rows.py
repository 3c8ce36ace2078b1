"""`PackedRows` (rlinf_pipe/models/packed_rows.py): where each real token of a right-padded batch goes in the packed
stream and back, with filler, and the errors for batches it cannot pack."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlinf_pipe.models.packed_rows import PackedRows, positions_of, shared_prompts, shared_within, stream_length


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


def _grouped(prompts: list[list[int]], responses: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and response mask of rows `prompts[g] + response` for each `(g, response)`."""
    rows = [prompts[g] + r for g, r in responses]
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    response = torch.zeros(ids.shape, dtype=torch.bool)
    for i, (g, r) in enumerate(responses):
        response[i, len(prompts[g]) : len(prompts[g]) + len(r)] = True
    return ids, response


def test_prompts_that_differ_only_in_their_last_token_share_nothing():
    """Their first tokens are equal, but the stream predicts the token after a shared prefix once (found by the
    property test below: the second row's prompt token after the prefix got the first row's value)."""
    ids, response = _grouped([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 2]], [(0, [1]), (1, [1]), (1, [3])])
    assert shared_prompts(ids, response) == [(0, 0), (1, 5), (1, 5)]


def test_rows_of_one_prompt_share_it_but_its_last_token():
    ids, response = _grouped([[5, 6, 7], [8, 9]], [(0, [1, 2]), (1, [3]), (0, [4]), (1, [5, 6])])
    shared = shared_prompts(ids, response)
    assert shared == [(0, 2), (1, 1), (0, 2), (1, 1)]
    rows = PackedRows.of(ids != 0, shared=shared)
    # [5 6 | 7 1 2 | 7 4] [8 | 9 3 | 9 5 6]: each prompt once, its last token in every row's own part
    assert rows.pack(ids).tolist() == [5, 6, 7, 1, 2, 7, 4, 8, 9, 3, 9, 5, 6]
    assert rows.total == stream_length([5, 3, 4, 4], shared) == 13
    assert rows.positions.tolist() == [0, 1, 2, 3, 4, 2, 3, 0, 1, 2, 1, 2, 3]
    assert rows.cu_seqlens.tolist() == [0, 7, 13] and positions_of(rows.cu_seqlens, 13) is rows.positions
    assert rows.lengths == (5, 4, 3, 4)  # attention's rows, in stream order: 0, 2, 1, 3
    assert torch.equal(rows.gather[rows.gather_out], torch.arange(13))  # every stream token written back once
    assert torch.equal(rows.unpack(rows.pack(ids)), ids)
    # each token's value predicted at its predecessor: 7's at 6 (shared), 1's and 4's at each row's own 7
    assert rows.unpack_predicted(torch.arange(13.0)).tolist() == [
        [0, 1, 2, 3, 4], [0, 8, 9, 0, 0], [0, 1, 2, 6, 0], [0, 8, 11, 12, 0]]


def test_a_prompt_of_one_row_or_without_response_is_not_shared():
    ids, response = _grouped([[5, 6, 7], [8, 9]], [(0, [1]), (1, [3]), (1, [4])])
    assert shared_prompts(ids, response) == [(0, 0), (1, 1), (1, 1)]
    response[1:] = False  # no response: nothing to tell a prompt by
    assert shared_prompts(ids, response) == [(0, 0), (1, 0), (2, 0)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, 9), min_size=1, max_size=3)), min_size=1,
                max_size=9), st.data())
def test_a_batchs_sharing_restricted_to_a_run_of_rows_is_that_runs_own(prompts, picks, data):
    """The log-prob pass works out the batch's sharing once and restricts it to each micro-batch's rows."""
    ids, response = _grouped(prompts, [(g % len(prompts), r) for g, r in picks])
    start = data.draw(st.integers(0, len(picks) - 1))
    rows = range(start, data.draw(st.integers(start + 1, len(picks))))
    assert shared_within(shared_prompts(ids, response), rows) == shared_prompts(ids[rows.start:rows.stop],
                                                                              response[rows.start:rows.stop])


def test_sharing_it_cannot_honour_is_named():
    with pytest.raises(ValueError, match="fewer shared tokens"):
        PackedRows.of(_mask([2, 2]), shared=[(0, 2), (0, 2)])
    with pytest.raises(ValueError, match="a block"):
        PackedRows.of(_mask([3, 3]), shared=[(1, 1), (1, 1)])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=6), min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, 50), min_size=1, max_size=5)), min_size=1,
                max_size=8), st.integers(0, 9))
def test_shared_streams_give_every_row_its_own_values(prompts, picks, extra):
    responses = [(g % len(prompts), r) for g, r in picks]
    ids, response = _grouped(prompts, responses)
    mask = ids != 0
    shared = shared_prompts(ids, response)
    rows = PackedRows.of(mask, total=stream_length(mask.sum(1).tolist(), shared) + extra, shared=shared)
    stream = rows.pack(ids)
    assert torch.equal(rows.unpack(stream), ids)
    assert torch.equal(rows.gather[rows.gather_out], torch.arange(rows.total))
    for seq, n in enumerate(rows.lengths):  # each laid-out row is some batch row (or filler) with positions 0..n-1
        assert rows.positions[rows.gather[seq, :n]].tolist() == list(range(n))
    # the next stream token is the next token of the row (so next-token values along the stream are each row's)
    follows = mask[:, 1:]
    assert torch.equal(stream[(rows.index[:, :-1] + 1)[follows]], ids[:, 1:][follows])
    # a value predicted at each stream position comes back at the token it predicts
    expected = torch.cat([torch.zeros(ids.shape[0], 1, dtype=ids.dtype), ids[:, 1:]], dim=1).masked_fill(~mask, 0)
    assert torch.equal(rows.unpack_predicted(stream), expected)
