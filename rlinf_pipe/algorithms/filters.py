"""Dynamic sampling: drop prompt groups whose rewards are all equal (they carry no group-relative signal) and keep
sampling until the step holds enough groups. Pure bookkeeping; the runner does the generating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlinf_pipe.algorithms.groups import group_stats


def drop_uniform_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Keep mask `[num_samples]`: False for every sample of a group whose rewards are all exactly equal.

    A group of one sample is uniform, so it is dropped.
    """
    s = group_stats(rewards, group_ids)
    return ~s.uniform[s.index]


MAX_OVERSAMPLE = 4.0  # an extra round of dynamic sampling draws at most this many prompts per missing group


def adaptive_oversample(seen: int, varied: int, cap: float = MAX_OVERSAMPLE) -> float:
    """Prompts to draw per missing group in an extra round: the inverse of the share of groups so far whose
    rewards varied, within [1, `cap`] (`cap` when none varied)."""
    if varied < 0 or varied > seen or cap < 1:
        raise ValueError(f"need 0 <= varied <= seen and cap >= 1, got seen={seen}, varied={varied}, cap={cap}")
    return min(cap, max(1.0, seen / varied)) if varied else cap


@dataclass
class DynamicSampler:
    """Counts of one step of dynamic sampling: request groups round by round until `target_groups` non-uniform
    groups are kept or `max_extra_rounds` rounds beyond the first are spent.

    ```python
    sampler = DynamicSampler(target_groups=N, max_extra_rounds=K)
    while not sampler.done:
        for group in generate(sampler.start_round()):   # start_round() -> how many groups to request
            if sampler.offer(group.rewards):              # one group's rewards -> keep it?
                send(group)
    metrics.update(sampler.metrics())
    ```
    Groups offered once the target is reached are counted (`surplus`) but not kept. If the rounds run out first,
    the step trains on the `kept` groups it has (`metrics()["dynamic_sampling/filled"]` is 0).
    """

    target_groups: int
    max_extra_rounds: int = 0
    rounds: int = 0
    seen: int = 0
    uniform: int = 0
    kept: int = 0
    surplus: int = 0

    def __post_init__(self) -> None:
        if self.target_groups < 1 or self.max_extra_rounds < 0:
            raise ValueError(
                f"need target_groups >= 1 and max_extra_rounds >= 0, got {self.target_groups}, {self.max_extra_rounds}"
            )

    @property
    def full(self) -> bool:
        return self.kept >= self.target_groups

    @property
    def exhausted(self) -> bool:
        return self.rounds >= 1 + self.max_extra_rounds

    @property
    def done(self) -> bool:
        """No further round: the target is reached or no round is left. Check it between rounds."""
        return self.full or self.exhausted

    @property
    def needed(self) -> int:
        return max(self.target_groups - self.kept, 0)

    def start_round(self, oversample: float = 1.0) -> int:
        """Begin a round; returns the groups to request: `ceil(needed * oversample)`."""
        if self.done:
            raise RuntimeError(f"no round left: {self}")
        if oversample < 1:
            raise ValueError(f"oversample must be >= 1, got {oversample}")
        self.rounds += 1
        return math.ceil(self.needed * oversample)

    def offer(self, rewards: Tensor) -> bool:
        """Account for one group's rewards `[group_size]`; True if the group is kept."""
        if rewards.dim() != 1 or rewards.numel() == 0:
            raise ValueError(f"offer() takes one group's rewards as a non-empty 1-D tensor, got {tuple(rewards.shape)}")
        self.seen += 1
        if bool((rewards == rewards[0]).all()):
            self.uniform += 1
            return False
        if self.full:
            self.surplus += 1
            return False
        self.kept += 1
        return True

    def offer_batch(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """`offer` every group of a batch, in order of first appearance; keep mask `[num_samples]`."""
        s = group_stats(rewards, group_ids)
        keep_group = torch.zeros(s.num_groups, dtype=torch.bool, device=rewards.device)
        for g in dict.fromkeys(s.index.tolist()):  # groups in order of first appearance
            keep_group[g] = self.offer(rewards[s.index == g])
        return keep_group[s.index]

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/extra_rounds": float(max(self.rounds - 1, 0)),
            "dynamic_sampling/groups_seen": float(self.seen),
            "dynamic_sampling/groups_kept": float(self.kept),
            "dynamic_sampling/groups_surplus": float(self.surplus),
            "dynamic_sampling/uniform_group_frac": self.uniform / self.seen if self.seen else 0.0,
            "dynamic_sampling/filled": float(self.full),
        }
