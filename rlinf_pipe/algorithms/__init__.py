"""RL algorithm pieces as pure functions on tensors: advantages, policy losses, dynamic-sampling filters.

See docs/algorithms.md for the formulas, the config keys they map to and how to register an estimator.
"""

from rlinf_pipe.algorithms.advantages import (
    AdvantageFn,
    advantage_scope,
    batch_whiten,
    compute_advantages,
    get_advantage,
    register_advantage,
    registered_advantages,
)
from rlinf_pipe.algorithms.filters import DynamicSampler, adaptive_oversample, drop_uniform_groups
from rlinf_pipe.algorithms.groups import GroupStats, group_stats, reward_metrics
from rlinf_pipe.algorithms.losses import (
    KL_ESTIMATORS,
    KLEstimator,
    PPOTokenLoss,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
    token_advantages,
)
from rlinf_pipe.algorithms.terms import (
    LOSS_AGG_MODES,
    LossAgg,
    LossTerms,
    Stat,
    aggregate,
    all_reduce_terms,
    finalize,
    finalize_metrics,
    merge,
)

__all__ = [
    "AdvantageFn",
    "DynamicSampler",
    "GroupStats",
    "KLEstimator",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LossAgg",
    "LossTerms",
    "PPOTokenLoss",
    "Stat",
    "adaptive_oversample",
    "advantage_scope",
    "aggregate",
    "all_reduce_terms",
    "batch_whiten",
    "compute_advantages",
    "drop_uniform_groups",
    "finalize",
    "finalize_metrics",
    "get_advantage",
    "group_stats",
    "reward_metrics",
    "kl_penalty",
    "merge",
    "policy_loss",
    "ppo_clip_loss",
    "register_advantage",
    "registered_advantages",
    "token_advantages",
]
