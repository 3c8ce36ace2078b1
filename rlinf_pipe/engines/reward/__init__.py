"""Verifiable math rewards (no Ray): answer extraction, math-verify scoring, a process pool with timeouts.

The names below load their modules on first use: math-verify and sympy (about a second of CPU) are imported only
by what scores with them, not by a process that needs answer extraction alone (the driver)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinf_pipe.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from rlinf_pipe.engines.reward.extract import extract_answer
    from rlinf_pipe.engines.reward.pool import RewardCounters, RewardPool, RewardPoolError
    from rlinf_pipe.engines.reward.verdict import verify_math
    from rlinf_pipe.engines.reward.verify import ScoreConfig, ScoreResult, score

_EXPORTS = {
    "RewardCounters": "pool", "RewardPool": "pool", "RewardPoolError": "pool", "ScoreConfig": "verify",
    "ScoreResult": "verify", "extract_answer": "extract", "score": "verify", "verify_math": "verdict",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
