"""Context parallelism over a packed stream: each rank of the context-parallel (CP) group holds a slice of every
sequence, attention gathers the keys and values of the whole group, and per-token results come back whole.

The layout balances causal attention's work: each sequence (a block of the packed stream, `PackedRows.cu_seqlens`)
is padded at its end to a multiple of `2 * cp` tokens and cut into `2 * cp` equal chunks; rank `r` keeps chunks `r`
and `2 * cp - 1 - r` (an early, cheap chunk and a late, expensive one). Padding tokens follow their sequence's real
tokens, so that a causal mask never lets a real token see one. All of it is index arithmetic (`CpLayout.of`), made
once per micro-batch on every rank of the group.

    layout = CpLayout.of(rows, cp=2, rank=r)     # rows: PackedRows of the micro-batch's stream
    ids = layout.local_ids(rows.pack(input_ids)) # [local] this rank's tokens, in their blocks' order
    values = layout.stream_values(gather_values(local_values, group))  # [total]: value of stream token s at s - 1

A token whose predecessor is on another rank is still predicted right: a rank computes the value of the token
after each of its own (`next_ids`; at the end of each of its runs of consecutive tokens, the token after the run,
from the whole padded stream that every rank builds), and `stream_values` puts each value where it belongs.

Two autograd-aware gathers over the group: `gather_keys` (keys and values of attention: the backward sums each
rank's gradient of the gathered tensor, then keeps its own slice) and `gather_values` (per-token results that every
rank then uses whole in the same loss: the backward keeps this rank's slice of the gradient, without a sum, so that
the gradients summed over the CP group by Megatron's data-parallel reduction count each token once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlinf_pipe.models.packed_rows import POSITIONS_ATTR, PackedRows

SHARE_ATTR = "_rlinf_cp_share"  # set on the `cu_seqlens` of a rank's share (its positions are the share's tokens')


def padded_block_lengths(lengths: list[int], cp: int, multiple: int = 1, local_total: int | None = None
                         ) -> list[int]:
    """The blocks' lengths in the CP layout: each a multiple of `2 * cp`, the last made longer so that a rank's
    share (`sum // cp`) is a multiple of `multiple` (sequence parallelism splits it over TP) and at least
    `local_total` (the micro-batches of a pipeline schedule share a shape)."""
    if cp < 1 or not lengths:
        raise ValueError(f"need cp >= 1 and at least one block, got cp={cp}, {len(lengths)} blocks")
    step = 2 * cp
    padded = [-(-n // step) * step for n in lengths]
    local = sum(padded) // cp
    unit = 2 * multiple // _gcd(2, multiple)  # a share stays even (two chunks of each block) and a multiple
    target = -(-max(local, local_total or 0) // unit) * unit
    padded[-1] += (target - local) * cp
    return padded


def local_length(lengths: list[int], cp: int, multiple: int = 1) -> int:
    """Tokens per rank of a stream of blocks of `lengths` (see `padded_block_lengths`)."""
    return sum(padded_block_lengths(lengths, cp, multiple)) // cp


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@dataclass(frozen=True)
class CpLayout:
    """Where this rank's tokens are in a packed stream's CP layout (see the module docstring).

    Padded stream: each block of the stream followed by its padding (`padded` lengths, `M` tokens in all).
    `stream_at` `[M]`: the stream index of each padded position (-1: padding); `local` `[M / cp]`: the padded
    positions this rank holds, block after block; `order` `[M]`: every rank's `local`, rank after rank (the order of
    a gather over the group); `inverse` `[M]`: where each padded position is in `order`. `run_ends` `[E]`: the local
    indices whose next padded position is not the next local one. `source` `[total]`: where in a gathered vector of
    next-token values the value of each stream token is. Attention: `kv_index` `[S, W]` (each block's padded positions
    in `order`), `q_index` / `q_pos` `[S, Q]` (each block's local tokens and their positions in the block),
    `out_index` `[M / cp]` (each local token in the flattened `[S * Q]` layout)."""

    cp: int
    rank: int
    padded: tuple[int, ...]
    stream_at: Tensor
    local: Tensor
    order: Tensor
    inverse: Tensor
    run_ends: Tensor
    source: Tensor
    positions: Tensor
    cu_seqlens: Tensor
    kv_index: Tensor
    q_index: Tensor
    q_pos: Tensor
    out_index: Tensor

    @classmethod
    def of(cls, rows: PackedRows, cp: int, rank: int, multiple: int = 1, local_total: int | None = None
           ) -> CpLayout:
        """The layout of `rows`' stream on rank `rank` of `cp` (`multiple`, `local_total`: `padded_block_lengths`).
        The stream must share no prompts (each row a block of its own: CP splits blocks by their positions)."""
        if not 0 <= rank < cp:
            raise ValueError(f"rank {rank} is not a rank of a context-parallel group of {cp}")
        cu = rows.cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        if rows.positions.tolist() != [p for n in lengths for p in range(n)]:
            raise ValueError("context parallelism needs a packed stream without shared prompts (share_prompts off)")
        padded = padded_block_lengths(lengths, cp, multiple, local_total)
        device = rows.cu_seqlens.device
        starts = [0]
        for m in padded:
            starts.append(starts[-1] + m)
        total_padded = starts[-1]
        stream_at = torch.full((total_padded,), -1, dtype=torch.long)
        for b, n in enumerate(lengths):
            stream_at[starts[b]: starts[b] + n] = torch.arange(cu[b], cu[b] + n)
        chunk = [m // (2 * cp) for m in padded]

        def held(r: int) -> list[Tensor]:  # per block, the padded positions rank r holds
            return [torch.cat([torch.arange(s + r * c, s + (r + 1) * c),
                               torch.arange(s + (2 * cp - 1 - r) * c, s + (2 * cp - r) * c)])
                    for s, c in zip(starts[:-1], chunk, strict=True)]

        mine = held(rank)
        local = torch.cat(mine)
        order = torch.cat([torch.cat(held(r)) for r in range(cp)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(total_padded)
        follows = torch.cat([local[1:] == local[:-1] + 1, torch.tensor([False])])
        run_ends = torch.nonzero(~follows).flatten()
        padded_of_stream = torch.empty(rows.total, dtype=torch.long)
        padded_of_stream[stream_at[stream_at >= 0]] = torch.nonzero(stream_at >= 0).flatten()
        source = inverse[(padded_of_stream - 1).clamp(min=0)]
        block_start = torch.tensor(starts[:-1]).repeat_interleave(torch.tensor([2 * c for c in chunk]))
        positions = local - block_start
        width, queries = max(padded), max(2 * c for c in chunk)
        kv_index = torch.zeros(len(padded), width, dtype=torch.long)
        q_index = torch.zeros(len(padded), queries, dtype=torch.long)
        q_pos = torch.zeros(len(padded), queries, dtype=torch.long)
        out_index, at = [], 0
        for b, (s, m, held_b) in enumerate(zip(starts[:-1], padded, mine, strict=True)):
            kv_index[b, :m] = inverse[s: s + m]
            q_index[b, : len(held_b)] = torch.arange(at, at + len(held_b))
            q_pos[b, : len(held_b)] = held_b - s
            out_index.append(torch.arange(b * queries, b * queries + len(held_b)))
            at += len(held_b)
        cu_local = torch.tensor([0, *torch.tensor([2 * c for c in chunk]).cumsum(0).tolist()], dtype=torch.int32)
        positions = positions.to(device)
        cu_local = cu_local.to(device)
        setattr(cu_local, POSITIONS_ATTR, positions)  # (the rotary embedding reads each token's position there)
        setattr(cu_local, SHARE_ATTR, True)
        return cls(cp, rank, tuple(padded), stream_at.to(device), local.to(device), order.to(device),
                   inverse.to(device), run_ends.to(device), source.to(device), positions, cu_local,
                   kv_index.to(device), q_index.to(device), q_pos.to(device), torch.cat(out_index).to(device))

    @property
    def local_length(self) -> int:
        """Tokens this rank holds."""
        return int(self.local.shape[0])

    @property
    def max_length(self) -> int:
        """The longest padded block."""
        return max(self.padded)

    def padded_ids(self, stream_ids: Tensor) -> Tensor:
        """`[total]` stream ids -> `[M]` the padded stream's (padding: token 0)."""
        out = stream_ids.new_zeros(self.stream_at.shape[0])
        real = self.stream_at >= 0
        out[real] = stream_ids[self.stream_at[real]]
        return out

    def local_ids(self, stream_ids: Tensor) -> Tensor:
        """`[total]` stream ids -> `[local]` this rank's."""
        return self.padded_ids(stream_ids)[self.local]

    def next_ids(self, stream_ids: Tensor) -> Tensor:
        """`[E]` the token after each run end of this rank (the last padded position: itself, never used)."""
        padded = self.padded_ids(stream_ids)
        return padded[(self.local[self.run_ends] + 1).clamp(max=padded.shape[0] - 1)]

    def next_values(self, along: Tensor, at_ends: Tensor) -> Tensor:
        """This rank's next-token values `[local]` (of the padded token after each local token) from `along`
        (`[local]`, a result of `token_logprobs` on the local ids: position j + 1 holds the value predicted at j)
        and `at_ends` (`[E]`, the values at the run ends, of `next_ids`)."""
        values = torch.cat([along[1:], along.new_zeros(1)])
        return values.index_put((self.run_ends,), at_ends)

    def stream_values(self, gathered: Tensor) -> Tensor:
        """`[M]` next-token values gathered over the group (`gather_values` of `next_values`) -> `[total]` along
        the stream: position s holds the value of stream token s predicted at s - 1 (as `PackedRows.unpack_predicted`
        takes them; a block's first position holds a value that is never read)."""
        return gathered[self.source]

    def attention_mask(self) -> Tensor:
        """`[S, Q, W]` True where a local query (`q_index`) may see a key of its block (`kv_index`): causal."""
        keys = torch.arange(self.kv_index.shape[1], device=self.q_pos.device)
        return keys[None, None, :] <= self.q_pos[:, :, None]


class _GatherKeys(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward: the gradients of every rank summed, this rank's slice."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(ctx.size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        part = grad.shape[0] // ctx.size
        if dist.get_backend(ctx.group) == "nccl":
            out = grad.new_empty(part, *grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)  # (gloo has no reduce-scatter)
        return grad[ctx.rank * part: (ctx.rank + 1) * part].clone(), None


class _GatherValues(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward: this rank's slice of the gradient, unsummed."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(ctx.size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        part = grad.shape[0] // ctx.size
        return grad[ctx.rank * part: (ctx.rank + 1) * part], None


def gather_keys(tensor: Tensor, group: Any) -> Tensor:
    """Every rank's `tensor` (equal shapes) concatenated along dim 0, rank after rank; the backward sums the
    gradient over the group (each rank's queries' share of a key's gradient)."""
    return _GatherKeys.apply(tensor, group)


def gather_values(tensor: Tensor, group: Any) -> Tensor:
    """Every rank's `tensor` concatenated along dim 0, for a loss that every rank computes the same from the whole;
    the backward keeps this rank's slice of the gradient (not summed: the ranks' gradients are summed later)."""
    return _GatherValues.apply(tensor, group)
