"""`RewardWorker`: the Ray worker of the `reward:` placement component, a `RewardPool` behind two methods.

    group = WorkerGroup.launch(RewardWorker, "reward", placement.components["reward"], cluster,
                               num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
                               init_distributed=False)
    results = group.score_batch(pairs).wait()[0]
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from rlinf_pipe.algorithms.advantages import advantage_scope
from rlinf_pipe.data.structs import RolloutGroup
from rlinf_pipe.runner.stages import RewardTally, score_groups
from rlinf_pipe.scheduler.channel import StepEnd
from rlinf_pipe.scheduler.worker import Worker
from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.workers.reward.pool import RewardPool
from rlinf_pipe.workers.reward.verify import ScoreConfig, ScoreResult


class RewardWorker(Worker):
    """Scores (response, reference) pairs in a process pool with per-item timeouts; arguments mirror `reward.*`."""

    def __init__(
        self,
        num_workers: int = 1,
        timeout_s: float | None = 5.0,
        correct_score: float = 1.0,
        wrong_score: float = 0.0,
        format_score: float = 0.0,
        answer_pattern: str | None = None,
    ):
        config = ScoreConfig(correct_score, wrong_score, format_score, answer_pattern)
        self._pool = RewardPool(num_workers=num_workers, timeout_s=timeout_s, config=config)
        self.tracer = Tracer(f"reward/{self.info.rank}")

    async def score_step(
        self, step: int, inp: Any, out: Any, adv_estimator: str, adv_options: dict[str, Any]
    ) -> RewardTally:
        """Score one step's `RolloutGroup`s from channel `inp` and put `ScoredGroup`s (rewards + advantages) into
        `out` as each is scored (group-scoped estimators) or once the step is complete (batch-scoped ones)."""
        streaming = advantage_scope(adv_estimator) == "group"
        tally = RewardTally()
        held: list[tuple[RolloutGroup, list[float]]] = []
        while True:
            group = await inp.aget()
            if isinstance(group, StepEnd):
                break
            with self.tracer.span("reward", step=step, version=group.version, samples=group.num_sequences):
                pairs = [(s.text, group.prompt.answer) for s in group.samples]
                results = await asyncio.to_thread(self._pool.score_batch, pairs)
                rewards = [r.reward for r in results]
                tally.add(group, rewards, [r.correct for r in results], [r.parsed for r in results])
                if streaming:
                    (scored,) = score_groups([group], [rewards], adv_estimator, **adv_options)
                    await out.aput(scored, weight=scored.num_sequences)
                else:
                    held.append((group, rewards))
        if held:
            with self.tracer.span("advantages", step=step, groups=len(held)):
                for scored in score_groups([g for g, _ in held], [r for _, r in held], adv_estimator, **adv_options):
                    await out.aput(scored, weight=scored.num_sequences)
        out.end_step()
        return tally


    def score_batch(self, pairs: Sequence[tuple[str, str]]) -> list[ScoreResult]:
        """One `ScoreResult` per (response, reference) pair, in order."""
        return self._pool.score_batch(pairs)

    def rewards(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Just the rewards of `score_batch`."""
        return [result.reward for result in self._pool.score_batch(pairs)]

    def metrics(self) -> dict[str, float]:
        """Counters since start: items, correct, parse_failures, timeouts, errors, restarts, accuracy."""
        return self._pool.metrics()

    def close(self) -> None:
        """Stop the pool's processes (they also stop when this actor's process ends)."""
        self._pool.close()
