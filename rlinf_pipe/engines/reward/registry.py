"""Which reward a run scores with: a built-in one by name (`reward.reward_type`, registry `REWARD_TYPES`) or a
function from a file (`reward.function`), and the reward pool of a `reward` config section."""

from __future__ import annotations

from collections.abc import Callable

from rlinf_pipe.config.function_ref import parse_function_ref
from rlinf_pipe.config.schema import RewardConfig
from rlinf_pipe.engines.reward.function import FunctionScorer, check_reward_function
from rlinf_pipe.engines.reward.pool import RewardPool
from rlinf_pipe.engines.reward.verify import MathScorer, ScoreConfig, Scorer
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.utils.text import closest


def math_reward(reward: RewardConfig) -> Scorer:
    """The verifiable math reward with the section's reward values and answer extraction."""
    return MathScorer(ScoreConfig(reward.correct_score, reward.wrong_score, reward.format_score,
                                  reward.answer_pattern, reward.thinking))


REWARD_TYPES: dict[str, Callable[[RewardConfig], Scorer]] = {"math": math_reward}


def reward_scorer(reward: RewardConfig) -> Scorer:
    """The scorer of a `reward` section: its `function`, else its built-in `reward_type`."""
    if reward.function is not None:
        return FunctionScorer(parse_function_ref(reward.function))
    check_reward_type(reward.reward_type)
    return REWARD_TYPES[reward.reward_type](reward)


def check_reward_type(name: str) -> None:
    """A ConfigError for a `reward.reward_type` that is not registered."""
    if name not in REWARD_TYPES:
        raise ConfigError(f"reward.reward_type: no built-in reward named {name!r}; {closest(name, REWARD_TYPES)}. "
                          "For your own reward, set reward.function: PATH.py:NAME")


def check_reward(reward: RewardConfig) -> None:
    """The checks before launch: a registered `reward_type`, or a `function` whose file imports and whose NAME can
    take verl's arguments (the file is imported in this process)."""
    if reward.function is not None:
        check_reward_function(reward.function)
    else:
        check_reward_type(reward.reward_type)


def reward_pool(reward: RewardConfig) -> RewardPool:
    """The pool of a `reward` section: its scorer, process count and time limit. With a function, a timed-out or
    failed item scores 0, and one that fails stops the pool's caller when `reward.fail_on_error` is set."""
    scorer = reward_scorer(reward)
    config = scorer.config if isinstance(scorer, MathScorer) else ScoreConfig()
    return RewardPool(num_workers=reward.num_workers, timeout_s=reward.timeout_s, config=config, scorer=scorer,
                      fail_on_error=reward.fail_on_error)
