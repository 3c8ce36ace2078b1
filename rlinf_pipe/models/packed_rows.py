"""Packed sequences: the real tokens of a right-padded batch as one stream, without padding.

A micro-batch of B right-padded rows of up to L tokens costs B x L positions in every projection, norm and MLP of
a forward pass, while its rows hold only T <= B x L real tokens. Packed, the model runs on the stream of those T
tokens (`[1, T]`; Megatron calls this layout `thd`), with the sequences' boundaries (`cu_seqlens`) telling
attention and the rotary embedding where each sequence starts. `PackedRows` holds where every token goes, both
ways; it is pure index arithmetic, with no model in it.

    rows = PackedRows.of(batch.attention_mask)   # [B, L] right-padded
    stream = rows.pack(batch.input_ids)          # [T] real tokens, row after row
    values = rows.unpack(per_token_values)       # [T, ...] -> [B, L, ...], 0 on padding

A stream can be made longer than its tokens (`total`): filler sequences of token 0 follow the rows, so that the
micro-batches of one pipeline-parallel schedule share a shape. They are never unpacked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Each stream token's position in its sequence (`cu_seqlens`: the sequences' boundaries, `total` tokens)."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, lengths, output_size=total)


@dataclass(frozen=True)
class PackedRows:
    """Where the tokens of B right-padded rows go in a packed stream (see the module docstring).

    `valid` is the batch's `[B, L]` mask and `index` the stream position of each of its positions (padding: 0);
    `lengths` the sequences of the stream (the B rows, then any filler); `cu_seqlens` their boundaries (`[S + 1]`
    int32, from 0 to `total`); `positions` each stream token's position in its sequence (`[total]`); `gather` /
    `gather_valid` (`[S, width]`) the stream index of each position of each sequence laid out as a padded row,
    and which of them are real (padding points at the sequence's first token, which a causal mask never lets a
    real token see)."""

    valid: Tensor
    index: Tensor
    lengths: tuple[int, ...]
    cu_seqlens: Tensor
    positions: Tensor
    gather: Tensor
    gather_valid: Tensor

    @classmethod
    def of(cls, attention_mask: Tensor, total: int | None = None) -> PackedRows:
        """The packing of a right-padded batch (`attention_mask` `[B, L]`: each row's real tokens first). With
        `total`, filler sequences of at most L tokens each make the stream `total` tokens long."""
        if attention_mask.dim() != 2 or attention_mask.shape[0] == 0:
            raise ValueError(f"attention_mask must be a non-empty [batch, seq] mask, got {tuple(attention_mask.shape)}")
        valid = attention_mask.bool()
        row_lengths = valid.sum(dim=1)
        width = valid.shape[1]
        columns = torch.arange(width, device=valid.device)
        if not torch.equal(valid, columns[None, :] < row_lengths[:, None]):
            raise ValueError("packing needs right-padded rows (each row's real tokens first, then padding only)")
        if bool((row_lengths == 0).any()):
            raise ValueError("packing needs at least one real token in every row")
        lengths = [int(n) for n in row_lengths.tolist()]
        real = sum(lengths)
        if total is not None:
            if total < real:
                raise ValueError(f"a stream of {total} tokens cannot hold the batch's {real} real tokens")
            left = total - real
            while left:
                lengths.append(min(left, width))
                left -= lengths[-1]
        return cls._build(valid, tuple(lengths))

    @classmethod
    def _build(cls, valid: Tensor, lengths: tuple[int, ...]) -> PackedRows:
        device = valid.device
        sizes = torch.tensor(lengths, dtype=torch.long, device=device)
        starts = torch.cumsum(sizes, 0) - sizes
        cu_seqlens = torch.cat([starts, starts[-1:] + sizes[-1:]]).to(torch.int32)
        total = int(cu_seqlens[-1])
        positions = packed_positions(cu_seqlens, total)
        columns = torch.arange(max(lengths), device=device)
        gather_valid = columns[None, :] < sizes[:, None]
        gather = torch.where(gather_valid, starts[:, None] + columns[None, :], starts[:, None])
        index = (valid.flatten().long().cumsum(0) - 1).clamp_(min=0).view(valid.shape)
        return cls(valid, index, lengths, cu_seqlens, positions, gather, gather_valid)

    @property
    def rows(self) -> int:
        """The batch's rows (the first `rows` sequences of the stream)."""
        return int(self.valid.shape[0])

    @property
    def total(self) -> int:
        """Tokens in the stream, filler included."""
        return int(self.cu_seqlens[-1])

    @property
    def max_length(self) -> int:
        """The longest sequence of the stream."""
        return int(self.gather.shape[1])

    def pack(self, values: Tensor, fill: float | int = 0) -> Tensor:
        """`[B, L, ...]` -> `[total, ...]`: the real positions, row after row, then `fill` for the filler."""
        packed = values[self.valid]
        extra = self.total - packed.shape[0]
        if extra:
            packed = torch.cat([packed, packed.new_full((extra, *packed.shape[1:]), fill)])
        return packed

    def unpack(self, values: Tensor) -> Tensor:
        """`[total, ...]` -> `[B, L, ...]`: each row's values back at their positions, 0 on padding. Differentiable
        (the gradient of a padding position goes nowhere)."""
        out = values[self.index]
        return out.masked_fill(~self.valid.view(*self.valid.shape, *([1] * (out.dim() - 2))), 0)
