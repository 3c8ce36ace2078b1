"""Turning rewards into what the pipeline trains on and reports: advantages per group, and the reward tallies
of a step's metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlinf_pipe.algorithms.advantages import compute_advantages
from rlinf_pipe.data.structs import RolloutGroup, ScoredGroup


@dataclass
class RewardTally:
    """Sums over a step's scored samples; `merge` adds tallies of several workers, `metrics` reads them out."""

    samples: int = 0
    groups: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    correct: int = 0
    parsed: int = 0
    response_tokens: int = 0
    truncated: int = 0
    uniform_groups: int = 0
    timeouts: int = 0

    def add(self, group: RolloutGroup, rewards: Sequence[float], correct: Sequence[bool], parsed: Sequence[bool],
            timed_out: Sequence[bool] = ()):
        """Count one scored group; `timed_out` marks samples whose verification ran out of time (they count as
        unparsed too)."""
        self.groups += 1
        self.timeouts += int(sum(timed_out))
        self.samples += len(rewards)
        self.reward_sum += float(sum(rewards))
        self.reward_sq_sum += float(sum(r * r for r in rewards))
        self.correct += int(sum(correct))
        self.parsed += int(sum(parsed))
        self.response_tokens += group.num_tokens
        self.truncated += sum(s.finish_reason == "length" for s in group.samples)
        self.uniform_groups += int(max(rewards) == min(rewards))

    def merge(self, other: RewardTally) -> RewardTally:
        return RewardTally(**{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__})

    def metrics(self) -> dict[str, float]:
        n = max(self.samples, 1)
        mean = self.reward_sum / n
        return {
            "reward/mean": mean,
            "reward/std": max(self.reward_sq_sum / n - mean * mean, 0.0) ** 0.5,
            "reward/accuracy": self.correct / n,
            "reward/parsed_frac": self.parsed / n,
            "reward/parse_failures": float(self.samples - self.parsed - self.timeouts),
            "reward/timeouts": float(self.timeouts),
            "reward/uniform_group_frac": self.uniform_groups / max(self.groups, 1),
            "response_length/mean": self.response_tokens / n,
            "response_length/truncated_frac": self.truncated / n,
            "rollout/samples": float(self.samples),
        }


def score_groups(
    groups: Sequence[RolloutGroup], rewards: Sequence[Sequence[float]], adv_estimator: str, **adv_options: object
) -> list[ScoredGroup]:
    """Attach rewards and advantages to groups. Group-scoped estimators see one group at a time; pass all of a
    step's groups at once for batch-scoped ones (the caller decides, see `advantage_scope`)."""
    flat = torch.tensor([r for rs in rewards for r in rs], dtype=torch.float32)
    ids = torch.tensor([g for g, rs in enumerate(rewards) for _ in rs], dtype=torch.long)
    adv = compute_advantages(adv_estimator, flat, ids, **adv_options)
    out, start = [], 0
    for group, rs in zip(groups, rewards, strict=True):
        end = start + len(rs)
        out.append(ScoredGroup(group=group, rewards=flat[start:end].numpy(), advantages=adv[start:end].numpy(),
                               version=group.version))
        start = end
    return out
