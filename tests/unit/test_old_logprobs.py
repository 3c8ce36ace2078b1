"""Where the loss's old log-probs come from (`rlinf_pipe.algorithms.logprob_needs.recomputes_old` / `old_is_current`):
recomputed by the log-prob stage with the sampling weights (several optimizer steps per step), the sampling
engine's (rollout ahead: the behaviour policy), or, with one optimizer step per step on the weights being
trained, the training forward's own, detached, so the PPO ratio is exactly 1 and no pass computes them."""

from __future__ import annotations

import pytest
import torch

from rlinf_pipe.algorithms.losses import policy_loss
from rlinf_pipe.config import load_config
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.workers.actor import make_loss_fn
from rlinf_pipe.algorithms.logprob_needs import old_is_current, recomputes_old


@pytest.mark.parametrize("staleness,minibatches,recompute,current", [
    (0, 1, False, True), (0, 2, True, False), (1, 1, False, False), (2, 4, False, False)])
def test_the_source_of_the_old_log_probs(staleness, minibatches, recompute, current):
    cfg = load_config(overrides=[f"runner.max_staleness={staleness}", f"algorithm.n_minibatches={minibatches}"])
    assert (recomputes_old(cfg), old_is_current(cfg)) == (recompute, current)


def test_one_update_per_step_trains_against_its_own_detached_log_probs():
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[:, 2:] = True
    batch = TrainBatch(input_ids=torch.zeros(3, 6, dtype=torch.long), attention_mask=torch.ones(3, 6, dtype=torch.bool),
                       response_mask=mask, old_logprobs=torch.full((3, 6), -50.0),  # the engine's: ignored
                       advantages=torch.randn(3, 6, generator=g) * mask, rewards=torch.zeros(3), version=0,
                       num_sequences=3, num_tokens=int(mask.sum()))
    logprobs = (-torch.rand(3, 6, generator=g)).requires_grad_()
    cfg = load_config(overrides=["algorithm.n_minibatches=1"])
    got = make_loss_fn(cfg)(logprobs, None, batch)
    want = policy_loss(logprobs, logprobs.detach(), None, batch.advantages, mask, loss_agg=cfg.algorithm.loss_agg)
    assert torch.equal(got.numerator, want.numerator)
    (grad,) = torch.autograd.grad(got.numerator, logprobs)
    torch.testing.assert_close(grad, -(batch.advantages * mask))  # ratio 1: the plain policy gradient
    several = make_loss_fn(load_config(overrides=["algorithm.n_minibatches=2"]))(logprobs, None, batch)
    assert not torch.equal(several.numerator, got.numerator)  # there the batch's old log-probs count
