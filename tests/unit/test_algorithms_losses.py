"""Policy loss terms: hand-computed values, masks, dual clip, KL estimators, and exact micro-batch normalisation."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlinf_pipe.algorithms import (
    LOSS_AGG_MODES,
    LossTerms,
    Stat,
    aggregate,
    all_reduce_terms,
    finalize,
    finalize_metrics,
    kl_penalty,
    merge,
    policy_loss,
    ppo_clip_loss,
)

LN2 = math.log(2)

# Hand example, old_logprobs = 0 so ratio = exp(logprobs). Row 0 (advantage +1) has 3 tokens, row 1 (advantage -1)
# has 2 tokens and one padding token whose ratio (7) must not count. clip 0.2 / 0.2.
#   (0,0) r=1.5, A=+1: max(-1.5, -1.2) = -1.2   clipped high
#   (0,1) r=0.5, A=+1: max(-0.5, -0.8) = -0.5
#   (0,2) r=1.0, A=+1: -1.0
#   (1,0) r=1.1, A=-1: max(1.1, 1.1)   =  1.1
#   (1,1) r=0.5, A=-1: max(0.5, 0.8)   =  0.8   clipped low
# row sums -2.7 and 1.9, row means -0.9 and 0.95, 5 tokens, 2 sequences.
RATIOS = [[1.5, 0.5, 1.0], [1.1, 0.5, 7.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -1.0])
EXPECTED = {"token-mean": -0.8 / 5, "seq-mean-token-sum": -0.8 / 2, "seq-mean-token-mean": (-0.9 + 0.95) / 2}


def hand_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.log(torch.tensor(RATIOS)).requires_grad_(), torch.zeros(2, 3)


@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_ppo_hand_values(loss_agg: str) -> None:
    logprobs, old = hand_inputs()
    terms = policy_loss(logprobs, old, None, ADV, MASK, loss_agg=loss_agg)
    assert finalize(terms).item() == pytest.approx(EXPECTED[loss_agg], abs=1e-6)
    assert terms.unit == ("tokens" if loss_agg == "token-mean" else "sequences")
    assert terms.denominator.item() == (5 if loss_agg == "token-mean" else 2)
    m = finalize_metrics(terms)
    assert m["loss/pg"] == pytest.approx(EXPECTED[loss_agg], abs=1e-6)
    assert m["pg/clipfrac_high"] == pytest.approx(0.2) and m["pg/clipfrac_low"] == pytest.approx(0.2)
    assert m["pg/clipfrac_dual"] == 0
    assert m["ratio/mean"] == pytest.approx(4.6 / 5) and m["ratio/min"] == pytest.approx(0.5)
    assert m["ratio/max"] == pytest.approx(1.5)  # the padding ratio 7 does not count
    assert (m["advantages/mean"], m["advantages/min"], m["advantages/max"]) == pytest.approx((0.2, -1, 1))
    assert (m["response_length/mean"], m["response_length/min"], m["response_length/max"]) == (2.5, 2, 3)
    assert (m["num_tokens"], m["num_sequences"]) == (5, 2)
    # approx KL(old || new) = mean of r - 1 - ln r over the 5 tokens
    approx_kl = sum(r - 1 - math.log(r) for r in [1.5, 0.5, 1.0, 1.1, 0.5]) / 5
    assert m["pg/approx_kl"] == pytest.approx(approx_kl, rel=1e-5)


def test_ppo_hand_gradients() -> None:
    logprobs, old = hand_inputs()
    finalize(policy_loss(logprobs, old, None, ADV, MASK)).backward()
    # unclipped tokens: d(-A r)/dlogp = -A r, divided by 5 tokens; clipped and padding tokens: 0
    expected = torch.tensor([[0.0, -0.5, -1.0], [1.1, 0.0, 0.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected)


def test_padding_may_hold_nan_and_inf() -> None:
    logprobs, old = hand_inputs()
    with torch.no_grad():
        logprobs[1, 2] = float("nan")
    old[1, 2] = float("-inf")
    entropy = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, float("inf")]])
    ref = torch.zeros(2, 3)
    ref[1, 2] = float("nan")
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, float("nan")]])
    loss = finalize(policy_loss(logprobs, old, ref, adv, MASK.bool(), entropy=entropy, entropy_coef=0.1, kl_coef=0.1))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[1, 2] == 0


def test_per_token_advantages_equal_broadcast() -> None:
    logprobs, old = hand_inputs()
    a = finalize(policy_loss(logprobs, old, None, ADV, MASK))
    b = finalize(policy_loss(logprobs, old, None, ADV[:, None].expand(2, 3).clone(), MASK))
    assert a.item() == b.item()


def test_dual_clip() -> None:
    # c = 3. A=-1 r=5: max(5, 1.2) = 5, bounded to 3.  A=-1 r=2: 2 < 3, untouched.  A=+1 r=5: not dual-clipped, -1.2.
    logprobs = torch.log(torch.tensor([[5.0, 2.0, 5.0]])).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    out = ppo_clip_loss(logprobs, torch.zeros(1, 3), adv, dual_clip_c=3.0)
    torch.testing.assert_close(out.loss, torch.tensor([[3.0, 2.0, -1.2]]))
    assert out.clipped_dual.tolist() == [[True, False, False]]
    assert out.clipped_high.tolist() == [[False, False, True]]
    out.loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 2.0, 0.0]]))  # only the unclipped token: -A r = 2
    without = ppo_clip_loss(logprobs, torch.zeros(1, 3), adv)
    torch.testing.assert_close(without.loss, torch.tensor([[5.0, 2.0, -1.2]]))
    m = finalize_metrics(policy_loss(logprobs, torch.zeros(1, 3), None, adv, torch.ones(1, 3), dual_clip_c=3.0))
    assert m["pg/clipfrac_dual"] == pytest.approx(1 / 3) and m["loss/pg"] == pytest.approx((3 + 2 - 1.2) / 3)


def test_asymmetric_clip() -> None:
    # clip_ratio_high 0.28: r = 1.25 with A=+1 is inside the range; r = 1.3 is clipped at 1.28
    logprobs = torch.log(torch.tensor([[1.25, 1.3, 0.85]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    out = ppo_clip_loss(logprobs, torch.zeros(1, 3), adv, clip_ratio_low=0.1, clip_ratio_high=0.28)
    torch.testing.assert_close(out.loss, torch.tensor([[-1.25, -1.28, 0.9]]))
    assert out.clipped_high.tolist() == [[False, True, False]] and out.clipped_low.tolist() == [[False, False, True]]


# KL(policy || ref) with logp - ref = ln2, 0, -ln2:
#   k1 = ln2, 0, -ln2
#   k2 = 0.5 ln2^2 = 0.2402265 (both signs), 0
#   k3 = exp(ref - logp) - (ref - logp) - 1: 0.5 + ln2 - 1 = 0.1931472;  0;  2 - ln2 - 1 = 0.3068528
KL_CASES = {
    "k1": [LN2, 0.0, -LN2],
    "k2": [0.5 * LN2**2, 0.0, 0.5 * LN2**2],
    "mse": [0.5 * LN2**2, 0.0, 0.5 * LN2**2],
    "k3": [0.5 + LN2 - 1, 0.0, 2 - LN2 - 1],
    "low_var_kl": [0.5 + LN2 - 1, 0.0, 2 - LN2 - 1],
}


@pytest.mark.parametrize("estimator", sorted(KL_CASES))
def test_kl_estimators(estimator: str) -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.3, 0.5]]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, estimator), torch.tensor([KL_CASES[estimator]]))


def test_kl_clamp_and_unknown_estimator() -> None:
    logprobs, ref = torch.log(torch.tensor([[0.25, 0.5]])), torch.log(torch.tensor([[0.5, 0.25]]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k3", clamp=0.25), torch.tensor([[0.25, 0.5 + LN2 - 1]]))
    assert torch.isfinite(kl_penalty(torch.tensor([[-500.0]]), torch.tensor([[0.0]]), "k3"))
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(logprobs, ref, "k4")  # type: ignore[arg-type]


def test_policy_loss_combines_terms() -> None:
    # ratio 1, A = 0.5: pg = -0.5 per token. logp - ref = [ln2, -ln2]: k3 mean (0.1931472 + 0.3068528) / 2 = 0.25.
    # entropy mean 2. total = -0.5 + 0.1 * 0.25 - 0.01 * 2 = -0.495
    logprobs = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    entropy = torch.tensor([[1.0, 3.0]])
    terms = policy_loss(
        logprobs, logprobs.clone(), ref, torch.tensor([0.5]), torch.ones(1, 2),
        entropy=entropy, kl_coef=0.1, entropy_coef=0.01,
    )  # fmt: skip
    assert finalize(terms).item() == pytest.approx(-0.495, abs=1e-6)
    m = finalize_metrics(terms)
    assert (m["loss/pg"], m["loss/kl"], m["loss/entropy"], m["loss/total"]) == pytest.approx((-0.5, 0.25, 2.0, -0.495))
    # a reference without kl_coef is only reported
    terms = policy_loss(logprobs, logprobs.clone(), ref, torch.tensor([0.5]), torch.ones(1, 2))
    assert finalize(terms).item() == pytest.approx(-0.5) and finalize_metrics(terms)["loss/kl"] == pytest.approx(0.25)


def test_entropy_bonus_gradient() -> None:
    entropy = torch.tensor([[1.0, 3.0, 9.0]], requires_grad=True)
    lp = torch.zeros(1, 3)
    terms = policy_loss(lp, lp, None, torch.zeros(1), torch.tensor([[1, 1, 0]]), entropy=entropy, entropy_coef=0.5)
    finalize(terms).backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.25, -0.25, 0.0]]))


def test_invalid_arguments() -> None:
    lp, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, None, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, lp, None, adv, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(lp, lp, None, adv, mask, loss_agg="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kl_estimator"):
        policy_loss(lp, lp, None, adv, mask, kl_estimator="k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss(lp, lp, None, adv, mask, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(lp, lp[:, :2], None, adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, None, torch.zeros(3), mask)


def test_empty_micro_batch_and_all_padding() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    for agg in LOSS_AGG_MODES:
        terms = policy_loss(lp, lp.detach(), None, torch.ones(2), torch.zeros(2, 3), loss_agg=agg)
        loss = finalize(terms)
        assert loss.item() == 0 and terms.denominator.item() == 0
        loss.backward()
        m = finalize_metrics(terms)
        assert "ratio/min" not in m and "pg/clipfrac_low" not in m and m["num_tokens"] == 0


def test_aggregate_ignores_all_padding_rows_in_sequence_counts() -> None:
    values = torch.tensor([[1.0, 2.0], [5.0, 5.0], [4.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    assert [x.item() for x in aggregate(values, mask, "seq-mean-token-mean")[:2]] == [1.5 + 4.0, 2]
    assert [x.item() for x in aggregate(values, mask, "seq-mean-token-sum")[:2]] == [7.0, 2]
    assert [x.item() for x in aggregate(values, mask, "token-mean")[:2]] == [7.0, 3]


# --- exact micro-batch normalisation ---------------------------------------------------------------------------


def reference_loss(lp, old, ref, adv, mask, ent, *, kl_coef, entropy_coef, dual_clip_c, loss_agg) -> torch.Tensor:
    """Whole-batch loss written directly from the formulas (k3 KL, clip 0.2 / 0.3), row by row."""
    rows = []
    for i in range(lp.shape[0]):
        valid = mask[i].bool()
        if not valid.any():
            continue
        a = adv[i] if adv.dim() == 2 else adv[i].expand(lp.shape[1])
        r = torch.exp(lp[i] - old[i])
        pg = torch.maximum(-a * r, -a * r.clamp(0.8, 1.3))
        if dual_clip_c is not None:
            pg = torch.where(a < 0, torch.minimum(pg, -a * dual_clip_c), pg)
        kl = torch.exp(ref[i] - lp[i]) - (ref[i] - lp[i]) - 1
        tok = (pg + kl_coef * kl - entropy_coef * ent[i])[valid]
        rows.append(tok)
    if not rows:
        return lp.sum() * 0
    if loss_agg == "token-mean":
        return torch.cat(rows).mean()
    if loss_agg == "seq-mean-token-sum":
        return torch.stack([t.sum() for t in rows]).mean()
    return torch.stack([t.mean() for t in rows]).mean()


@st.composite
def batches(draw: st.DrawFn) -> dict:
    batch, seq = draw(st.integers(1, 7)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    lp = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(0, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    if draw(st.booleans()):  # arbitrary holes, not only right padding
        mask = mask | (torch.rand(batch, seq, generator=g) < 0.3)
    per_token = draw(st.booleans())
    adv_shape = (batch, seq) if per_token else (batch,)
    cuts = sorted(draw(st.sets(st.integers(1, batch - 1), max_size=batch - 1))) if batch > 1 else []
    return {
        "lp": lp,
        "old": lp + torch.randn(batch, seq, generator=g, dtype=torch.float64) * 0.4,
        "ref": lp + torch.randn(batch, seq, generator=g, dtype=torch.float64) * 0.4,
        "adv": torch.randn(adv_shape, generator=g, dtype=torch.float64),
        "ent": torch.rand(batch, seq, generator=g, dtype=torch.float64) * 2,
        "mask": mask,
        "cuts": [0, *cuts, batch],
        "opts": {
            "kl_coef": draw(st.sampled_from([0.0, 0.05])),
            "entropy_coef": draw(st.sampled_from([0.0, 0.01])),
            "dual_clip_c": draw(st.sampled_from([None, 3.0])),
            "loss_agg": draw(st.sampled_from(LOSS_AGG_MODES)),
        },
    }


def run(b: dict, rows: slice, lp: torch.Tensor) -> LossTerms:
    return policy_loss(
        lp[rows], b["old"][rows], b["ref"][rows], b["adv"][rows], b["mask"][rows],
        entropy=b["ent"][rows], clip_ratio_low=0.2, clip_ratio_high=0.3, kl_estimator="k3", **b["opts"],
    )  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(batches())
def test_micro_batches_sum_to_the_whole_batch_loss(b: dict) -> None:
    whole_lp = b["lp"].clone().requires_grad_()
    whole = run(b, slice(None), whole_lp)
    whole_loss = finalize(whole)
    whole_loss.backward()

    # 1. finalize over merged micro-batch terms: same loss and same gradient
    micro_lp = b["lp"].clone().requires_grad_()
    parts = [run(b, slice(lo, hi), micro_lp) for lo, hi in pairwise(b["cuts"])]
    merged_loss = finalize(merge(parts))
    merged_loss.backward()
    assert abs(merged_loss.item() - whole_loss.item()) <= 1e-6
    torch.testing.assert_close(micro_lp.grad, whole_lp.grad, atol=1e-6, rtol=0)

    # 2. the streaming trainer: backward each numerator as it comes, divide the summed gradient once by the total count
    stream_lp = b["lp"].clone().requires_grad_()
    total_count = torch.zeros((), dtype=torch.float64)
    for lo, hi in pairwise(b["cuts"]):
        terms = run(b, slice(lo, hi), stream_lp)
        terms.numerator.backward()
        total_count += terms.denominator
    grad = stream_lp.grad / total_count.clamp(min=1)
    torch.testing.assert_close(grad, whole_lp.grad, atol=1e-6, rtol=0)

    # 3. both agree with the formulas written out directly
    expected = reference_loss(b["lp"], b["old"], b["ref"], b["adv"], b["mask"], b["ent"], **b["opts"])
    assert abs(whole_loss.item() - expected.item()) <= 1e-6

    # 4. metrics merge exactly too
    mw, mm = finalize_metrics(whole), finalize_metrics(merge(parts))
    assert mw.keys() == mm.keys()
    for key in mw:
        assert mm[key] == pytest.approx(mw[key], abs=1e-9), key


def test_stat_merge_and_result() -> None:
    values, valid = torch.tensor([1.0, 5.0, -2.0]), torch.tensor([True, True, False])
    a = Stat.of(values, valid, "mean")
    assert a.result() == 3.0 and Stat.of(values, valid, "min").result() == 1.0
    nine = Stat.of(torch.tensor([9.0]), torch.tensor([True]), "max")
    assert Stat.of(values, valid, "max").merge(nine).result() == 9.0
    assert Stat.of(values, torch.zeros(3, dtype=torch.bool), "mean").result() is None
    with pytest.raises(ValueError, match="merge"):
        a.merge(Stat.of(values, valid, "max"))
    with pytest.raises(ValueError, match="tokens"):
        args = (torch.zeros(1, 1), torch.zeros(1, 1), None, torch.zeros(1), torch.ones(1, 1))
        merge([policy_loss(*args), policy_loss(*args, loss_agg="seq-mean-token-sum")])


def test_all_reduce_terms_single_rank() -> None:
    import torch.distributed as dist

    logprobs, old = hand_inputs()
    terms = policy_loss(logprobs, old, None, ADV, MASK)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reduced = all_reduce_terms(terms)
    finally:
        dist.destroy_process_group()
    assert not reduced.numerator.requires_grad
    assert finalize(reduced).item() == pytest.approx(EXPECTED["token-mean"])
    assert finalize_metrics(reduced) == pytest.approx(finalize_metrics(terms))



def test_all_reduce_terms_two_simulated_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's collectives are recorded, then replayed into rank 0's: the reduced terms equal the whole batch's."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(5, 4, generator=g, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(5, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(5, generator=g, dtype=torch.float64)
    mask = torch.arange(4)[None, :] < torch.tensor([4, 1, 0, 3, 2])[:, None]

    def terms(rows: slice) -> LossTerms:
        return policy_loss(lp[rows], old[rows], lp[rows], adv[rows], mask[rows], loss_agg="seq-mean-token-mean")

    recorded: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op, group=None: recorded.append(t.clone()))
    all_reduce_terms(terms(slice(2, 5)))
    ops = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.MAX: torch.maximum}
    replay = iter(recorded)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op, group=None: t.copy_(ops[op](t, next(replay))))
    reduced = all_reduce_terms(terms(slice(0, 2)))

    whole = terms(slice(None))
    assert finalize(reduced).item() == pytest.approx(finalize(whole).item(), abs=1e-12)
    assert finalize_metrics(reduced) == pytest.approx(finalize_metrics(whole), abs=1e-12)
