"""The context-parallel layout (`models/context_parallel.py`), every rank simulated in one process: the ranks hold
every padded position once, chunks r and 2cp-1-r of each block; next-token values come back whole; attention over
the gathered keys equals causal attention over each whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlinf_pipe.models.context_parallel import CpLayout, local_length, padded_block_lengths
from rlinf_pipe.models.megatron_sdpa import cp_attention
from rlinf_pipe.models.packed_rows import PackedRows


def _rows(lengths: list[int]) -> PackedRows:
    width = max(lengths)
    return PackedRows.of(torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])


@pytest.mark.parametrize("cp, multiple, local_total", [(2, 1, None), (3, 1, None), (2, 2, None), (2, 1, 20)])
def test_ranks_hold_balanced_chunks_of_every_block(cp, multiple, local_total):
    lengths = [5, 12, 1]
    rows = _rows(lengths)
    padded = padded_block_lengths(lengths, cp, multiple, local_total)
    assert all(m % (2 * cp) == 0 for m in padded) and all(m >= n for m, n in zip(padded, lengths, strict=True))
    layouts = [CpLayout.of(rows, cp, r, multiple, local_total) for r in range(cp)]
    share = layouts[0].local_length
    assert share == sum(padded) // cp and share % multiple == 0 and share >= (local_total or 0)
    assert local_length(lengths, cp, multiple) <= share
    held = torch.cat([layout.local for layout in layouts])
    assert sorted(held.tolist()) == list(range(sum(padded)))
    assert torch.equal(held, layouts[0].order)
    start = 0
    for b, m in enumerate(padded):  # rank r: chunks r and 2cp-1-r of block b
        chunk = m // (2 * cp)
        for r, layout in enumerate(layouts):
            mine = set(layout.local.tolist()) & set(range(start, start + m))
            expected = set(range(start + r * chunk, start + (r + 1) * chunk)) | set(
                range(start + (2 * cp - 1 - r) * chunk, start + (2 * cp - r) * chunk))
            assert mine == expected, (b, r)
        start += m


def test_next_token_values_come_back_whole():
    """A stand-in for the model's next-token value (a function of the token and its predecessor), computed per rank
    as the policy does (along its tokens, and at its runs' ends) and gathered, equals the whole stream's."""
    cp, lengths = 2, [7, 3, 10]
    rows = _rows(lengths)
    ids = torch.randint(1, 50, (len(lengths), max(lengths)))
    stream = rows.pack(ids)

    def value(prev: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return (prev * 100 + token).float()

    parts = []
    for r in range(cp):
        layout = CpLayout.of(rows, cp, r)
        local = layout.local_ids(stream)
        along = torch.cat([torch.zeros(1), value(local[:-1], local[1:])])
        ends = value(local[layout.run_ends], layout.next_ids(stream))
        parts.append(layout.next_values(along, ends))
    whole = CpLayout.of(rows, cp, 0).stream_values(torch.cat(parts))
    expected = torch.cat([torch.zeros(1), value(stream[:-1], stream[1:])])
    assert torch.equal(rows.unpack_predicted(whole), rows.unpack_predicted(expected))


@pytest.mark.parametrize("groups", [4, 2])
def test_attention_over_gathered_keys_equals_whole_sequences(groups):
    cp, lengths, heads, dim = 2, [9, 4, 14], 4, 8
    rows = _rows(lengths)
    torch.manual_seed(0)
    total_padded = sum(padded_block_lengths(lengths, cp))
    q, k, v = torch.randn(total_padded, heads, dim), torch.randn(total_padded, groups, dim), torch.randn(
        total_padded, groups, dim)
    layouts = [CpLayout.of(rows, cp, r) for r in range(cp)]
    gathered_k, gathered_v = k[layouts[0].order], v[layouts[0].order]
    out = torch.empty(total_padded, heads, dim)
    for layout in layouts:
        out[layout.local] = cp_attention(q[layout.local], gathered_k, gathered_v, layout, layout.attention_mask(),
                                         None, groups != heads)
    start = 0
    for n, m in zip(lengths, layouts[0].padded, strict=True):
        block = slice(start, start + m)
        ref = F.scaled_dot_product_attention(*(t[block].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True,
                                             enable_gqa=groups != heads)[0].transpose(0, 1)
        torch.testing.assert_close(out[start: start + n], ref[:n])
        start += m


def test_shared_prompts_are_refused():
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9]])
    rows = PackedRows.of(torch.ones(2, 4, dtype=torch.bool), shared=[(0, 2), (0, 2)])
    assert rows.total < ids.numel()
    with pytest.raises(ValueError, match="shared prompts"):
        CpLayout.of(rows, 2, 0)
