"""Pure parts of the step: timeline analysis, scoring, micro-batching, routing slots to actor replicas, the
actor's train feed, version checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlinf_pipe.algorithms.scoring import RewardTally, score_groups
from rlinf_pipe.data.packing import MicroBatcher, concat_train_batches, pack_train_batch, row_chunks
from rlinf_pipe.data.routing import TrainRouting
from rlinf_pipe.data.structs import PromptItem, RolloutGroup, RolloutSample, ScoredGroup
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.channels import StepEnd
from rlinf_pipe.channels.traffic import payload_bytes
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
from rlinf_pipe.weights import WeightSyncError, check_version
from rlinf_pipe.workers.train_feed import OptimizerStep, TrainFeedError, TrainMicroBatch, train_ops


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
    b.add(_group("b", [4, 4]), [0.0, 0.0], [False, False], [False, True], [True, False])
    m = a.merge(b).metrics()
    assert (m["reward/timeouts"], m["reward/parse_failures"]) == (1.0, 0.0)
    assert m["reward/mean"] == 0.25 and m["reward/accuracy"] == 0.25 and m["reward/parsed_frac"] == 0.75
    assert m["reward/uniform_group_frac"] == 0.5 and m["response_length/mean"] == 3.0


def _batch(rows: int, width: int, slot: int = -1) -> TrainBatch:
    """A TrainBatch of `rows` rows padded to `width`, one response token per row."""
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, width - 1] = True
    return TrainBatch(input_ids=torch.ones(rows, width, dtype=torch.long), attention_mask=torch.ones_like(mask),
                      response_mask=mask, old_logprobs=torch.zeros(rows, width), advantages=torch.zeros(rows, width),
                      rewards=torch.zeros(rows), version=0, num_sequences=rows, num_tokens=rows, slot=slot)


def test_micro_batcher_and_concat_keep_every_row():
    batches = [pack_train_batch(score_groups([g], [[1.0] * len(g.samples)], "grpo"), 0)
               for g in (_group("a", [2, 5]), _group("b", [1]), _group("c", [3, 3]))]
    mb = MicroBatcher(3)
    assert mb.add(batches[0]) == []
    assert mb.add(batches[1]) == [batches[:2]]
    assert mb.add(batches[2]) == [] and mb.flush() == [batches[2]] and mb.flush() == []
    # token budget: rows x longest row; a batch that would break it closes the pending micro-batch first
    a, b, c, d = _batch(2, 5), _batch(2, 5), _batch(1, 8), _batch(4, 30)
    budget = MicroBatcher(micro_batch_size=100, max_tokens=20)
    assert budget.add(a) == []  # 10 tokens
    assert budget.add(b) == []  # 20 tokens: at the budget
    assert budget.add(c) == [[a, b]]  # 5 x 8 = 40 > 20
    out = budget.add(d) + [budget.flush()]  # 4 rows of 30 tokens: each over the budget, so one per micro-batch
    assert out[0] == [c] and [[p.num_sequences for p in mb] for mb in out[1:]] == [[1]] * 4
    # a group over the limits on its own is split by rows (a group of 16 long responses, micro_batch_size 4)
    group = _batch(6, 5)
    assert [[p.num_sequences for p in mb] for mb in MicroBatcher(4).add(group)] == [[4]]
    split = MicroBatcher(micro_batch_size=100, max_tokens=10)
    assert [[p.num_sequences for p in mb] for mb in split.add(group)] == [[2], [2]] and split.flush()[0].num_sequences == 2
    cat = concat_train_batches(batches, pad_token_id=0)
    assert cat.num_sequences == 5 and cat.num_tokens == sum(b.num_tokens for b in batches)
    assert cat.input_ids.shape == (5, 8) and int(cat.response_mask.sum()) == cat.num_tokens
    torch.testing.assert_close(cat.input_ids[2, :4], batches[1].input_ids[0, :4])
    assert cat.slot == -1 and pack_train_batch([ScoredGroup(group=_group("e", [1]), rewards=[1.0],
                                                            advantages=[0.0], version=0, slot=7)], 0).slot == 7


def test_micro_batches_grow_to_max_size_while_more_are_waiting():
    """`max_size`: a batch added while more wait does not close a micro-batch before `max_size` sequences; one
    added with nothing behind it closes at `micro_batch_size`; none ever exceeds `max_size` (nor a token budget)."""
    a, b, c, d, e = (_batch(2, 5) for _ in range(5))
    mb = MicroBatcher(2, max_size=5)
    assert mb.add(a, waiting=True) == [] and mb.add(b, waiting=True) == []  # 4 rows, more behind: keep growing
    assert mb.add(c, waiting=True) == [[a, b]]  # 6 rows would pass max_size 5: the 4 go first
    assert mb.add(d) == [[c, d]]  # nothing behind d: closes at micro_batch_size
    assert mb.add(e, waiting=True) == [] and mb.flush() == [e]
    # once nothing more waits, a micro-batch that grew past micro_batch_size goes; a smaller one stays pending
    one = _batch(1, 5)
    assert mb.add(one, waiting=True) == [] and mb.flush_full() == [] and mb.add(a, waiting=True) == []
    assert mb.flush_full() == [one, a] and mb.pending == [] and mb.can_grow and not MicroBatcher(2).can_grow
    assert MicroBatcher(2).add(a, waiting=True) == [[a]]  # without max_size, waiting changes nothing
    assert MicroBatcher(4, max_size=2).max_size == 4  # never below micro_batch_size
    budget = MicroBatcher(2, max_tokens=20, max_size=8)  # 2 rows x 5 = 10 tokens a batch
    assert budget.add(a, waiting=True) == [] and budget.add(b, waiting=True) == []
    assert budget.add(c, waiting=True) == [[a, b]]  # 30 tokens would break the budget before max_size


def _ragged(lengths: list[int]) -> TrainBatch:
    """A right-padded TrainBatch whose rows hold `lengths` real tokens (the last one a response token)."""
    width = max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    response = torch.zeros_like(valid)
    response[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = True
    rows = len(lengths)
    return TrainBatch(input_ids=torch.ones(rows, width, dtype=torch.long), attention_mask=valid,
                      response_mask=response, old_logprobs=torch.zeros(rows, width),
                      advantages=torch.zeros(rows, width), rewards=torch.zeros(rows), version=0,
                      num_sequences=rows, num_tokens=rows)


def test_packed_micro_batches_count_real_tokens():
    # rows of 10, 2, 2, 2 real tokens: 16 real tokens, 40 padded (4 x 10)
    group = _ragged([10, 2, 2, 2])
    assert [[p.num_sequences for p in mb] for mb in MicroBatcher(100, max_tokens=16, packed=True).add(group)] == []
    padded = MicroBatcher(100, max_tokens=16)
    assert [[p.num_sequences for p in mb] for mb in padded.add(group)] == [[1]]  # the long row alone, then 3 x 2
    assert padded.flush()[0].num_sequences == 3
    assert row_chunks([10, 2, 2, 2, 5], 100, 16, packed=True) == [range(0, 4), range(4, 5)]
    assert row_chunks([10, 2, 2, 2, 5], 100, 16) == [range(0, 1), range(1, 4), range(4, 5)]
    # a pending micro-batch closes when the next batch's real tokens would break the budget
    budget = MicroBatcher(100, max_tokens=16, packed=True)
    a, b = _ragged([6, 6]), _ragged([3, 2])
    assert budget.add(a) == [] and budget.add(b) == [[a]] and budget.flush() == [b]


def test_routing_gives_every_slot_one_minibatch_and_replica():
    routing = TrainRouting(groups=12, n_minibatches=2, dp=4)
    cells = [(routing.minibatch_of(s), routing.replica_of(s)) for s in range(12)]
    assert [m for m, _ in cells] == [0] * 6 + [1] * 6
    for m in range(2):
        for r in range(4):
            assert cells.count((m, r)) == routing.expected(m, r)
    assert [routing.expected(0, r) for r in range(4)] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="slot 12 is outside"):
        routing.replica_of(12)
    with pytest.raises(ValueError, match="dividing"):
        TrainRouting(groups=10, n_minibatches=3, dp=1)


class ListChannel:
    """The consumer side of a channel over a list (`aget` returns the items, then StepEnd): what train_ops reads."""

    def __init__(self, items: list) -> None:
        self.items = list(items)

    async def aget(self):
        return self.items.pop(0) if self.items else StepEnd(0)

    def qsize(self) -> int:
        return len(self.items)


class WavesChannel:
    """A channel whose items arrive in waves: `qsize` counts what is left of the wave being read; the next wave
    arrives when the reader asks for an item after the current one is used up."""

    def __init__(self, waves: list[list]) -> None:
        self.waves = [list(w) for w in waves]

    async def aget(self):
        while self.waves and not self.waves[0]:
            self.waves.pop(0)
        return self.waves[0].pop(0) if self.waves else StepEnd(0)

    def qsize(self) -> int:
        return len(self.waves[0]) if self.waves else 0


async def _ops(items: list, routing: TrainRouting, replica: int, micro_batch_size: int = 1) -> list:
    channel = ListChannel([*items, StepEnd(0)])
    ops = [op async for op in train_ops(channel, routing, replica, MicroBatcher(micro_batch_size), pad_token_id=0)]
    assert channel.items == []  # the whole step, StepEnd included, was read
    return ops


def _slots(ops: list) -> list:
    return [op.batch.slot if isinstance(op, TrainMicroBatch) else ("step", op.minibatch) for op in ops]


async def test_train_feed_steps_each_minibatch_whatever_the_arrival_order():
    routing = TrainRouting(groups=8, n_minibatches=2, dp=2)  # replica 1 trains slots 1, 3 (mini-batch 0), 5, 7
    arrivals = [_batch(2, 4, slot) for slot in (7, 5, 3, 1)]  # mini-batch 1 arrives first: it waits
    ops = await _ops(arrivals, routing, replica=1, micro_batch_size=2)
    assert _slots(ops) == [3, 1, ("step", 0), 7, 5, ("step", 1)]
    split = await _ops(arrivals, routing, replica=1)  # micro_batch_size 1: each group of 2 is split by rows
    assert _slots(split) == [3, 3, 1, 1, ("step", 0), 7, 7, 5, 5, ("step", 1)]
    read = sum(op.data_bytes for op in ops if isinstance(op, OptimizerStep))
    assert read == sum(payload_bytes(b) for b in arrivals) > 0  # every byte the replica read, counted once


async def test_train_feed_micro_batches_within_a_minibatch_only():
    routing = TrainRouting(groups=4, n_minibatches=2, dp=1)
    ops = await _ops([_batch(2, 4, s) for s in (0, 2, 1, 3)], routing, replica=0, micro_batch_size=4)
    sizes = [op.batch.num_sequences if isinstance(op, TrainMicroBatch) else "step" for op in ops]
    assert sizes == [4, "step", 4, "step"]  # slots 0+1 together, 2+3 together, although 2 arrived before 1


async def test_train_feed_merges_groups_that_are_already_waiting_up_to_max_size():
    """With `max_micro_batch_size`, groups that arrived together train in micro-batches up to that size; a micro-batch
    held back for groups of a later mini-batch trains before the reader waits for more."""
    routing = TrainRouting(groups=6, n_minibatches=1, dp=1)
    waves = [[_batch(2, 4, 0)], [_batch(2, 4, s) for s in (1, 2, 3, 4)], [_batch(2, 4, 5)]]
    ops = [op async for op in train_ops(WavesChannel(waves), routing, 0, MicroBatcher(2, max_size=6), 0)]
    sizes = [op.batch.num_sequences if isinstance(op, TrainMicroBatch) else "step" for op in ops]
    assert sizes == [2, 6, 2, 2, "step"]  # alone; three of the four that came at once; the fourth; the last
    fixed = [op async for op in train_ops(WavesChannel(waves), routing, 0, MicroBatcher(2), 0)]
    assert [op.batch.num_sequences for op in fixed if isinstance(op, TrainMicroBatch)] == [2] * 6
    two = TrainRouting(groups=4, n_minibatches=2, dp=1)  # slots 0, 1: mini-batch 0; 2, 3: mini-batch 1
    waves = [[_batch(1, 4, 0), _batch(1, 4, 2)], [_batch(1, 4, 1), _batch(1, 4, 3)]]
    ops = [op async for op in train_ops(WavesChannel(waves), two, 0, MicroBatcher(1, max_size=2), 0)]
    parts = [[p.slot for p in op.parts] if isinstance(op, TrainMicroBatch) else "step" for op in ops]
    assert parts == [[0], [1], "step", [2, 3], "step"]


async def test_train_feed_with_fewer_groups_steps_every_minibatch():
    """Dynamic sampling kept 3 of 8 groups: the step ends early, every mini-batch still gets its optimizer step."""
    routing = TrainRouting(groups=8, n_minibatches=2, dp=1)
    ops = await _ops([_batch(1, 4, s) for s in (0, 2, 1)], routing, replica=0)
    assert _slots(ops) == [0, 2, 1, ("step", 0), ("step", 1)]


async def test_train_feed_rejects_what_the_routing_does_not_allow():
    routing = TrainRouting(groups=4, n_minibatches=1, dp=2)
    with pytest.raises(TrainFeedError, match="slot 1, which replica 1 trains"):
        await _ops([_batch(1, 4, 1)], routing, replica=0)
    with pytest.raises(TrainFeedError, match="beyond the step's 4"):
        await _ops([_batch(1, 4, 0), _batch(1, 4, 2), _batch(1, 4, 0)], routing, replica=0)


async def test_train_feed_by_tokens_takes_any_slot_of_its_share_and_counts_tokens():
    """Routed by tokens, a replica gets whichever groups the balance sends it (slots the round-robin would give the
    other replica), as many per mini-batch as by slot; each optimizer step counts the tokens it trained."""
    routing = TrainRouting(groups=4, n_minibatches=1, dp=2)  # by slot, replica 0 trains slots 0 and 2
    channel = ListChannel([_batch(1, 4, 1), _batch(2, 4, 3), StepEnd(0)])
    ops = [op async for op in train_ops(channel, routing, 0, MicroBatcher(1), 0, by_slot=False)]
    assert _slots(ops) == [1, 3, 3, ("step", 0)] and ops[-1].tokens == 4 + 8
    with pytest.raises(TrainFeedError, match="slot 1, which replica 1 trains"):
        await _ops([_batch(1, 4, 1)], routing, replica=0)  # (by slot: refused)


def test_version_checks():
    check_version(3, 3, "x")
    with pytest.raises(WeightSyncError, match="version 2 after version 3"):
        check_version(3, 2, "rollout/0")


def test_arrival_slots_count_from_zero_in_each_step():
    from rlinf_pipe.workers.arrival_slots import SlotCounter

    slots = SlotCounter()
    assert [slots.offer([1.0]) for _ in range(3)] == [0, 1, 2]  # every group kept, in the order offered
    slots.reset()  # the next step's scoring (or the same step's, retried)
    assert slots.offer([0.0]) == 0
