"""Dynamic sampling: uniform-group filter and the round accounting of DynamicSampler."""

from __future__ import annotations

import pytest
import torch

from rlinf_pipe.algorithms import DynamicSampler, adaptive_oversample, drop_uniform_groups


def test_drop_uniform_groups() -> None:
    # groups: 7 -> [1, 0, 1] mixed; 3 -> [0, 0] uniform; 5 -> [1] single; 9 -> [0.5, 0.5] uniform
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([7, 7, 3, 7, 3, 5, 9, 9])
    keep = drop_uniform_groups(rewards, groups)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, True, False, True, False, False, False, False]


def test_sampler_fills_in_extra_rounds() -> None:
    s = DynamicSampler(target_groups=3, max_extra_rounds=2)
    assert s.start_round() == 3
    # round 1: one mixed group, two uniform ones
    assert [s.offer(torch.tensor(r)) for r in ([1.0, 0.0], [1.0, 1.0], [0.0, 0.0])] == [True, False, False]
    assert not s.done and s.needed == 2
    assert s.start_round(oversample=1.5) == 3
    assert [s.offer(torch.tensor(r)) for r in ([0.0, 1.0], [0.0, 0.0], [1.0, 0.0])] == [True, False, True]
    assert s.done and s.full
    # a group still in flight when the target was reached: counted, not kept
    assert s.offer(torch.tensor([1.0, 0.0])) is False
    assert s.metrics() == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/extra_rounds": 1.0,
        "dynamic_sampling/groups_seen": 7.0,
        "dynamic_sampling/groups_kept": 3.0,
        "dynamic_sampling/groups_surplus": 1.0,
        "dynamic_sampling/uniform_group_frac": 3 / 7,
        "dynamic_sampling/filled": 1.0,
    }
    with pytest.raises(RuntimeError, match="no round left"):
        s.start_round()


def test_sampler_gives_up_after_max_extra_rounds() -> None:
    s = DynamicSampler(target_groups=2, max_extra_rounds=1)
    rounds = 0
    while not s.done:
        for _ in range(s.start_round()):
            s.offer(torch.zeros(4))
        rounds += 1
    assert rounds == 2 and s.exhausted and not s.full
    m = s.metrics()
    assert m["dynamic_sampling/filled"] == 0 and m["dynamic_sampling/uniform_group_frac"] == 1.0
    assert m["dynamic_sampling/extra_rounds"] == 1


def test_sampler_without_extra_rounds_and_batch_offer() -> None:
    s = DynamicSampler(target_groups=2)
    assert s.start_round() == 2
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([4, 4, 2, 2, 8, 8, 1, 1])  # first appearance order: 4 (uniform), 2, 8, 1 (uniform)
    keep = s.offer_batch(rewards, groups)
    assert keep.tolist() == [False, False, True, True, True, True, False, False]
    assert s.done and (s.seen, s.uniform, s.kept, s.surplus) == (4, 2, 2, 0)


def test_sampler_surplus_in_batch_and_validation() -> None:
    s = DynamicSampler(target_groups=1)
    s.start_round()
    keep = s.offer_batch(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert keep.tolist() == [True, True, False, False] and s.surplus == 1
    with pytest.raises(ValueError):
        DynamicSampler(target_groups=0)
    with pytest.raises(ValueError):
        DynamicSampler(target_groups=1, max_extra_rounds=-1)
    with pytest.raises(ValueError):
        s.offer(torch.zeros(0))
    with pytest.raises(ValueError):
        DynamicSampler(target_groups=1).start_round(oversample=0.5)


@pytest.mark.parametrize(
    "seen, varied, expected",
    [(16, 8, 2.0), (16, 16, 1.0), (16, 2, 4.0), (16, 0, 4.0), (3, 2, 1.5)],
)
def test_adaptive_oversample_is_the_inverse_varied_share_within_bounds(seen, varied, expected):
    assert adaptive_oversample(seen, varied) == expected


def test_adaptive_oversample_rejects_impossible_counts():
    with pytest.raises(ValueError, match="varied"):
        adaptive_oversample(2, 3)
