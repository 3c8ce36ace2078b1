"""Dynamic sampling's shared bookkeeping: one small Ray actor per job, `SamplingRounds`.

The reward workers offer every group they score; a group whose rewards are not all equal is kept while the step
still needs groups, and gets the next free slot (so it trains like a group of an ordinary step, see
`rlinf_pipe.data.routing`). The driver starts the rounds and reads the counts. Groups themselves never reach the
driver: only these counts do.
"""

from __future__ import annotations

import ray
import torch

from rlinf_pipe.algorithms.filters import DynamicSampler, adaptive_oversample


@ray.remote(num_cpus=0)
class SamplingRounds:
    """A `DynamicSampler` shared by the reward workers and the driver, reset at each step."""

    def __init__(self) -> None:
        self.sampler = DynamicSampler(target_groups=1)

    def reset(self, target_groups: int, max_extra_rounds: int) -> None:
        self.sampler = DynamicSampler(target_groups, max_extra_rounds)

    def start_round(self) -> int:
        """Begin a round; returns the prompts to draw: the missing groups times the inverse share of groups whose
        rewards varied so far (`adaptive_oversample`, 1x for the first round)."""
        s = self.sampler
        oversample = adaptive_oversample(s.seen, s.seen - s.uniform) if s.rounds else 1.0
        return s.start_round(oversample)

    def offer(self, rewards: list[float]) -> int | None:
        """One group's rewards: its slot if it is kept, None if it is dropped."""
        return self.sampler.kept - 1 if self.sampler.offer(torch.tensor(rewards)) else None

    def done(self) -> bool:
        return self.sampler.done

    def metrics(self) -> dict[str, float]:
        return self.sampler.metrics()
