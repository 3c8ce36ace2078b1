"""Turning rewards into what the pipeline trains on and reports: advantages per group, and the reward tallies
of a step's metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rlinf_pipe.algorithms.advantages import compute_advantages
from rlinf_pipe.data.structs import RolloutGroup, ScoredGroup


@dataclass
class RewardTally:
    """Sums over a step's scored samples; `merge` adds tallies of several workers, `metrics` reads them out.
    `extra_sums` / `extra_counts`: a reward function's other numeric values by key, reported as their means."""

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
    errors: int = 0
    extra_sums: dict[str, float] = field(default_factory=dict)
    extra_counts: dict[str, int] = field(default_factory=dict)

    def add(self, group: RolloutGroup, rewards: Sequence[float], correct: Sequence[bool], parsed: Sequence[bool],
            timed_out: Sequence[bool] = (), errors: Sequence[bool] = (),
            extras: Sequence[Mapping[str, float] | None] = ()):
        """Count one scored group; `timed_out` marks samples whose verification ran out of time and `errors` those
        whose reward function failed (both count as unparsed, not as parse failures); `extras` holds each sample's
        reward-function values, if any."""
        self.groups += 1
        self.timeouts += int(sum(timed_out))
        self.errors += int(sum(errors))
        self.samples += len(rewards)
        self.reward_sum += float(sum(rewards))
        self.reward_sq_sum += float(sum(r * r for r in rewards))
        self.correct += int(sum(correct))
        self.parsed += int(sum(parsed))
        self.response_tokens += group.num_tokens
        self.truncated += sum(s.finish_reason == "length" for s in group.samples)
        self.uniform_groups += int(max(rewards) == min(rewards))
        for values in extras:
            for key, value in (values or {}).items():
                self.extra_sums[key] = self.extra_sums.get(key, 0.0) + float(value)
                self.extra_counts[key] = self.extra_counts.get(key, 0) + 1

    def merge(self, other: RewardTally) -> RewardTally:
        merged = {k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__
                  if not k.startswith("extra_")}
        sums, counts = dict(self.extra_sums), dict(self.extra_counts)
        for key, value in other.extra_sums.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + other.extra_counts[key]
        return RewardTally(**merged, extra_sums=sums, extra_counts=counts)

    def metrics(self) -> dict[str, float]:
        n = max(self.samples, 1)
        mean = self.reward_sum / n
        metrics = {
            "reward/mean": mean,
            "reward/std": max(self.reward_sq_sum / n - mean * mean, 0.0) ** 0.5,
            "reward/accuracy": self.correct / n,
            "reward/parsed_frac": self.parsed / n,
            "reward/parse_failures": float(self.samples - self.parsed - self.timeouts - self.errors),
            "reward/timeouts": float(self.timeouts),
            "reward/errors": float(self.errors),
            "reward/uniform_group_frac": self.uniform_groups / max(self.groups, 1),
            "response_length/mean": self.response_tokens / n,
            "response_length/truncated_frac": self.truncated / n,
            "rollout/samples": float(self.samples),
        }
        for key in sorted(self.extra_sums):  # (a key that is one of the tally's own names: `reward/extra/<key>`)
            name = f"reward/{key}" if f"reward/{key}" not in metrics else f"reward/extra/{key}"
            metrics[name] = self.extra_sums[key] / self.extra_counts[key]
        return metrics


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
