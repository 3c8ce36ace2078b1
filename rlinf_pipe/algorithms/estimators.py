"""The built-in advantage estimators (registered by name in `rlinf_pipe.algorithms.advantages`, which loads this
module, and torch, the first time one of them is used). Formulas and references: docs/algorithms.md."""

from __future__ import annotations

import torch
from torch import Tensor

from rlinf_pipe.algorithms.groups import GroupStats, check_rewards, group_stats


def _output(adv: Tensor, rewards: Tensor, stats: GroupStats | None = None) -> Tensor:
    """Zero the samples of uniform groups (exactly, whatever the rounding) and cast to the rewards' dtype."""
    if stats is not None:
        adv = torch.where(stats.uniform[stats.index], torch.zeros_like(adv), adv)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    return adv.to(dtype)


def _check_eps(eps: float) -> None:
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def batch_whiten(values: Tensor, eps: float = 1e-6, *, subtract_mean: bool = True) -> Tensor:
    """`(values - mean) / (std + eps)` over the whole tensor, std unbiased; zeros for fewer than two values or
    all-equal values. Computed in float64."""
    _check_eps(eps)
    x = values.to(torch.float64)
    if x.numel() < 2 or bool((x == x[0]).all()):
        return torch.zeros_like(x)
    centred = x - x.mean() if subtract_mean else x
    return centred / (x.std(unbiased=True) + eps)


def grpo(rewards: Tensor, group_ids: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: `(r - group_mean) / (group_std + eps)`, std unbiased. `norm_by_std=False` is Dr. GRPO."""
    _check_eps(eps)
    s = group_stats(rewards, group_ids)
    adv = rewards.to(torch.float64) - s.mean[s.index]
    if norm_by_std:
        adv = adv / (s.std[s.index] + eps)
    return _output(adv, rewards, s)


def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO: `r - group_mean` (GRPO without the division by the group std)."""
    return grpo(rewards, group_ids, norm_by_std=False)


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: `r_i - mean of the other samples of the group`; 0 for a group of one."""
    s = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    n = s.count[s.index]
    others_mean = (s.mean[s.index] * n - r) / (n - 1).clamp(min=1)
    return _output(r - others_mean, rewards, s)


def reinforce_plus_plus(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: rewards whitened over the whole batch, `(r - batch_mean) / (batch_std + eps)`, std unbiased.
    `group_ids` are only validated: the baseline is the batch, not the group."""
    check_rewards(rewards, group_ids)
    return _output(batch_whiten(rewards, eps), rewards)


def reinforce_plus_plus_baseline(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, then divide by the batch std of the centred rewards (+ eps).

    The batch mean of group-centred rewards is zero by construction, so it is not subtracted again: uniform
    groups stay exactly 0.
    """
    s = group_stats(rewards, group_ids)
    centred = torch.where(s.uniform[s.index], 0.0, rewards.to(torch.float64) - s.mean[s.index])
    return _output(batch_whiten(centred, eps, subtract_mean=False), rewards, s)
