"""Advantage estimators, selected by name (`algorithm.adv_estimator`) through an extensible registry.

An estimator maps per-sample `rewards` `[num_samples]` and `group_ids` `[num_samples]` (samples of one prompt share
an id) plus keyword options to per-sample advantages `[num_samples]`; the caller broadcasts them over the response
tokens. Every estimator is defined for any groups: no NaN, and 0 where a baseline leaves nothing to learn (a group
whose rewards are all equal, a group of one). Formulas and references: docs/algorithms.md.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Literal, TypeVar

import torch
from torch import Tensor

from rlinf_pipe.algorithms.groups import GroupStats, check_rewards, group_stats

AdvantageFn = Callable[..., Tensor]
"""`fn(rewards, group_ids, **options) -> advantages`, all 1-D tensors of one length."""

F = TypeVar("F", bound=AdvantageFn)
Scope = Literal["group", "batch"]

_REGISTRY: dict[str, AdvantageFn] = {}
_SCOPES: dict[str, Scope] = {}


def register_advantage(name: str, *, scope: Scope = "group", override: bool = False) -> Callable[[F], F]:
    """Decorator: make `fn(rewards, group_ids, **options)` available as `algorithm.adv_estimator=name`.

    `scope="group"` promises that a sample's advantage depends only on its own group, so a streaming runner may
    call the estimator on each group as it completes; `"batch"` estimators need the whole step's rewards at once.
    Registering a taken name raises ValueError unless `override=True`.
    """
    if scope not in ("group", "batch"):
        raise ValueError(f"scope must be 'group' or 'batch', got {scope!r}")

    def decorator(fn: F) -> F:
        if name in _REGISTRY and not override:
            raise ValueError(f"advantage estimator {name!r} is already registered (pass override=True to replace it)")
        _REGISTRY[name], _SCOPES[name] = fn, scope
        return fn

    return decorator


def advantage_scope(name: str) -> Scope:
    """`group` if the estimator can run group by group as groups stream in, `batch` if it needs the whole step."""
    get_advantage(name)
    return _SCOPES[name]


def registered_advantages() -> list[str]:
    """Names of the registered estimators, sorted."""
    return sorted(_REGISTRY)


def get_advantage(name: str) -> AdvantageFn:
    """The estimator registered as `name`; ValueError naming the registered ones and the closest otherwise."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    names = registered_advantages()
    closest = difflib.get_close_matches(name, names, n=1, cutoff=0.0)
    hint = f"; closest: {closest[0]!r}" if closest else ""
    raise ValueError(
        f"unknown advantage estimator {name!r} (algorithm.adv_estimator); registered: {', '.join(names)}{hint}. "
        f"Register your own with @rlinf_pipe.algorithms.register_advantage({name!r})."
    )


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor, **options: object) -> Tensor:
    """Run the estimator registered as `name`."""
    return get_advantage(name)(rewards, group_ids, **options)


def _output(adv: Tensor, rewards: Tensor, stats: GroupStats | None = None) -> Tensor:
    """Zero the samples of uniform groups (exactly, whatever the rounding) and cast to the rewards' dtype."""
    if stats is not None:
        adv = torch.where(stats.uniform[stats.index], torch.zeros_like(adv), adv)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    return adv.to(dtype)


def _check_eps(eps: float) -> None:
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def batch_whiten(values: Tensor, eps: float = 1e-6, *, subtract_mean: bool = True) -> Tensor:
    """`(values - mean) / (std + eps)` over the whole tensor, std unbiased; zeros for fewer than two values or
    all-equal values. Computed in float64."""
    _check_eps(eps)
    x = values.to(torch.float64)
    if x.numel() < 2 or bool((x == x[0]).all()):
        return torch.zeros_like(x)
    centred = x - x.mean() if subtract_mean else x
    return centred / (x.std(unbiased=True) + eps)


@register_advantage("grpo")
def grpo(rewards: Tensor, group_ids: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: `(r - group_mean) / (group_std + eps)`, std unbiased. `norm_by_std=False` is Dr. GRPO."""
    _check_eps(eps)
    s = group_stats(rewards, group_ids)
    adv = rewards.to(torch.float64) - s.mean[s.index]
    if norm_by_std:
        adv = adv / (s.std[s.index] + eps)
    return _output(adv, rewards, s)


@register_advantage("dr_grpo")
def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO: `r - group_mean` (GRPO without the division by the group std)."""
    return grpo(rewards, group_ids, norm_by_std=False)


@register_advantage("rloo")
def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: `r_i - mean of the other samples of the group`; 0 for a group of one."""
    s = group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    n = s.count[s.index]
    others_mean = (s.mean[s.index] * n - r) / (n - 1).clamp(min=1)
    return _output(r - others_mean, rewards, s)


@register_advantage("reinforce_plus_plus", scope="batch")
def reinforce_plus_plus(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: rewards whitened over the whole batch, `(r - batch_mean) / (batch_std + eps)`, std unbiased.
    `group_ids` are only validated: the baseline is the batch, not the group."""
    check_rewards(rewards, group_ids)
    return _output(batch_whiten(rewards, eps), rewards)


@register_advantage("reinforce_plus_plus_baseline", scope="batch")
def reinforce_plus_plus_baseline(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, then divide by the batch std of the centred rewards (+ eps).

    The batch mean of group-centred rewards is zero by construction, so it is not subtracted again: uniform
    groups stay exactly 0.
    """
    s = group_stats(rewards, group_ids)
    centred = torch.where(s.uniform[s.index], 0.0, rewards.to(torch.float64) - s.mean[s.index])
    return _output(batch_whiten(centred, eps, subtract_mean=False), rewards, s)
