"""RewardWorker as a Ray actor (threaded, as WorkerGroup launches it), between real channels: it scores a step's
groups through its process pool, times out a real sympy hang without blocking the actor's control calls, reports
metrics, and with dynamic sampling passes on only the groups `SamplingRounds` keeps, each in its own slot."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from rlinf_pipe.config import load_config
from rlinf_pipe.data.structs import PromptItem, RolloutGroup, RolloutSample, ScoredGroup
from rlinf_pipe.channels import Channel, StepEnd
from rlinf_pipe.runtime.worker import CONTROL_GROUP
from rlinf_pipe.workers.dynamic_sampling import SamplingRounds
from rlinf_pipe.workers.reward import RewardWorker

TIMEOUT_S = 3.0  # (each item, hung or not, from when it is sent: ordinary ones take milliseconds, 3 s on any load)
CFG = load_config(overrides=["reward.num_workers=2", f"reward.timeout_s={TIMEOUT_S}", "reward.wrong_score=-1.0",
                             "reward.answer_pattern='#### (.*)'"])


@pytest.fixture(scope="module")
def local_ray():
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def launch(name: str, rounds=None, cfg=CFG):
    """A RewardWorker with the actor options WorkerGroup.launch uses (a control concurrency group makes the actor
    threaded, so scoring runs off the main thread, where math-verify's own signal timeouts cannot work)."""
    rollouts = Channel.create(f"{name}-rollouts", RolloutGroup, maxsize=None, num_producers=1)
    scored = Channel.create(f"{name}-scored", ScoredGroup, maxsize=None, num_producers=1)
    remote_cls = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(RewardWorker)
    worker = remote_cls.options(num_cpus=0).remote(cfg, 1, rounds)
    ray.get(worker.ping.remote())
    return worker, rollouts, scored


def group(slot: int, answer: str, responses: list[str], **fields) -> RolloutGroup:
    prompt = PromptItem(id=f"p{slot}", prompt="?", answer=answer, index=slot, prompt_ids=[1, 2], slot=slot, **fields)
    samples = [RolloutSample(response_ids=np.array([3]), logprobs=np.array([0.0]), finish_reason="stop", version=0,
                             text=text) for text in responses]
    return RolloutGroup.of(prompt, samples)


def take_step(channel: Channel) -> list[ScoredGroup]:
    out = []
    while not isinstance(item := channel.get(timeout=60), StepEnd):
        out.append(item)
    return out


def test_reward_worker_scores_a_step_and_survives_a_hang(local_ray) -> None:
    worker, rollouts, scored = launch("plain")
    groups = [
        group(0, "72", ["so \\boxed{72}", "\\boxed{9^{9^{9^{9}}}}"]),  # the second hangs sympy: killed at TIMEOUT_S
        group(1, "0.5", ["\\boxed{\\frac{1}{2}}", "no answer"]),
        group(2, "1234", ["#### 1,234", "\\boxed{-3}"]),
    ]
    for g in groups:
        rollouts.put(g, weight=g.num_sequences)
    rollouts.end_step()
    call = worker.score_step.remote(0, rollouts, scored)
    ping = worker.ping.remote()  # control calls answer while it scores (the step takes TIMEOUT_S at least)
    assert ray.wait([ping, call], num_returns=1, timeout=60)[0] == [ping] and ray.get(ping) > 0
    tally = ray.get(call, timeout=60)
    out = {s.slot: s for s in take_step(scored)}
    assert sorted(out) == [0, 1, 2]
    assert {slot: s.rewards.tolist() for slot, s in out.items()} == {0: [1.0, -1.0], 1: [1.0, -1.0], 2: [1.0, -1.0]}
    assert all(s.advantages[0] > 0 > s.advantages[1] for s in out.values())  # GRPO: above / below the group mean
    assert (tally.samples, tally.correct, tally.parsed) == (6, 3, 4)
    metrics = ray.get(worker.metrics.remote())
    assert {k: metrics[k] for k in ("items", "correct", "parse_failures", "timeouts", "restarts")} == {
        "items": 6.0, "correct": 3.0, "parse_failures": 1.0, "timeouts": 1.0, "restarts": 1.0,
    }
    step_metrics = tally.metrics()  # what the step's row of metrics.jsonl holds
    assert (step_metrics["reward/timeouts"], step_metrics["reward/parse_failures"]) == (1.0, 1.0)


def test_dynamic_sampling_keeps_varied_groups_in_slots_up_to_the_target(local_ray) -> None:
    rounds = SamplingRounds.remote()
    worker, rollouts, scored = launch("dynamic", rounds)
    ray.get(rounds.reset.remote(2, 1))
    assert ray.get(rounds.start_round.remote()) == 2
    varied, uniform = ["\\boxed{5}", "\\boxed{4}"], ["\\boxed{4}", "\\boxed{4}"]
    for g in (group(0, "5", uniform), group(1, "5", varied), group(2, "5", varied), group(3, "5", varied)):
        rollouts.put(g, weight=g.num_sequences)
    rollouts.end_step()
    tally = ray.get(worker.score_step.remote(0, rollouts, scored, end_step=False), timeout=60)
    ray.get(worker.end_step.remote(scored))
    kept = take_step(scored)
    assert [(s.group.prompt.id, s.slot) for s in kept] == [("p1", 0), ("p2", 1)]  # p3 is surplus, p0 uniform
    assert tally.groups == 4 and tally.uniform_groups == 1  # every generated group counts in the rewards
    metrics = ray.get(rounds.metrics.remote())
    assert metrics["dynamic_sampling/groups_kept"] == 2 and metrics["dynamic_sampling/groups_surplus"] == 1
    assert ray.get(rounds.done.remote())


REWARD_FILE = """\
def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "raise":
        raise RuntimeError("no score for this one")
    return {"score": float(solution_str in ground_truth), "index": extra_info["index"], "from": data_source}
"""


def test_a_reward_function_scores_the_step_with_its_extras_and_errors(local_ray, tmp_path) -> None:
    """verl's arguments reach the function in the worker's pool (a verl list ground truth, extra_info, data_source);
    its extra keys and failures land in the step's tally; with fail_on_error the step call raises the failure."""
    path = tmp_path / "reward_fn.py"
    path.write_text(REWARD_FILE)
    cfg = load_config(overrides=[f"reward.function={path}", "reward.timeout_s=10"])
    worker, rollouts, scored = launch("function", cfg=cfg)
    fields = {"answers": ("7", "7.0"), "ground_truth": '["7", "7.0"]', "data_source": "mine",
              "extra_info": '{"index": 3}'}
    for g in (group(0, "7", ["7", "7.0", "8"], **fields), group(1, "7", ["raise", "7"], **fields)):
        rollouts.put(g, weight=g.num_sequences)
    rollouts.end_step()
    tally = ray.get(worker.score_step.remote(0, rollouts, scored), timeout=60)
    out = {s.slot: s.rewards.tolist() for s in take_step(scored)}
    assert out == {0: [1.0, 1.0, 0.0], 1: [0.0, 1.0]}
    metrics = tally.metrics()
    assert (metrics["reward/errors"], metrics["reward/index"], metrics["reward/mean"]) == (1.0, 3.0, 0.6)
    assert "reward/from" not in metrics  # (text is not a metric)

    strict = load_config(overrides=[f"reward.function={path}", "reward.fail_on_error=true"])
    worker, rollouts, scored = launch("function-strict", cfg=strict)
    rollouts.put(group(0, "7", ["raise"], **fields), weight=1)
    rollouts.end_step()
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(worker.score_step.remote(0, rollouts, scored), timeout=60)
    assert "RewardFunctionError" in str(info.value) and "RuntimeError: no score for this one" in str(info.value)
