"""Costs: the curve, the one scaling rule, the documented default, RLinf's three numbers."""

from __future__ import annotations

import pytest

from rlinf_pipe.config import load_config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.costs import GPUS, TRAIN_MFU, Curve, Parallel, default_costs, default_lengths, scale_rate
from rlinf_pipe.planning.rlinf_costs import parse_costs, rlinf_costs


def test_a_curve_is_linear_between_its_points_and_flat_beyond():
    c = Curve(((1.0, 10.0), (3.0, 30.0), (5.0, 20.0)))
    assert [c.at(x) for x in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0)] == [10.0, 10.0, 20.0, 30.0, 25.0, 20.0, 20.0]
    assert c.scaled(2).at(2.0) == 40.0 and c.peak == 30.0


def test_a_rate_scales_with_gpus_and_loses_a_share_per_doubling():
    assert scale_rate(100.0, Parallel(), Parallel()) == 100.0
    assert scale_rate(100.0, Parallel(), Parallel(tp=2)) == pytest.approx(180.0)  # 2 GPUs x 0.9
    assert scale_rate(100.0, Parallel(), Parallel(tp=2, pp=2)) == pytest.approx(400 * 0.9 * 0.85)
    assert scale_rate(180.0, Parallel(tp=2), Parallel()) == pytest.approx(100.0)  # and back


def test_the_default_follows_its_stated_formulas():
    cfg = load_config(overrides=["rollout.max_new_tokens=1000"])
    c = default_costs(cfg, "H100", params=1e9)
    assert c.train_tokens_per_s == pytest.approx(GPUS["H100"].flops * TRAIN_MFU / 6e9)
    assert c.weight_sync_s["broadcast"] == pytest.approx(2e9 / GPUS["H100"].link_bw)
    assert c.source.startswith("default: derived from the model's size") and "(H100)" in c.source
    # bandwidth-bound at one request, compute-bound later: more requests never lower the engine's total rate
    ys = [y for _, y in c.decode.points]
    assert ys == sorted(ys) and ys[-1] > 10 * ys[0]
    lengths = default_lengths(1000)
    assert max(lengths) == 1000 and 0.35 < sum(lengths) / len(lengths) / 1000 < 0.45
    with pytest.raises(ConfigError, match="--gpu 'TPU'"):
        default_costs(cfg, "TPU")


def test_rlinf_numbers_become_rates_that_reproduce_them():
    cfg = load_config(overrides=["data.rollout_batch_size=8", "algorithm.group_size=4"])
    c = rlinf_costs(10.0, 20.0, 2.0, 4, cfg, "cpu")
    tokens = 32 * c.mean_response + 8 * c.prompt_tokens  # (a pass's: each group's prompt once, share_prompts)
    assert c.train_tokens_per_s == pytest.approx(tokens / (4 * 10.0))  # 4 one-GPU replicas take 10 s
    assert c.logprob_tokens_per_s == pytest.approx(tokens / (4 * 2.0))
    both = load_config(overrides=["data.rollout_batch_size=8", "algorithm.group_size=4", "algorithm.n_minibatches=2",
                                  "algorithm.compute_ref_logprobs=true"])  # (old and reference: two passes in 2 s)
    assert rlinf_costs(10.0, 20.0, 2.0, 4, both, "cpu").logprob_tokens_per_s == pytest.approx(2 * tokens / (4 * 2.0))
    assert c.optimizer_step_s == 0.0 and c.source.startswith("RLinf-style --costs")
    assert parse_costs("101,224,10") == (101.0, 224.0, 10.0)
    with pytest.raises(ConfigError, match="ACTOR_S,ROLLOUT_S,INFERENCE_S"):
        parse_costs("101,224")
