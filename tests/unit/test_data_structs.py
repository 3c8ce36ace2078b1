"""Batch structs: channel round trips (arrays and tensors out of band), ScoredGroup -> TrainBatch packing."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlinf_pipe.data import (
    PromptItem,
    RolloutGroup,
    RolloutSample,
    ScoredGroup,
    TrainBatch,
    pack_train_batch,
    row_chunks,
    split_train_batch,
)
from rlinf_pipe.channels.codec import Codec

PAD = 0


def sample(ids: list[int], version: int = 3, reason: str = "stop") -> RolloutSample:
    return RolloutSample(
        response_ids=ids, logprobs=[-0.5 * (k + 1) for k in range(len(ids))], finish_reason=reason,
        version=version, text="".join(map(str, ids)),
    )


def prompt(ids: list[int], name: str = "p") -> PromptItem:
    return PromptItem(id=name, prompt="q", answer="1", index=4, epoch=2, prompt_ids=ids, version=3)


def roundtrip(item, item_type):
    codec = Codec(item_type)
    frames = codec.encode(item)
    return codec.decode([bytes(memoryview(f)) for f in frames]), frames


def test_prompt_item_roundtrips():
    item = prompt([5, 6, 7])
    out, frames = roundtrip(item, PromptItem)
    assert out == item and len(frames) == 1


def test_scored_group_roundtrips_with_arrays_out_of_band():
    group = RolloutGroup.of(prompt([9, 8]), [sample([1, 2, 3], 3, "stop"), sample([4], 2, "length")])
    scored = ScoredGroup(group=group, rewards=[1.0, 0.0], advantages=[0.7, -0.7], version=group.version)
    out, frames = roundtrip(scored, ScoredGroup)
    assert len(frames) == 1 + 2 * 2 + 2  # header, ids + logprobs per sample, rewards, advantages
    assert out.version == 2 == out.group.version and out.group.prompt == group.prompt
    for got, want in zip(out.group.samples, group.samples, strict=True):
        assert np.array_equal(got.response_ids, want.response_ids) and got.response_ids.dtype == np.int32
        assert np.array_equal(got.logprobs, want.logprobs) and got.logprobs.dtype == np.float32
        assert (got.finish_reason, got.version, got.text) == (want.finish_reason, want.version, want.text)
    assert np.array_equal(out.rewards, [1, 0]) and np.array_equal(out.advantages, np.float32([0.7, -0.7]))


def test_train_batch_roundtrips_with_tensors():
    batch = make_batch()
    out, frames = roundtrip(batch, TrainBatch)
    assert len(frames) == 1 + 6 and out.ref_logprobs is None
    batch.ref_logprobs = torch.randn(batch.input_ids.shape)
    out, frames = roundtrip(batch, TrainBatch)
    assert len(frames) == 1 + 7
    for field in TrainBatch.__struct_fields__:
        got, want = getattr(out, field), getattr(batch, field)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want), field
        else:
            assert got == want, field


def test_invalid_finish_reason_is_rejected_on_decode():
    bad = sample([1])
    bad.finish_reason = "timeout"  # type: ignore[assignment]
    codec = Codec(RolloutSample)
    with pytest.raises(msgspec.ValidationError, match="finish_reason"):
        codec.decode(codec.encode(bad))


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="equal length"):
        RolloutSample(response_ids=[1, 2], logprobs=[-1.0], finish_reason="stop", version=0)
    group = RolloutGroup.of(prompt([1]), [sample([1])])
    with pytest.raises(ValueError, match=r"must both have shape \(1,\)"):
        ScoredGroup(group=group, rewards=[1.0, 0.0], advantages=[0.0], version=0)
    with pytest.raises(ValueError, match="no samples"):
        RolloutGroup.of(prompt([1]), [])


def make_groups() -> list[ScoredGroup]:
    g1 = RolloutGroup.of(prompt([11, 12], "a"), [sample([21, 22, 23], 5), sample([24], 4, "length")])
    g2 = RolloutGroup.of(prompt([13, 14, 15], "b"), [sample([25, 26], 5), sample([], 5, "abort")])
    return [
        ScoredGroup(group=g1, rewards=[1, 0], advantages=[0.5, -0.5], version=g1.version),
        ScoredGroup(group=g2, rewards=[0, 0], advantages=[0.25, 0.0], version=g2.version),
    ]


def make_batch() -> TrainBatch:
    return pack_train_batch(make_groups(), PAD)


def test_packing_by_hand():
    batch = make_batch()
    T, F = True, False
    assert batch.input_ids.tolist() == [
        [11, 12, 21, 22, 23],
        [11, 12, 24, PAD, PAD],
        [13, 14, 15, 25, 26],
        [13, 14, 15, PAD, PAD],
    ]
    assert batch.attention_mask.tolist() == [[T, T, T, T, T], [T, T, T, F, F], [T, T, T, T, T], [T, T, T, F, F]]
    assert batch.response_mask.tolist() == [[F, F, T, T, T], [F, F, T, F, F], [F, F, F, T, T], [F, F, F, F, F]]
    assert batch.old_logprobs.tolist() == [
        [0, 0, -0.5, -1.0, -1.5],
        [0, 0, -0.5, 0, 0],
        [0, 0, 0, -0.5, -1.0],
        [0, 0, 0, 0, 0],
    ]
    assert batch.advantages.tolist() == [
        [0, 0, 0.5, 0.5, 0.5],
        [0, 0, -0.5, 0, 0],
        [0, 0, 0, 0.25, 0.25],
        [0, 0, 0, 0, 0],
    ]
    assert batch.rewards.tolist() == [1, 0, 0, 0]
    assert (batch.num_sequences, batch.num_tokens, batch.version) == (4, 6, 4)
    assert batch.ref_logprobs is None
    assert batch.input_ids.dtype == torch.int64 and batch.attention_mask.dtype == torch.bool
    assert batch.old_logprobs.dtype == batch.advantages.dtype == torch.float32


def test_split_trims_each_micro_batch_to_its_longest_row():
    micro = split_train_batch(make_batch(), 1)
    # the last row has no response tokens: it joins the micro-batch before it rather than train on nothing
    assert [m.input_ids.shape[1] for m in micro] == [5, 3, 5]
    assert [m.num_tokens for m in micro] == [3, 1, 2] and [m.num_sequences for m in micro] == [1, 1, 2]
    assert micro[1].input_ids.tolist() == [[11, 12, 24]] and micro[1].response_mask.tolist() == [[False, False, True]]
    halves = split_train_batch(make_batch(), 2)
    assert [m.num_sequences for m in halves] == [2, 2] and halves[1].input_ids.tolist()[1] == [13, 14, 15, PAD, PAD]
    assert all(m.version == 4 for m in micro + halves)
    # a token budget of 10: rows of length 5, 3, 5, 3 -> [5, 3] (2 x 5), [5, 3] (2 x 5)
    assert [m.num_sequences for m in split_train_batch(make_batch(), 4, max_tokens=10)] == [2, 2]
    assert [m.num_sequences for m in split_train_batch(make_batch(), 4, max_tokens=4)] == [1, 1, 2]
    with pytest.raises(ValueError):
        split_train_batch(make_batch(), 0)


def test_row_chunks_respect_both_limits():
    assert row_chunks([5, 3, 5, 3], 4) == [range(0, 4)]
    assert row_chunks([5, 3, 5, 3], 4, max_tokens=9) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert row_chunks([2, 2, 9, 2], 3, max_tokens=6) == [range(0, 2), range(2, 3), range(3, 4)]
    assert row_chunks([1] * 7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert row_chunks([], 3) == []


def test_packing_nothing_is_an_error():
    with pytest.raises(ValueError, match="no samples"):
        pack_train_batch([], PAD)


token_lists = st.lists(st.integers(1, 99), max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(token_lists.filter(bool), st.lists(token_lists, min_size=1, max_size=4)), min_size=1,
                max_size=4))
def test_packing_recovers_every_sequence(spec):
    groups = []
    for n, (prompt_ids, responses) in enumerate(spec):
        group = RolloutGroup.of(prompt(prompt_ids, str(n)), [sample(r) for r in responses])
        size = len(responses)
        groups.append(ScoredGroup(group=group, rewards=np.arange(size), advantages=np.arange(size) + 1, version=3))
    batch = pack_train_batch(groups, PAD)
    rows = [(p, r, adv) for p, rs in spec for adv, r in enumerate(rs, start=1)]
    assert batch.num_sequences == len(rows) and batch.num_tokens == sum(len(r) for _, r, _ in rows)
    assert batch.input_ids.shape[1] == max(len(p) + len(r) for p, r, _ in rows)
    for row, (p, r, adv) in enumerate(rows):
        assert batch.input_ids[row][batch.attention_mask[row]].tolist() == p + r
        assert batch.input_ids[row][batch.response_mask[row]].tolist() == r
        assert (batch.response_mask[row] <= batch.attention_mask[row]).all()  # response tokens are real tokens
        assert batch.advantages[row][batch.response_mask[row]].tolist() == [adv] * len(r)
        assert (batch.advantages[row][~batch.response_mask[row]] == 0).all()
