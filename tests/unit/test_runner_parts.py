"""Pure parts of the runner: timeline analysis, stage helpers, weight-sync checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlinf_pipe.data.packing import pack_train_batch
from rlinf_pipe.data.structs import PromptItem, RolloutGroup, RolloutSample, ScoredGroup
from rlinf_pipe.runner.stages import MicroBatcher, RewardTally, concat_train_batches, score_groups
from rlinf_pipe.runner.weight_sync import WeightSyncError, check_version, tensor_crc32
from rlinf_pipe.utils.timeline import (
    STEP_SPAN,
    analyse,
    analyse_step,
    overlaps,
    read_chrome_trace,
    summarise,
    write_chrome_trace,
)
from rlinf_pipe.utils.tracing import Span, Tracer


def span(name, track, start, end, devices=(), **args):
    return Span(name, track, start, end, tuple(devices), args)


def test_analyse_step_busy_bubble_and_overhead():
    step = span(STEP_SPAN, "driver", 0.0, 10.0, step=3)
    spans = [
        step,
        span("generate", "rollout/0", 0.0, 6.0, [0]),
        span("logprob", "inference/0", 2.0, 4.0, [1]),
        span("logprob", "inference/0", 3.0, 5.0, [1]),  # overlaps the previous: union counts once
        span("train", "actor/0", 5.0, 9.0, [2]),
    ]
    a = analyse_step(spans, step)
    assert a.step == 3 and a.duration == 10.0
    assert a.stage_busy == {"generate": 0.6, "logprob": 0.3, "train": 0.4}
    assert a.bubble_fraction == pytest.approx(1 - (6 + 3 + 4) / 30)
    assert a.scheduler_overhead_fraction == pytest.approx(0.1)  # 9-10 s nobody worked
    s = summarise(analyse(spans))
    assert s["steps"] == 1 and s["stage_busy"]["train"] == pytest.approx(0.4)


def test_overlaps_only_between_components_on_a_shared_device():
    spans = [
        span("generate", "rollout/0", 0, 5, [0]),
        span("train", "actor/0", 4, 6, [0]),  # overlaps rollout on device 0
        span("train", "actor/1", 0, 6, [1]),
        span("logprob", "actor/0", 5.5, 7, [0]),  # same component as the train span: not a conflict
    ]
    found = overlaps(spans)
    assert [(a.track, b.track) for a, b in found] == [("rollout/0", "actor/0")]


def test_chrome_trace_round_trip(tmp_path):
    tracer = Tracer("actor/0", (2,))
    with tracer.span("train", step=1, version=1) as args:
        args["tokens"] = 7
    spans = [span(STEP_SPAN, "driver", 0.0, 1.0, step=1), *tracer.drain()]
    assert tracer.drain() == []
    write_chrome_trace(spans, tmp_path / "t.json")
    back = read_chrome_trace(tmp_path / "t.json")
    assert [(s.name, s.track, s.devices, s.args) for s in back] == [(s.name, s.track, s.devices, s.args) for s in spans]
    assert back[1].duration == pytest.approx(spans[1].duration, abs=1e-5)


def _group(pid: str, lengths: list[int], version: int = 0) -> RolloutGroup:
    prompt = PromptItem(id=pid, prompt="1+1", answer="2", index=0, prompt_ids=[5, 6, 7])
    samples = [RolloutSample(response_ids=np.arange(n) + 10, logprobs=np.zeros(n), finish_reason="stop",
                             version=version) for n in lengths]
    return RolloutGroup.of(prompt, samples)


def test_score_groups_group_and_batch_scope():
    g1, g2 = _group("a", [2, 3]), _group("b", [1, 1])
    (s1,) = score_groups([g1], [[1.0, 0.0]], "grpo", norm_by_std=False)
    np.testing.assert_allclose(s1.advantages, [0.5, -0.5])
    both = score_groups([g1, g2], [[1.0, 0.0], [0.0, 0.0]], "grpo", norm_by_std=False)
    np.testing.assert_allclose(both[1].advantages, [0.0, 0.0])
    assert all(isinstance(s, ScoredGroup) for s in both)


def test_reward_tally_merges_exactly():
    a, b = RewardTally(), RewardTally()
    a.add(_group("a", [2, 2]), [1.0, 0.0], [True, False], [True, True])
    b.add(_group("b", [4, 4]), [0.0, 0.0], [False, False], [False, True])
    m = a.merge(b).metrics()
    assert m["reward/mean"] == 0.25 and m["reward/accuracy"] == 0.25 and m["reward/parsed_frac"] == 0.75
    assert m["reward/uniform_group_frac"] == 0.5 and m["response_length/mean"] == 3.0


def test_micro_batcher_and_concat_keep_every_row():
    batches = [pack_train_batch(score_groups([g], [[1.0] * len(g.samples)], "grpo"), 0)
               for g in (_group("a", [2, 5]), _group("b", [1]), _group("c", [3, 3]))]
    mb = MicroBatcher(3)
    assert mb.add(batches[0], 2) == []
    assert mb.add(batches[1], 1) == [batches[:2]]
    assert mb.add(batches[2], 2) == [] and mb.flush() == [batches[2]] and mb.flush() is None
    # token budget: rows x longest row; an item that would break it closes the pending micro-batch first
    budget = MicroBatcher(micro_batch_size=100, max_tokens=20)
    assert budget.add("a", 2, width=5) == []  # 10 tokens
    assert budget.add("b", 2, width=5) == []  # 20 tokens: at the budget
    assert budget.add("c", 1, width=8) == [["a", "b"]]  # 5 x 8 = 40 > 20
    assert budget.add("d", 4, width=30) == [["c"]] and budget.flush() == [["d"]][0]  # too big alone: still sent
    cat = concat_train_batches(batches, pad_token_id=0)
    assert cat.num_sequences == 5 and cat.num_tokens == sum(b.num_tokens for b in batches)
    assert cat.input_ids.shape == (5, 8) and int(cat.response_mask.sum()) == cat.num_tokens
    torch.testing.assert_close(cat.input_ids[2, :4], batches[1].input_ids[0, :4])


def test_weight_sync_checks():
    t = [("w", torch.arange(4.0)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    assert tensor_crc32(t) == tensor_crc32([(n, x.clone()) for n, x in t])
    assert tensor_crc32(t) != tensor_crc32([("w", torch.arange(4.0) + 1), t[1]])
    check_version(3, 3, "x")
    with pytest.raises(WeightSyncError, match="version 2 after version 3"):
        check_version(3, 2, "rollout/0")
