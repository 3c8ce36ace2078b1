"""`RewardWorker`: the Ray worker of the `reward:` placement component, a `RewardPool` behind two methods.

    group = WorkerGroup.launch(RewardWorker, "reward", placement.components["reward"], cluster,
                               num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
                               init_distributed=False)
    results = group.score_batch(pairs).wait()[0]
"""

from __future__ import annotations

from collections.abc import Sequence

from rlinf_pipe.scheduler.worker import Worker
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
