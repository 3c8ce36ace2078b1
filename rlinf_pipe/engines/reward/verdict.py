"""`verify_math`: one verdict under a time limit that holds in any thread.

In the main thread the limit is a timer signal (`deadline`); in any other thread (a Ray actor's, a web server's)
signals cannot interrupt, so the pair is scored in a `RewardPool` process, killed at the limit. The pool starts on
the first such call (one per time limit and answer pattern) and lives until the interpreter exits.
"""

from __future__ import annotations

import threading

from rlinf_pipe.engines.reward.deadline import can_interrupt
from rlinf_pipe.engines.reward.pool import RewardPool
from rlinf_pipe.engines.reward.verify import DEFAULT_CONFIG, ScoreConfig, score

DEFAULT_TIMEOUT_S = 10.0
_POOLS: dict[tuple[float, str | None], RewardPool] = {}
_POOLS_LOCK = threading.Lock()


def verify_math(response: str, reference: str, *, answer_pattern: str | None = None,
                timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """Whether the final answer of `response` (last `\\boxed{}`, else `answer_pattern`) equals `reference`; an
    answer that takes longer than `timeout_s` to verify is wrong. `timeout_s=None` removes the limit (a
    pathological answer can then take forever)."""
    config = DEFAULT_CONFIG if answer_pattern is None else ScoreConfig(answer_pattern=answer_pattern)
    if timeout_s is None or timeout_s <= 0 or can_interrupt():
        return score(response, reference, config, timeout_s=timeout_s).correct
    return _pool(timeout_s, config).score_batch([(response, reference)])[0].correct


def _pool(timeout_s: float, config: ScoreConfig) -> RewardPool:
    key = (timeout_s, config.answer_pattern)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = RewardPool(num_workers=1, timeout_s=timeout_s, config=config)
        return _POOLS[key]
