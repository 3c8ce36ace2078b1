"""Which log-prob passes a run's algorithm needs, besides the training forward: old log-probs recomputed with the
weights that sampled the step, reference log-probs, or none (then a run has no log-prob stage at all: the scored
groups go straight to the actor, docs/pipeline.md#4-log-probs--train)."""

from __future__ import annotations

from rlinf_pipe.config.schema import Config


def recomputes_old(cfg: Config) -> bool:
    """Whether the log-prob stage recomputes the old log-probs with the weights that sampled the step: only when
    they are neither the sampling engine's (`runner.max_staleness` >= 1 takes those, the behaviour policy) nor the
    trained policy's own (`old_is_current`)."""
    return cfg.runner.max_staleness == 0 and cfg.algorithm.n_minibatches > 1


def old_is_current(cfg: Config) -> bool:
    """One optimizer step per step on samples of the weights being trained (`algorithm.n_minibatches: 1`,
    `runner.max_staleness: 0`): the old policy is the policy at its update, so the loss takes the training
    forward's own log-probs, detached, as the old ones (the PPO ratio is exactly 1) and no pass computes them."""
    return cfg.runner.max_staleness == 0 and cfg.algorithm.n_minibatches == 1


def needs_ref(cfg: Config) -> bool:
    """Whether the step needs reference log-probs (a KL term, or the `kl` metric)."""
    return cfg.algorithm.kl_coef > 0 or cfg.algorithm.compute_ref_logprobs


def computes_logprobs(cfg: Config) -> bool:
    """Whether a log-prob stage has anything to compute (old or reference log-probs)."""
    return recomputes_old(cfg) or needs_ref(cfg)


def why_no_logprobs(cfg: Config) -> str:
    """Why the algorithm needs no log-prob pass (for messages; call when `computes_logprobs` is False)."""
    old = ("one optimizer step per step on the samples of the weights being trained: the old log-probs are the "
           "training forward's own" if old_is_current(cfg) else
           "the old log-probs are the sampling engine's (rollout runs ahead, runner.max_staleness >= 1)")
    return f"{old}, and no reference log-probs are needed (algorithm.kl_coef 0, algorithm.compute_ref_logprobs false)"
