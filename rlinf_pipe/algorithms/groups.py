"""Per-group statistics of rewards: the building block of group-relative advantages and of dynamic sampling.

Samples of one prompt share a group id. Ids are any integers (not necessarily contiguous or sorted), and groups
may differ in size, including size 1. Statistics are computed in float64 whatever the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupStats:
    """Statistics of each group; index `[G]` tensors with `index` to get one value per sample.

    `std` is the unbiased (Bessel-corrected, divide by n-1) standard deviation, defined as 0 for a group of one.
    `uniform` is True where every reward of the group is exactly equal (groups of one included).
    """

    index: Tensor  # [num_samples] long: dense group index in [0, num_groups)
    count: Tensor  # [num_groups] float64: samples per group
    mean: Tensor  # [num_groups] float64
    std: Tensor  # [num_groups] float64, unbiased; 0 for a group of one
    uniform: Tensor  # [num_groups] bool: all rewards of the group equal

    @property
    def num_groups(self) -> int:
        return self.count.numel()


def check_rewards(rewards: Tensor, group_ids: Tensor) -> None:
    """Raise ValueError unless `rewards` is a finite 1-D tensor and `group_ids` a matching 1-D integer tensor."""
    if rewards.dim() != 1 or group_ids.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D tensors of the same length, got shapes "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if rewards.numel() and not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (found NaN or inf)")


def group_stats(rewards: Tensor, group_ids: Tensor) -> GroupStats:
    """Mean, unbiased std and uniformity of the rewards of each group."""
    check_rewards(rewards, group_ids)
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    r = rewards.to(torch.float64)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, index, torch.ones_like(r))
    mean = zeros.index_add(0, index, r) / count
    sq_dev = zeros.index_add(0, index, (r - mean[index]) ** 2)
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    low = zeros.scatter_reduce(0, index, r, "amin", include_self=False)
    high = zeros.scatter_reduce(0, index, r, "amax", include_self=False)
    return GroupStats(index=index, count=count, mean=mean, std=std, uniform=low == high)


def reward_metrics(rewards: Tensor, group_ids: Tensor) -> dict[str, float]:
    """A step's reward metrics: mean, std (over all samples, unbiased), and the fraction of groups whose rewards
    are all equal (they carry no learning signal under group-relative advantages)."""
    stats = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    return {
        "reward/mean": float(r.mean()) if r.numel() else 0.0,
        "reward/std": float(r.std()) if r.numel() > 1 else 0.0,
        "reward/uniform_group_frac": float(stats.uniform.double().mean()) if stats.num_groups else 0.0,
    }
