"""Actor replicas by tokens (`algorithm.replica_routing: tokens`): the pure balance and its per-step actor state."""

from __future__ import annotations

import random

import pytest

from rlinf_pipe.data.routing import TokenBalance, TrainRouting
from rlinf_pipe.utils.metrics import max_over_mean
from rlinf_pipe.workers.replica_balance import KEPT_STEPS, ReplicaBalance


def test_each_group_goes_to_the_least_loaded_replica_with_room():
    routing = TrainRouting(groups=8, n_minibatches=2, dp=2)  # 2 groups per replica per mini-batch
    balance = TokenBalance(routing)
    assert [balance.assign(slot, tokens) for slot, tokens in [(0, 100), (1, 10), (2, 10)]] == [0, 1, 1]
    assert balance.assign(3, 1) == 0  # replica 1 is full: the last one goes to replica 0 whatever its load
    assert balance.tokens[0] == [101, 20] and balance.groups[0] == [2, 2]
    assert balance.assign(4, 5) == 0  # mini-batch 1 starts even: the lowest index on a tie
    with pytest.raises(ValueError, match="mini-batch 0 already has its 4 groups"):
        balance.assign(0, 1)


def test_uneven_counts_follow_the_slot_routing():
    routing = TrainRouting(groups=6, n_minibatches=1, dp=4)  # replicas 0, 1 train 2 groups; 2, 3 train 1
    balance = TokenBalance(routing)
    picks = [balance.assign(slot, 1) for slot in range(6)]
    assert sorted(picks) == sorted(routing.replica_of(s) for s in range(6)) == [0, 0, 1, 1, 2, 3]


def test_long_groups_spread_over_the_replicas():
    """Groups arriving shortest-first (as they finish generating), lengths varying by prompt (a seeded draw shaped
    like the qwen2.5 example's mini-batches: 32 groups over 8 replicas): the busiest replica holds markedly fewer
    tokens than by slot, every replica the same number of groups."""
    rng = random.Random(0)
    routing = TrainRouting(groups=32, n_minibatches=1, dp=8)
    by_slot, by_tokens = [], []
    for _ in range(200):
        tokens = [int(16 * rng.choice([rng.uniform(300, 1500), rng.uniform(1500, 5000), rng.uniform(4000, 8192)]))
                  for _ in range(32)]
        slot_load = [0] * 8
        for slot, t in enumerate(tokens):
            slot_load[routing.replica_of(slot)] += t
        balance = TokenBalance(routing)
        for slot in sorted(range(32), key=lambda s: tokens[s]):
            balance.assign(slot, tokens[slot])
        by_slot.append(max_over_mean(slot_load))
        by_tokens.append(max_over_mean(balance.tokens[0]))
        assert sum(balance.tokens[0]) == sum(tokens) and balance.groups[0] == [4] * 8
    assert sum(by_tokens) / len(by_tokens) < 0.9 * sum(by_slot) / len(by_slot)


def test_steps_are_routed_apart_and_begun_afresh():
    routing = TrainRouting(groups=2, n_minibatches=1, dp=2)
    actor = ReplicaBalance(routing)
    with pytest.raises(ValueError, match="step 0 was not begun"):
        actor.assign(0, 0, 5)
    actor.begin(0)
    assert actor.assign(0, 0, 5) == 0
    actor.begin(1)  # the next step is scored while step 0's log-probs may still route
    assert actor.assign(1, 0, 9) == 0 and actor.assign(0, 1, 7) == 1
    actor.begin(1)  # retried after a lost worker: from scratch
    assert actor.assign(1, 1, 3) == 0
    actor.begin(3)  # rollout ahead (max_staleness 2): step 1's log-probs may still route while step 3 is scored
    assert sorted(actor.steps) == [0, 1, 3] and actor.assign(1, 0, 1) == 1
    actor.begin(KEPT_STEPS + 1)
    assert sorted(actor.steps) == [3, KEPT_STEPS + 1]  # steps KEPT_STEPS or more back are forgotten
    actor.begin(2)  # a resume from an earlier step: the steps after it are begun again when they come
    assert sorted(actor.steps) == [2]


def test_max_over_mean():
    assert max_over_mean([10, 30]) == 1.5 and max_over_mean([7]) == 1.0 and max_over_mean([0, 0]) == 1.0
