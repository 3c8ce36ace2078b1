"""Verifiable math rewards (no Ray): answer extraction, math-verify scoring, a process pool with timeouts."""

from __future__ import annotations

from rlinf_pipe.engines.reward.extract import extract_answer
from rlinf_pipe.engines.reward.pool import RewardCounters, RewardPool, RewardPoolError
from rlinf_pipe.engines.reward.verdict import verify_math
from rlinf_pipe.engines.reward.verify import ScoreConfig, ScoreResult, score

__all__ = [
    "RewardCounters",
    "RewardPool",
    "RewardPoolError",
    "ScoreConfig",
    "ScoreResult",
    "extract_answer",
    "score",
    "verify_math",
]

