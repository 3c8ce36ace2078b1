"""Policy loss terms: pure functions of token-level tensors `[batch, seq]`.

`ppo_clip_loss`, `kl_penalty` and the entropy bonus give per-token values; `policy_loss` combines them,
`pg + kl_coef * kl - entropy_coef * entropy`, and aggregates with `terms.aggregate` into `LossTerms` (numerator +
count) so that micro-batches sum exactly. Formulas and references: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rlinf_pipe.algorithms.terms import LossAgg, LossTerms, Stat, aggregate, check_loss_agg

KLEstimator = Literal["k1", "k2", "mse", "k3", "low_var_kl"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "mse", "k3", "low_var_kl")

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to +-MAX_LOG_RATIO before `exp`, so ratios stay finite (gradient 0 beyond)."""


class PPOTokenLoss(NamedTuple):
    """Per-token PPO loss and which branch each token took (bool tensors)."""

    loss: Tensor
    ratio: Tensor
    clipped_low: Tensor  # advantage < 0 and ratio < 1 - clip_ratio_low: no gradient
    clipped_high: Tensor  # advantage > 0 and ratio > 1 + clip_ratio_high: no gradient
    clipped_dual: Tensor  # advantage < 0 and the dual clip bound -A * c was taken: no gradient


def token_advantages(advantages: Tensor, shape: torch.Size) -> Tensor:
    """Broadcast per-sequence advantages `[batch]` (or per-token `[batch, seq]`) to `shape`."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    try:
        return advantages.expand(shape)
    except RuntimeError:
        raise ValueError(
            f"advantages must have shape [batch] or [batch, seq] matching {tuple(shape)}, "
            f"got {tuple(advantages.shape)}"
        ) from None


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> PPOTokenLoss:
    """Per-token clipped surrogate loss `max(-A r, -A clip(r, 1 - low, 1 + high))`, `r = exp(logp - old_logp)`.

    With `dual_clip_c` (> 1), tokens with negative advantage are further bounded: `min(that, -A c)`.
    """
    if not 0 <= clip_ratio_low <= 1 or clip_ratio_high < 0:
        raise ValueError(
            f"need 0 <= clip_ratio_low <= 1 and clip_ratio_high >= 0, got {clip_ratio_low} and {clip_ratio_high}"
        )
    if dual_clip_c is not None and not dual_clip_c > 1:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable it), got {dual_clip_c}")
    adv = token_advantages(advantages, logprobs.shape)
    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    clipped_low = (adv < 0) & (ratio < 1 - clip_ratio_low)
    clipped_high = (adv > 0) & (ratio > 1 + clip_ratio_high)
    clipped_dual = torch.zeros_like(clipped_low)
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c
        clipped_dual = (adv < 0) & (loss > bound)
        loss = torch.where(clipped_dual, bound, loss)
    return PPOTokenLoss(loss, ratio, clipped_low, clipped_high, clipped_dual)


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3", *, clamp: float | None = None
) -> Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of tokens sampled by the policy.

    `k1`: `logp - ref`; `k2` / `mse`: `0.5 (logp - ref)^2`; `k3` / `low_var_kl`: `exp(ref - logp) - (ref - logp) - 1`
    (log-ratio clamped to +-MAX_LOG_RATIO first). `clamp` bounds the estimate to `[-clamp, clamp]`.
    """
    _check_kl_estimator(estimator)
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        kl = log_ratio
    elif estimator in ("k2", "mse"):
        kl = 0.5 * log_ratio.square()
    else:  # k3 / low_var_kl
        neg = (-log_ratio).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = torch.exp(neg) - neg - 1
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl


def _check_kl_estimator(estimator: str) -> None:
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown kl_estimator {estimator!r} (algorithm.kl_estimator); expected one of {KL_ESTIMATORS}"
        )


def _check_shapes(mask: Tensor, **tensors: Tensor | None) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [batch, seq], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}, got {tuple(t.shape)}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    entropy: Tensor | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    dual_clip_c: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    kl_clamp: float | None = None,
    entropy_coef: float = 0.0,
    loss_agg: LossAgg = "token-mean",
) -> LossTerms:
    """PPO-clip + `kl_coef` * KL to the reference - `entropy_coef` * entropy, aggregated by `loss_agg`.

    Tensors are `[batch, seq]` (advantages `[batch]` or `[batch, seq]`); `mask` (bool or 0/1) marks response
    tokens; padding positions may hold anything, NaN included. `ref_logprobs` is needed when `kl_coef != 0`,
    `entropy` (per-token, differentiable) when `entropy_coef != 0`; when given they are also reported as metrics.
    Returns `LossTerms`: `finalize(terms)` is the loss; merged terms of micro-batches finalize to the same value.
    """
    check_loss_agg(loss_agg)
    _check_shapes(mask, logprobs=logprobs, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, entropy=entropy)
    _check_kl_estimator(kl_estimator)
    if kl_coef != 0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    if entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs per-token entropy")
    valid = mask.bool()

    def clean(t: Tensor) -> Tensor:  # padding positions -> 0, so neither values nor gradients see them
        return torch.where(valid, t, torch.zeros_like(t))

    logprobs, old_logprobs = clean(logprobs), clean(old_logprobs)
    adv = clean(token_advantages(advantages, mask.shape).to(logprobs.dtype))
    ppo = ppo_clip_loss(
        logprobs,
        old_logprobs,
        adv,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        dual_clip_c=dual_clip_c,
    )
    total = ppo.loss
    parts = {"pg": ppo.loss}
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, clean(ref_logprobs), kl_estimator, clamp=kl_clamp)
        parts["kl"] = kl
        if kl_coef != 0:
            total = total + kl_coef * kl
    if entropy is not None:
        entropy = clean(entropy)
        parts["entropy"] = entropy
        if entropy_coef != 0:
            total = total - entropy_coef * entropy

    numerator, denominator, unit = aggregate(total, valid, loss_agg)
    metrics = {"loss/total": Stat.scalar(numerator, denominator)}
    for name, values in parts.items():
        part_num, _, _ = aggregate(values.detach(), valid, loss_agg)
        metrics[f"loss/{name}"] = Stat.scalar(part_num, denominator)
    metrics.update(_token_metrics(ppo, logprobs, old_logprobs, adv, valid))
    return LossTerms(numerator, denominator, unit, metrics)


def _token_metrics(ppo: PPOTokenLoss, logprobs: Tensor, old: Tensor, adv: Tensor, valid: Tensor) -> dict[str, Stat]:
    """Clip fractions, approx KL(old || new), ratio / advantage / response-length stats; all exact to merge."""
    log_ratio = (logprobs - old).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    lengths = valid.sum(-1)
    has_tokens = lengths > 0
    return {
        "pg/clipfrac_low": Stat.of(ppo.clipped_low.double(), valid, "mean"),
        "pg/clipfrac_high": Stat.of(ppo.clipped_high.double(), valid, "mean"),
        "pg/clipfrac_dual": Stat.of(ppo.clipped_dual.double(), valid, "mean"),
        "pg/approx_kl": Stat.of(torch.expm1(log_ratio) - log_ratio, valid, "mean"),
        "ratio/mean": Stat.of(ppo.ratio, valid, "mean"),
        "ratio/min": Stat.of(ppo.ratio, valid, "min"),
        "ratio/max": Stat.of(ppo.ratio, valid, "max"),
        "advantages/mean": Stat.of(adv, valid, "mean"),
        "advantages/min": Stat.of(adv, valid, "min"),
        "advantages/max": Stat.of(adv, valid, "max"),
        "response_length/mean": Stat.of(lengths, has_tokens, "mean"),
        "response_length/min": Stat.of(lengths, has_tokens, "min"),
        "response_length/max": Stat.of(lengths, has_tokens, "max"),
        "num_tokens": Stat.of(valid.double(), valid, "sum"),
        "num_sequences": Stat.of(has_tokens.double(), has_tokens, "sum"),
    }
