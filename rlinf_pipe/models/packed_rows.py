"""Packed sequences: the real tokens of a right-padded batch as one stream, without padding, prompts shared.

A micro-batch of B right-padded rows of up to L tokens costs B x L positions in every projection, norm and MLP of
a forward pass, while its rows hold only T <= B x L real tokens. Packed, the model runs on the stream of those T
tokens (`[1, T]`; Megatron calls this layout `thd`). `PackedRows` holds where every token goes, both ways; it is
pure index arithmetic, with no model in it.

    rows = PackedRows.of(batch.attention_mask)   # [B, L] right-padded
    stream = rows.pack(batch.input_ids)          # [T] real tokens
    values = rows.unpack(per_token_values)       # [T, ...] -> [B, L, ...], 0 on padding

Rows that begin with the same tokens (the samples of one GRPO group share their prompt) can share them
(`shared`, from `shared_prompts`): the stream holds that prefix once, then each row's own tokens. A token's hidden
states depend only on the tokens before it, so the prefix computed once is what each row would compute on its own;
each row still attends to the whole prefix and its own tokens (`gather`: each row laid out as a padded row of
stream indices). The last prompt token stays in every row's own part, so that the token after each stream token
in its row is the next one in the stream (the prefix is followed by its first row, which goes on with that token):
next-token log-probs computed along the stream are every row's own (`unpack_predicted` takes each token's value
from its predecessor's position). A group of 8 samples of a 40-token prompt with 13-token answers runs 144 tokens
instead of 424.

Positions in their row (`positions`, for the rotary embedding) travel with the stream's boundaries
(`positions_of(cu_seqlens)`): with shared prefixes they are not the offsets from a sequence's start.

A stream can be made longer than its tokens (`total`): filler sequences of token 0 follow the rows, so that the
micro-batches of one pipeline-parallel schedule share a shape. They are never unpacked.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

POSITIONS_ATTR = "_rlinf_positions"  # the attribute of a stream's `cu_seqlens` holding its tokens' positions


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Each stream token's offset in its sequence (`cu_seqlens`: the sequences' boundaries, `total` tokens)."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, lengths, output_size=total)


def positions_of(cu_seqlens: Tensor, total: int) -> Tensor:
    """The positions of a stream's tokens in their rows: those a `PackedRows` attached to its `cu_seqlens`, else
    (a stream of whole sequences) the offsets from each sequence's start."""
    attached = getattr(cu_seqlens, POSITIONS_ATTR, None)
    return attached if attached is not None else packed_positions(cu_seqlens, total)


Sharing = list[tuple[int, int]]  # per row: (the first row of its block, the leading tokens its block shares)


def _blocks(keys: list[Any], counts: list[int], min_rows: int) -> Sharing:
    """Rows with equal keys form a block sharing `counts` leading tokens (the same for equal keys) once at least
    `min_rows` rows have the key and it shares any; per row, the block's first row and the count (else itself, 0)."""
    rows_of: dict[Any, int] = {}
    for key in keys:
        rows_of[key] = rows_of.get(key, 0) + 1
    first: dict[Any, int] = {}
    return [(first.setdefault(key, row), count) if count and rows_of[key] >= min_rows else (row, 0)
            for row, (key, count) in enumerate(zip(keys, counts, strict=True))]


def shared_prompts(input_ids: Tensor, response_mask: Tensor, min_rows: int = 2) -> Sharing:
    """Which rows of a micro-batch share their first tokens: a row's prompt (the tokens before its first response
    token) but its last token, with every row of the same whole prompt once at least `min_rows` rows have it. Per
    row, the first row of its prompt and the count of shared tokens (an unshared row: itself and 0). Rows whose
    prompts differ only in their last token share nothing: the token after a shared prefix is predicted once, for
    the block's first row (`unpack_predicted`)."""
    starts = torch.where(response_mask.any(dim=1), response_mask.int().argmax(dim=1), 0).tolist()
    keys = [tuple(row[:start]) for row, start in zip(input_ids.tolist(), starts, strict=True)]
    return _blocks(keys, [max(len(key) - 1, 0) for key in keys], min_rows)


def shared_within(shared: Sharing, rows: range, min_rows: int = 2) -> Sharing:
    """`shared` (a whole batch's, from `shared_prompts`) for the consecutive `rows` alone, as `shared_prompts` of
    those rows would find it: a prompt shared with rows outside `rows` is shared by fewer of them (or none)."""
    inside = [shared[row] for row in rows]
    return _blocks(inside, [count for _, count in inside], min_rows)


def stream_length(lengths: list[int], shared: Sharing) -> int:
    """Tokens of the stream of rows of `lengths` sharing as `shared` says (without filler)."""
    prefixes = {block: count for block, count in shared}
    return sum(lengths) - sum(count for _, count in shared) + sum(prefixes.values())


def _stream_layout(lengths: list[int], shared: Sharing
                   ) -> tuple[list[list[int]], list[list[bool]], list[int], list[int], list[int]]:
    """The stream of rows of `lengths` sharing as `shared` says, block after block (a shared prefix, then each of
    its rows' own tokens): per row, the stream index of each of its tokens and whether the row writes that token
    back from attention (a shared prefix: its first row only); the rows in stream order; the blocks' sizes; each
    stream token's position in its row."""
    blocks: dict[tuple[int, int], list[int]] = {}  # (first row, shared count) -> the block's rows
    for row, key in enumerate(shared):
        blocks.setdefault(key, []).append(row)
    index: list[list[int]] = [[] for _ in lengths]
    owned: list[list[bool]] = [[] for _ in lengths]
    order, sizes, positions = [], [], []
    for (_, count), rows in blocks.items():
        start = len(positions)
        positions += range(count)
        for i, row in enumerate(rows):
            own = len(positions)
            index[row] = list(range(start, start + count)) + list(range(own, own + lengths[row] - count))
            owned[row] = [i == 0] * count + [True] * (lengths[row] - count)
            positions += range(count, lengths[row])
            order.append(row)
        sizes.append(len(positions) - start)
    return index, owned, order, sizes, positions


@dataclass(frozen=True)
class PackedRows:
    """Where the tokens of B right-padded rows go in a packed stream (see the module docstring).

    `valid` is the batch's `[B, L]` mask and `index` the stream position of each of its positions (padding: 0);
    `lengths` the rows laid out for attention (the B rows, prefix included, in stream order, then any filler);
    `cu_seqlens` the stream's blocks (a shared prefix with its rows' own tokens, a row, or a filler; `[S + 1]`
    int32, from 0 to `total`), carrying `positions`, each stream token's position in its row (`[total]`);
    `gather` (`[S, width]`) the stream index of each position of each laid-out row, `gather_valid` which of them
    are real (padding points at the row's first token, which a causal mask never lets a real token see) and
    `gather_out` the ones whose attention result goes back to the stream (each stream token once, in stream order:
    a shared prefix from its first row)."""

    valid: Tensor
    index: Tensor
    lengths: tuple[int, ...]
    cu_seqlens: Tensor
    positions: Tensor
    gather: Tensor
    gather_out: Tensor

    @classmethod
    def of(cls, attention_mask: Tensor, total: int | None = None, shared: Sharing | None = None,
           multiple: int = 1) -> PackedRows:
        """The packing of a right-padded batch (`attention_mask` `[B, L]`: each row's real tokens first). `shared`
        (`shared_prompts`): per row, the first row of its block and how many leading tokens the block's rows share
        (the caller vouches that they are equal); None: nothing shared. With `total`, filler sequences of at most L
        tokens each make the stream `total` tokens long; with `multiple`, the stream's length is rounded up to a
        multiple of it (sequence parallelism splits the stream in that many equal parts)."""
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
        shared = [(row, 0) for row in range(len(lengths))] if shared is None else shared
        if len(shared) != len(lengths) or any(not (0 <= count < n and 0 <= block <= row and shared[block] == (
                block, count)) for row, ((block, count), n) in enumerate(zip(shared, lengths, strict=True))):
            raise ValueError(f"shared must name for each of the {len(lengths)} rows a block (its first row, that row "
                             "or an earlier one) and fewer shared tokens than the row has")
        return cls._build(valid, lengths, shared, total, multiple)

    @classmethod
    def _build(cls, valid: Tensor, lengths: list[int], shared: Sharing, total: int | None,
               multiple: int = 1) -> PackedRows:
        index, owned, order, blocks, positions = _stream_layout(lengths, shared)
        real, width = len(positions), valid.shape[1]
        if total is not None and total < real:
            raise ValueError(f"a stream of {total} tokens cannot hold the batch's {real} real tokens")
        if multiple > 1:
            total = -(-(real if total is None else total) // multiple) * multiple
        fillers = [] if total is None else [min(width, total - start) for start in range(real, total, width)]
        for n in fillers:  # filler sequences (token 0), each laid out as a row of its own
            index.append(list(range(len(positions), len(positions) + n)))
            owned.append([True] * n)
            order.append(len(index) - 1)
            positions += range(n)
        laid_out = [index[r] for r in order]
        size = max(map(len, laid_out))
        device = valid.device

        def tensor(rows: list[list[Any]], fill: Any | None = None, **kw: Any) -> Tensor:
            padded = [row + [row[0] if fill is None else fill] * (size - len(row)) for row in rows]
            return torch.tensor(padded, **kw).to(device)

        cu_seqlens = torch.tensor([0, *itertools.accumulate(blocks + fillers)], dtype=torch.int32).to(device)
        positions_t = torch.tensor(positions, dtype=torch.long).to(device)
        setattr(cu_seqlens, POSITIONS_ATTR, positions_t)
        flat = torch.tensor([row + [0] * (width - len(row)) for row in index[: len(lengths)]]).to(device)
        return cls(valid, flat, tuple(map(len, laid_out)), cu_seqlens, positions_t, tensor(laid_out),
                   tensor([owned[r] for r in order], False, dtype=torch.bool))

    @property
    def rows(self) -> int:
        """The batch's rows."""
        return int(self.valid.shape[0])

    @property
    def total(self) -> int:
        """Tokens in the stream, filler included."""
        return int(self.cu_seqlens[-1])

    @property
    def gather_valid(self) -> Tensor:
        """Which positions of `gather` hold a real token of their laid-out row (the rest is padding)."""
        lengths = torch.tensor(self.lengths, device=self.gather.device)
        return torch.arange(self.max_length, device=self.gather.device)[None, :] < lengths[:, None]

    @property
    def max_length(self) -> int:
        """The longest row (or filler) as attention lays it out."""
        return int(self.gather.shape[1])

    def pack(self, values: Tensor, fill: float | int = 0) -> Tensor:
        """`[B, L, ...]` -> `[total, ...]`: the stream's values (a shared prefix's from its rows, which hold the same
        there), then `fill` for the filler."""
        packed = values.new_full((self.total, *values.shape[2:]), fill)
        packed[self.index[self.valid]] = values[self.valid]
        return packed

    def unpack(self, values: Tensor) -> Tensor:
        """`[total, ...]` -> `[B, L, ...]`: each row's values back at their positions (a shared prefix's in every
        row that shares it), 0 on padding. Differentiable (the gradient of a padding position goes nowhere; a
        shared token's sums over its rows)."""
        out = values[self.index]
        return out.masked_fill(~self.valid.view(*self.valid.shape, *([1] * (out.dim() - 2))), 0)

    def unpack_predicted(self, values: Tensor) -> Tensor:
        """`[total]` next-token values along the stream (`token_logprobs`: position i + 1 holds the value of stream
        token i + 1 predicted at i) -> `[B, L]`: each row's value of its token t, predicted at its token t - 1; 0 at
        t = 0 (nothing predicts it) and on padding. Differentiable."""
        after = (self.index[:, :-1] + 1).clamp(max=values.shape[0] - 1)  # (past a row's end: padding, zeroed)
        out = torch.cat([values.new_zeros(self.rows, 1), values[after]], dim=1)
        return out.masked_fill(~self.valid, 0)
