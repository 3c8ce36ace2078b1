"""RL algorithm pieces as pure functions on tensors: advantages, policy losses, dynamic-sampling filters.

See docs/algorithms.md for the formulas, the config keys they map to and how to register an estimator.

The names below load their modules on first use: the estimators, losses and filters import torch, which the
checks a run passes before Ray starts (the estimator's name and scope: `advantages`) do not need."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlinf_pipe.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from rlinf_pipe.algorithms.advantages import (
        AdvantageFn,
        advantage_scope,
        compute_advantages,
        get_advantage,
        register_advantage,
        registered_advantages,
    )
    from rlinf_pipe.algorithms.estimators import batch_whiten
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

_EXPORTS = {
    "AdvantageFn": "advantages", "DynamicSampler": "filters", "GroupStats": "groups", "KLEstimator": "losses",
    "KL_ESTIMATORS": "losses", "LOSS_AGG_MODES": "terms", "LossAgg": "terms", "LossTerms": "terms",
    "PPOTokenLoss": "losses", "Stat": "terms", "adaptive_oversample": "filters", "advantage_scope": "advantages",
    "aggregate": "terms", "all_reduce_terms": "terms", "batch_whiten": "estimators",
    "compute_advantages": "advantages", "drop_uniform_groups": "filters", "finalize": "terms",
    "finalize_metrics": "terms", "get_advantage": "advantages", "group_stats": "groups", "kl_penalty": "losses",
    "merge": "terms", "policy_loss": "losses", "ppo_clip_loss": "losses", "register_advantage": "advantages",
    "registered_advantages": "advantages", "reward_metrics": "groups", "token_advantages": "losses",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
