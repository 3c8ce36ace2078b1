"""Token log-probabilities and entropies from (possibly vocab-parallel) logits, in chunks; pure functions.

Logits are `[B, L, V_local]`: the full padded vocabulary, or this rank's contiguous shard of it when the output
layer is tensor-parallel (`tp_group` given; shard `r` holds columns `[r * V_local, (r + 1) * V_local)`). Columns at
or past the real vocabulary size (Megatron pads the vocabulary to a multiple of TP) are excluded from every
softmax. With a TP group, the max, the sum of exponentials, the target logit and the entropy's sum are all-reduced
over the group: full logits are never gathered. Every TP rank returns the same values, and each rank's gradient is
its shard's part of the gradient of a full-vocabulary `log_softmax`.

Memory: the positions are processed a chunk at a time (about `CHUNK_BYTES` of float32 working memory per chunk:
whole sequences when one fits, else a run of positions of one sequence), so no float32 copy of the `[B, L, V]`
logits ever exists; the backward pass recomputes each chunk's softmax from the logits (kept in their own dtype)
and the per-position log-sum-exp, instead of storing float32 intermediates. Logits whose whole float32 copy fits in
one chunk, without a TP group, take torch's fused `log_softmax` instead (fewer passes; the same values within float
rounding).

Alignment matches `TrainBatch`: `out[b, t]` is about token `input_ids[b, t]` given `input_ids[b, :t]`, computed
from the logits at position `t - 1`; `out[:, 0]` is 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from rlinf_pipe.planning.engine_sizes import CHUNK_BYTES

__all__ = ["CHUNK_BYTES", "token_entropy", "token_logprobs", "token_logprobs_and_entropy"]



def _group_info(tp_group: Any) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _all_reduce(x: Tensor, op: str, tp_group: Any) -> Tensor:
    if tp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(x, op=getattr(dist.ReduceOp, op), group=tp_group)
    return x


def _chunks(logits: Tensor, chunk_bytes: int) -> Iterator[tuple[slice, slice]]:
    """(sequences, positions) of each chunk of the positions 0..L-2 that predict a token: as many whole sequences
    as fit in `chunk_bytes` of float32 rows, else runs of positions of one sequence. (Few chunks: the per-chunk
    Python and op dispatch, not the arithmetic, is what a small vocabulary pays for.)"""
    batch, length, local = logits.shape
    rows = max(1, chunk_bytes // (4 * local))
    if length - 1 <= rows:
        per_chunk = rows // (length - 1)
        for b in range(0, batch, per_chunk):
            yield slice(b, min(b + per_chunk, batch)), slice(0, length - 1)
        return
    for b in range(batch):
        for start in range(0, length - 1, rows):
            yield slice(b, b + 1), slice(start, min(start + rows, length - 1))


def _real_columns(local: int, start: int, vocab_size: int) -> int:
    """How many of a shard's columns (from global column `start`) are real vocabulary: always a prefix."""
    return max(0, min(local, vocab_size - start))


class _Chunk:
    """One chunk's scaled logits `z` over the shard's real columns (float32; the padded columns are left out, and a
    shard of padding only gets one -inf column, which adds nothing to the softmax) and its targets in the shard.
    At temperature 1 and float32, `z` is a view of the logits: read it, never write it (the first pass over it
    makes the new tensor, `z - m`, instead of a copy that is then shifted in place)."""

    def __init__(self, logits: Tensor, targets: Tensor, b: slice, t: slice, temperature: float, columns: int,
                 start: int):
        if columns:
            z = logits[b, t, :columns].float()  # (float() of float32 is no copy)
            self.z = z if temperature == 1.0 else z / temperature
        else:
            self.z = torch.full((*logits[b, t].shape[:-1], 1), float("-inf"), device=logits.device)
        target = targets[b, t].to(self.z.device).long() - start
        self.in_shard = (target >= 0) & (target < columns)
        self.target = target.clamp(0, self.z.shape[-1] - 1)


class _LogprobsEntropy(torch.autograd.Function):
    """`(logprobs, entropy)` `[B, L-1]` of each position's next token; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float, vocab_size: int, tp_group: Any,
                chunk_bytes: int) -> tuple[Tensor, Tensor]:
        rank, _ = _group_info(tp_group)
        batch, length, local = logits.shape
        start = rank * local
        columns = _real_columns(local, start, vocab_size)
        shape = (batch, length - 1)
        lp = torch.empty(shape, dtype=torch.float32, device=logits.device)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        for b, t in _chunks(logits, chunk_bytes):
            c = _Chunk(logits, targets, b, t, temperature, columns, start)
            m = _all_reduce(c.z.amax(dim=-1), "MAX", tp_group)
            z = c.z - m[..., None]
            e = z.exp()
            s = _all_reduce(e.sum(dim=-1), "SUM", tp_group)
            picked = z.gather(-1, c.target[..., None]).squeeze(-1)
            picked = _all_reduce(torch.where(c.in_shard, picked, torch.zeros_like(picked)), "SUM", tp_group)
            if not columns:
                z.zero_()  # (0 * -inf would be nan; the column's weight e is 0)
            ez = _all_reduce((e.mul_(z)).sum(dim=-1), "SUM", tp_group)
            log_s = s.log()
            lp[b, t] = picked - log_s
            ent[b, t] = log_s - ez / s
            lse[b, t] = m + log_s
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.vocab_size, ctx.tp_group, ctx.chunk_bytes = temperature, vocab_size, tp_group, chunk_bytes
        ctx.set_materialize_grads(False)  # an output the loss does not use gets no gradient pass
        return lp, ent

    @staticmethod
    def backward(ctx: Any, grad_lp: Tensor | None, grad_ent: Tensor | None) -> tuple[Any, ...]:
        logits, targets, lse, ent = ctx.saved_tensors
        rank, _ = _group_info(ctx.tp_group)
        local = logits.shape[-1]
        start = rank * local
        columns = _real_columns(local, start, ctx.vocab_size)
        grad = torch.zeros_like(logits)  # padded columns get none
        for b, t in _chunks(logits, ctx.chunk_bytes) if columns else ():
            c = _Chunk(logits, targets, b, t, ctx.temperature, columns, start)
            logp = c.z - lse[b, t, None]  # log p
            p = logp.exp()
            dz = torch.zeros_like(p)
            if grad_ent is not None:  # dH/dz_k = -p_k (log p_k + H)
                logp.add_(ent[b, t, None])
                dz.sub_(p * logp * grad_ent[b, t, None])
            if grad_lp is not None:  # d log p_t / dz_k = 1[k = t] - p_k
                g = grad_lp[b, t]
                dz.sub_(p.mul_(g[..., None]))
                dz.scatter_add_(-1, c.target[..., None], torch.where(c.in_shard, g, 0.0)[..., None])
            grad[b, t, :columns] = dz.div_(ctx.temperature).to(grad.dtype)
        return grad, None, None, None, None, None


def _check(logits: Tensor, temperature: float, vocab_size: int | None, tp_group: Any) -> int:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, seq, vocab], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    world = _group_info(tp_group)[1]
    covered = logits.shape[-1] * world
    if vocab_size is None:
        return covered
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if covered < vocab_size:
        raise ValueError(f"logits cover {covered} vocabulary columns, fewer than vocab_size {vocab_size}")
    return vocab_size


def _pad_first(values: Tensor) -> Tensor:
    return torch.cat([values.new_zeros(values.shape[0], 1), values], dim=1)


def _direct(logits: Tensor, targets: Tensor, temperature: float, vocab: int, with_entropy: bool
            ) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) through torch's fused `log_softmax`, for logits whose float32 copy is small: fewer
    and faster kernels than the chunked function, the float32 log-probs kept for the backward."""
    z = logits[:, :-1, :vocab].float()
    logp = torch.log_softmax(z if temperature == 1.0 else z / temperature, dim=-1)
    lp = logp.gather(-1, targets[..., None].long()).squeeze(-1)
    return lp, (-(logp.exp() * logp).sum(dim=-1) if with_entropy else None)


def _token_values(logits: Tensor, input_ids: Tensor, temperature: float, vocab_size: int | None, tp_group: Any,
                  chunk_bytes: int, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    if input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} must match the logits' [batch, seq] {tuple(logits.shape[:2])}"
        )
    vocab = _check(logits, temperature, vocab_size, tp_group)
    if logits.shape[1] < 2:
        zeros = logits.new_zeros(logits.shape[:2], dtype=torch.float32)
        return zeros, zeros.clone() if with_entropy else None
    batch, length, _ = logits.shape
    if tp_group is None and 4 * batch * (length - 1) * vocab <= chunk_bytes:
        lp, ent = _direct(logits, input_ids[:, 1:], temperature, vocab, with_entropy)
    else:
        lp, ent = _LogprobsEntropy.apply(logits, input_ids[:, 1:], temperature, vocab, tp_group, chunk_bytes)
    return _pad_first(lp), (_pad_first(ent) if with_entropy else None)


def token_logprobs_and_entropy(
    logits: Tensor, input_ids: Tensor, temperature: float = 1.0, vocab_size: int | None = None, tp_group: Any = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[Tensor, Tensor]:
    """`[B, L]` float32 log-probs `out[:, t] = log softmax(logits[:, t-1] / temperature)[input_ids[:, t]]` and the
    entropies of those distributions; `out[:, 0] = 0`. `vocab_size`: the real vocabulary (columns at or past it
    are masked; default every column). `tp_group`: the tensor-parallel group when `logits` are vocab shards.
    Differentiable with respect to `logits`. Without a TP group, logits whose float32 copy fits in `chunk_bytes` go
    through torch's `log_softmax` at once; larger ones, and vocab shards, a chunk of positions at a time."""
    lp, ent = _token_values(logits, input_ids, temperature, vocab_size, tp_group, chunk_bytes, True)
    return lp, ent


def token_logprobs(
    logits: Tensor, input_ids: Tensor, temperature: float = 1.0, vocab_size: int | None = None, tp_group: Any = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Tensor:
    """The log-probs of `token_logprobs_and_entropy` (the entropies are not computed where that can be avoided).
    Differentiable."""
    return _token_values(logits, input_ids, temperature, vocab_size, tp_group, chunk_bytes, False)[0]


def token_entropy(
    logits: Tensor, temperature: float = 1.0, vocab_size: int | None = None, tp_group: Any = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Tensor:
    """The entropies of `token_logprobs_and_entropy` (the targets do not matter). Differentiable."""
    ids = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    return token_logprobs_and_entropy(logits, ids, temperature, vocab_size, tp_group, chunk_bytes)[1]
