"""Verifiable math rewards: answer extraction, math-verify scoring, a process pool with timeouts, a Ray worker.

`RewardWorker` (which imports Ray) is loaded on first access, so `from rlinf_pipe.workers.reward import verify_math`
stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlinf_pipe.workers.reward.extract import extract_answer
from rlinf_pipe.workers.reward.pool import RewardCounters, RewardPool, RewardPoolError
from rlinf_pipe.workers.reward.verify import ScoreConfig, ScoreResult, score, verify_math

if TYPE_CHECKING:
    from rlinf_pipe.workers.reward.worker import RewardWorker

__all__ = [
    "RewardCounters",
    "RewardPool",
    "RewardPoolError",
    "RewardWorker",
    "ScoreConfig",
    "ScoreResult",
    "extract_answer",
    "score",
    "verify_math",
]


def __getattr__(name: str) -> Any:
    if name == "RewardWorker":
        from rlinf_pipe.workers.reward.worker import RewardWorker

        return RewardWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
