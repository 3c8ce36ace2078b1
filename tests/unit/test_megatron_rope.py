"""The rotary embedding of rlinf_pipe/models/megatron_rope.py against megatron-core's own functions: the same values
bit for bit, forward and backward, padded (`bshd`, cos / sin computed once per table) and packed (`thd`, one
gather instead of a loop over the sequences); the cases left to Megatron."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from rlinf_pipe.models import megatron_rope
from rlinf_pipe.models.packed_rows import PackedRows


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


@pytest.fixture(scope="module", autouse=True)
def installed():
    megatron_rope.install()
    megatron_rope.install()  # (idempotent)
    assert rope_utils._apply_rotary_pos_emb_thd is megatron_rope._apply_thd
    assert rope_utils._apply_rotary_pos_emb_bshd is megatron_rope._apply_bshd


def _both(call, t: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`call(fn, x)` with Megatron's function and ours: outputs and input gradients."""
    outs, grads = [], []
    for kind in ("original", "ours"):
        x = t.clone().requires_grad_()
        y = call(kind, x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
    return outs, grads


@pytest.mark.parametrize("interleaved", [False, True])
def test_padded_rope_equals_megatrons_and_computes_cos_sin_once_per_table(interleaved):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(7, 2, 3, 16, generator=g)  # [s, b, heads, dim]
    freqs = torch.rand(7, 1, 1, 12, generator=g) * 6  # rot_dim 12 < dim: the rest passes through
    functions = {"original": megatron_rope._originals["bshd"], "ours": rope_utils._apply_rotary_pos_emb_bshd}
    for _ in range(2):  # the second time from the cache
        outs, grads = _both(lambda kind, x: functions[kind](x, freqs, interleaved, False, 1.5), t)
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert id(freqs) in megatron_rope._cos_sin


def test_packed_rope_equals_megatrons_loop_bit_for_bit():
    functions = {"original": megatron_rope._originals["thd"], "ours": rope_utils._apply_rotary_pos_emb_thd}
    for seed, lengths in enumerate([[5, 1, 7, 3], [9], [2, 2, 2, 2, 2, 2], [4, 8]]):
        g = torch.Generator().manual_seed(seed)
        rows = PackedRows.of(torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None])
        t = torch.randn(rows.total, 3, 16, generator=g)
        freqs = torch.rand(max(lengths) + 3, 1, 1, 16, generator=g) * 6  # a table longer than any sequence
        outs, grads = _both(lambda kind, x: functions[kind](x, rows.cu_seqlens, freqs, cp_group=_Group(1),
                                                            mscale=1.5), t)
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1]), lengths


def test_cases_it_does_not_cover_go_to_megatron(monkeypatch):
    calls = []
    monkeypatch.setitem(megatron_rope._originals, "thd", lambda *args: calls.append("thd") or args[0])
    monkeypatch.setitem(megatron_rope._originals, "bshd", lambda *args: calls.append("bshd") or args[0])
    rows = PackedRows.of(torch.ones(2, 4, dtype=torch.bool))
    t, freqs = torch.randn(8, 2, 4), torch.rand(6, 1, 1, 4)
    rope_utils._apply_rotary_pos_emb_thd(t, rows.cu_seqlens, freqs, cp_group=_Group(2))  # context parallel
    rope_utils._apply_rotary_pos_emb_thd(t, rows.cu_seqlens, torch.rand(8, 1, 1, 4), cp_group=_Group(1))  # offsets
    rope_utils._apply_rotary_pos_emb_bshd(t, freqs[:4], multi_latent_attention=True)
    assert calls == ["thd", "thd", "bshd"]


def test_a_context_parallel_share_takes_its_own_positions():
    """Under CP a rank's share of a stream (`CpLayout`) carries its tokens' positions in their sequences: each gets
    the table's row of its position, as Megatron's `bshd` function would."""
    from rlinf_pipe.models.context_parallel import CpLayout

    rows = PackedRows.of(torch.arange(7)[None, :] < torch.tensor([7, 3])[:, None])
    layout = CpLayout.of(rows, cp=2, rank=1)
    t, freqs = torch.randn(layout.local_length, 2, 8), torch.rand(layout.max_length, 1, 1, 8) * 6
    out = rope_utils._apply_rotary_pos_emb_thd(t, layout.cu_seqlens, freqs, cp_group=_Group(2))
    expected = megatron_rope._originals["bshd"](t[:, None], freqs[layout.positions])[:, 0]
    torch.testing.assert_close(out, expected)
