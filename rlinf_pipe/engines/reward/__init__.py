"""Rewards (no Ray): answer extraction, math-verify scoring, reward functions from a file, a process pool with
timeouts.

The names below load their modules on first use: math-verify and sympy (about a second of CPU) are imported only
by what scores with them, not by a process that needs answer extraction alone (the driver)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinf_pipe.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from rlinf_pipe.engines.reward.context import RewardContext, reward_context
    from rlinf_pipe.engines.reward.counters import RewardCounters
    from rlinf_pipe.engines.reward.extract import extract_answer
    from rlinf_pipe.engines.reward.function import FunctionScorer, RewardFunctionError, check_reward_function
    from rlinf_pipe.engines.reward.pool import RewardPool, RewardPoolError
    from rlinf_pipe.engines.reward.registry import REWARD_TYPES, check_reward, reward_pool
    from rlinf_pipe.engines.reward.verdict import verify_math
    from rlinf_pipe.engines.reward.verify import MathScorer, RewardFailure, ScoreConfig, ScoreResult, score

_EXPORTS = {
    "FunctionScorer": "function", "MathScorer": "verify", "REWARD_TYPES": "registry", "RewardContext": "context",
    "RewardCounters": "counters", "RewardFailure": "verify", "RewardFunctionError": "function",
    "RewardPool": "pool", "RewardPoolError": "pool", "ScoreConfig": "verify", "ScoreResult": "verify",
    "check_reward": "registry", "check_reward_function": "function", "extract_answer": "extract",
    "reward_context": "context", "reward_pool": "registry", "score": "verify", "verify_math": "verdict",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
