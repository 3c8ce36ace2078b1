"""RewardWorker as a Ray actor (threaded, as WorkerGroup launches it): scores a batch through its process pool, times
out a real sympy hang without blocking the actor's control calls, and reports metrics."""

from __future__ import annotations

import time

import pytest
import ray

from rlinf_pipe.scheduler.worker import CONTROL_GROUP
from rlinf_pipe.workers.reward import RewardWorker, ScoreResult

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def reward_actor():
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        # The same actor options as WorkerGroup.launch: a control concurrency group makes the actor threaded, so
        # score_batch runs outside the main thread (where math-verify's own signal timeouts cannot work).
        remote_cls = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(RewardWorker)
        actor = remote_cls.options(num_cpus=0).remote(
            num_workers=2,
            timeout_s=TIMEOUT_S,
            correct_score=1.0,
            wrong_score=-1.0,
            format_score=0.0,
            answer_pattern="#### (.*)",
        )
        ray.get(actor.ping.remote())
        yield actor
        ray.get(actor.close.remote())
    finally:
        ray.shutdown()


def test_reward_worker_scores_a_batch_and_survives_a_hang(reward_actor) -> None:
    pairs = [
        ("so \\boxed{72}", "72"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{9^{9^{9^{9}}}}", "72"),  # hangs sympy: killed after TIMEOUT_S
        ("#### 1,234", "1234"),
        ("no answer", "3"),
        ("\\boxed{-3}", "3"),
    ]
    call = reward_actor.score_batch.remote(pairs)
    assert ray.get(reward_actor.ping.remote(), timeout=TIMEOUT_S) > 0  # control calls answer while it scores
    started = time.monotonic()
    results = ray.get(call, timeout=30)
    assert time.monotonic() - started < TIMEOUT_S + 1.0
    assert [r.reward for r in results] == [1.0, 1.0, -1.0, 1.0, -1.0, -1.0]
    assert results[2] == ScoreResult(correct=False, parsed=False, timed_out=True, reward=-1.0)
    assert [r.parsed for r in results] == [True, True, False, True, False, True]

    assert ray.get(reward_actor.rewards.remote([("\\boxed{5}", "5")])) == [1.0]
    metrics = ray.get(reward_actor.metrics.remote())
    assert {k: metrics[k] for k in ("items", "correct", "parse_failures", "timeouts", "restarts")} == {
        "items": 7.0,
        "correct": 4.0,
        "parse_failures": 1.0,
        "timeouts": 1.0,
        "restarts": 1.0,
    }
