"""Token log-probabilities and entropies from (possibly vocab-parallel) logits; pure functions.

Logits are `[B, L, V_local]`: the full padded vocabulary, or this rank's contiguous shard of it when the output
layer is tensor-parallel (`tp_group` given; shard `r` holds columns `[r * V_local, (r + 1) * V_local)`). Columns at
or past the real vocabulary size (Megatron pads the vocabulary to a multiple of TP) are excluded from every
softmax. With a TP group, the max, the sum of exponentials and the target logit are all-reduced over the group:
full logits are never gathered. Every TP rank returns the same values, and gradients flow to the local shard as
they would through a full-vocabulary `log_softmax`.

Alignment matches `TrainBatch`: `out[b, t]` is about token `input_ids[b, t]` given `input_ids[b, :t]`, computed
from the logits at position `t - 1`; `out[:, 0]` is 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["token_logprobs", "token_entropy", "token_logprobs_and_entropy"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group in forward; identity in backward (every rank computes the same loss downstream, so
    each rank's share receives the full upstream gradient, as in Megatron's reduce-from-TP-region)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _group_info(tp_group: Any) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _shifted(logits: Tensor, temperature: float, vocab_size: int, tp_group: Any) -> tuple[Tensor, Tensor, int]:
    """Logits predicting positions 1..L-1, scaled by 1/temperature and shifted by the (detached, global) max over
    the real vocabulary; plus the mask of real-vocabulary columns of this shard and the shard's first column."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, seq, vocab], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank, world = _group_info(tp_group)
    local = logits.shape[-1]
    start = rank * local
    if local * world < vocab_size:
        raise ValueError(f"logits cover {local * world} vocabulary columns, fewer than vocab_size {vocab_size}")
    z = logits[:, :-1, :].float() / temperature
    valid = (torch.arange(local, device=logits.device) + start) < vocab_size  # [V_local]
    with torch.no_grad():
        m = torch.where(valid, z, torch.full_like(z, float("-inf"))).amax(dim=-1, keepdim=True)
        if tp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    # Padded columns become 0 before exp and are zeroed after it: no inf/NaN in values or gradients.
    z = torch.where(valid, z - m, torch.zeros_like(z))
    return z, valid, start


def _sum_exp(z: Tensor, valid: Tensor, tp_group: Any) -> tuple[Tensor, Tensor]:
    e = torch.where(valid, torch.exp(z), torch.zeros_like(z))
    s = e.sum(dim=-1)
    if tp_group is not None:
        s = _AllReduceSum.apply(s, tp_group)
    return e, s


def _pad_first(values: Tensor) -> Tensor:
    return torch.cat([values.new_zeros(values.shape[0], 1), values], dim=1)


def _logprobs(z: Tensor, s: Tensor, input_ids: Tensor, start: int, tp_group: Any) -> Tensor:
    local = z.shape[-1]
    target = input_ids[:, 1:].to(z.device).long() - start
    in_shard = (target >= 0) & (target < local)
    picked = z.gather(-1, target.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(in_shard, picked, torch.zeros_like(picked))
    if tp_group is not None:
        picked = _AllReduceSum.apply(picked, tp_group)
    return picked - torch.log(s)


def _entropy(z: Tensor, e: Tensor, s: Tensor, tp_group: Any) -> Tensor:
    # H = log S - sum(e * z) / S with e = exp(z) on real columns (0 elsewhere, where z is 0 too).
    ez = (e * z).sum(dim=-1)
    if tp_group is not None:
        ez = _AllReduceSum.apply(ez, tp_group)
    return torch.log(s) - ez / s


def _check_ids(logits: Tensor, input_ids: Tensor) -> None:
    if input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} must match the logits' [batch, seq] {tuple(logits.shape[:2])}"
        )


def token_logprobs(
    logits: Tensor, input_ids: Tensor, temperature: float = 1.0, vocab_size: int | None = None, tp_group: Any = None
) -> Tensor:
    """`[B, L]` float32: `out[:, t] = log softmax(logits[:, t-1] / temperature)[input_ids[:, t]]`, `out[:, 0] = 0`.

    `vocab_size`: the real vocabulary (columns at or past it are masked); default all columns of the full
    logits. `tp_group`: the tensor-parallel group when `logits` are vocab shards. Differentiable.
    """
    _check_ids(logits, input_ids)
    vocab_size = _default_vocab(logits, vocab_size, tp_group)
    z, valid, start = _shifted(logits, temperature, vocab_size, tp_group)
    _, s = _sum_exp(z, valid, tp_group)
    return _pad_first(_logprobs(z, s, input_ids, start, tp_group))


def token_entropy(
    logits: Tensor, temperature: float = 1.0, vocab_size: int | None = None, tp_group: Any = None
) -> Tensor:
    """`[B, L]` float32 entropy of the distribution that predicts each token (same alignment and masking as
    `token_logprobs`; `out[:, 0] = 0`). Differentiable."""
    vocab_size = _default_vocab(logits, vocab_size, tp_group)
    z, valid, _ = _shifted(logits, temperature, vocab_size, tp_group)
    e, s = _sum_exp(z, valid, tp_group)
    return _pad_first(_entropy(z, e, s, tp_group))


def token_logprobs_and_entropy(
    logits: Tensor, input_ids: Tensor, temperature: float = 1.0, vocab_size: int | None = None, tp_group: Any = None
) -> tuple[Tensor, Tensor]:
    """Both `token_logprobs` and `token_entropy`, sharing the softmax statistics (and collectives)."""
    _check_ids(logits, input_ids)
    vocab_size = _default_vocab(logits, vocab_size, tp_group)
    z, valid, start = _shifted(logits, temperature, vocab_size, tp_group)
    e, s = _sum_exp(z, valid, tp_group)
    return _pad_first(_logprobs(z, s, input_ids, start, tp_group)), _pad_first(_entropy(z, e, s, tp_group))


def _default_vocab(logits: Tensor, vocab_size: int | None, tp_group: Any) -> int:
    if vocab_size is not None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        return vocab_size
    return logits.shape[-1] * _group_info(tp_group)[1]
