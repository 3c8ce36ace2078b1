"""Stage logic shared by the workers that run it: scoring + advantages, and micro-batch assembly.

Pure functions and small accumulators, so the Ray workers stay thin and the step's maths is testable alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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

    def add(self, group: RolloutGroup, rewards: Sequence[float], correct: Sequence[bool], parsed: Sequence[bool]):
        self.groups += 1
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


@dataclass
class MicroBatcher:
    """Collects arriving training items into micro-batches: at most `micro_batch_size` sequences and, when
    `max_tokens` is set, at most that many padded tokens (rows x longest row)."""

    micro_batch_size: int
    max_tokens: int | None = None
    pending: list = field(default_factory=list)
    pending_sequences: int = 0
    pending_width: int = 0

    def add(self, item, num_sequences: int, width: int = 0) -> list[list]:
        """Add an item (`width`: its padded length); returns the micro-batches (lists of items) now complete."""
        ready = []
        if self.pending and self.max_tokens is not None:
            if (self.pending_sequences + num_sequences) * max(self.pending_width, width) > self.max_tokens:
                ready.append(self.flush())  # the new item would break the token budget: send what is pending
        self.pending.append(item)
        self.pending_sequences += num_sequences
        self.pending_width = max(self.pending_width, width)
        if self.pending_sequences >= self.micro_batch_size:
            ready.append(self.flush())
        return ready

    def flush(self) -> list | None:
        if not self.pending:
            return None
        out, self.pending, self.pending_sequences, self.pending_width = self.pending, [], 0, 0
        return out


def concat_train_batches(batches: Sequence, pad_token_id: int):
    """One `TrainBatch` of the rows of `batches`, right-padded to the widest (per-token fields padded with 0)."""
    import msgspec

    from rlinf_pipe.data.structs import TrainBatch

    if len(batches) == 1:
        return batches[0]
    width = max(b.input_ids.shape[1] for b in batches)

    def cat(field_name: str, fill: float | int | bool) -> torch.Tensor:
        parts = []
        for b in batches:
            t = getattr(b, field_name)
            pad = width - t.shape[1]
            parts.append(torch.nn.functional.pad(t, (0, pad), value=fill) if pad else t)
        return torch.cat(parts)

    has_ref = all(b.ref_logprobs is not None for b in batches)
    first: TrainBatch = batches[0]
    return msgspec.structs.replace(
        first,
        input_ids=cat("input_ids", pad_token_id),
        attention_mask=cat("attention_mask", False),
        response_mask=cat("response_mask", False),
        old_logprobs=cat("old_logprobs", 0.0),
        ref_logprobs=cat("ref_logprobs", 0.0) if has_ref else None,
        advantages=cat("advantages", 0.0),
        rewards=torch.cat([b.rewards for b in batches]),
        version=min(b.version for b in batches),
        num_sequences=sum(b.num_sequences for b in batches),
        num_tokens=sum(b.num_tokens for b in batches),
    )
