"""What an actor replica does in a step, read from its own train channel: train these micro-batches, step the
optimizer after each mini-batch. Decided on the replica's input rank and shared with its other ranks.

Every group arrives with its slot, which fixes its mini-batch (`rlinf_pipe.data.routing`) and, by default, its
replica (by tokens, `algorithm.replica_routing: tokens`, only how many of each mini-batch's groups this replica
gets); groups of a later mini-batch that arrive early wait here. A mini-batch is complete when all the groups the
routing gives this replica arrived, or when the step ends (dynamic sampling may keep fewer groups than the batch
holds). Every replica steps the optimizer once per mini-batch, so the collective steps match across replicas; a
mini-batch no replica trained anything in is skipped inside the step.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rlinf_pipe.data.packing import MicroBatcher, concat_train_batches
from rlinf_pipe.data.routing import TrainRouting
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.errors import RlinfPipeError
from rlinf_pipe.channels import Channel, StepEnd
from rlinf_pipe.channels.traffic import payload_bytes


@dataclass(frozen=True)
class TrainMicroBatch:
    """Forward and backward of one micro-batch: the groups in `parts`, padded into one batch when `batch` is first
    read (by the actor, in its compute thread and its train span: packing is training work)."""

    parts: tuple[TrainBatch, ...]
    pad_token_id: int

    @functools.cached_property
    def batch(self) -> TrainBatch:
        return concat_train_batches(list(self.parts), self.pad_token_id)


@dataclass(frozen=True)
class OptimizerStep:
    """The end of mini-batch `minibatch`: step the optimizer (collective over every rank of the actor)."""

    minibatch: int
    data_bytes: int  # bytes of training data this replica read from its channel since the last step
    tokens: int = 0  # real tokens of the groups among them


TrainOp = TrainMicroBatch | OptimizerStep


class TrainFeedError(RlinfPipeError):
    """The train channel delivered something the routing does not allow (a bug upstream, not a user error)."""


async def train_ops(
    channel: Channel[TrainBatch], routing: TrainRouting, replica: int, batcher: MicroBatcher, pad_token_id: int,
    by_slot: bool = True,
) -> AsyncIterator[TrainOp]:
    """This replica's ops for one step, read from its train channel (see the module docstring); `by_slot`: the
    groups' slots also say which replica trains them (checked)."""
    waiting: dict[int, list[TrainBatch]] = {m: [] for m in range(routing.n_minibatches)}
    arrived = [0] * routing.n_minibatches
    ended = False
    for minibatch in range(routing.n_minibatches):
        data_bytes = tokens = 0
        ready = waiting.pop(minibatch)  # groups of this mini-batch that arrived early
        while True:
            for i, batch in enumerate(ready):  # (with more in hand or in the channel a micro-batch may grow)
                more = batcher.can_grow and (i + 1 < len(ready) or channel.qsize() > 0)
                for micro_batch in batcher.add(batch, more):
                    yield TrainMicroBatch(tuple(micro_batch), pad_token_id)
            ready = []
            if ended or arrived[minibatch] >= routing.expected(minibatch, replica):
                break
            if not channel.qsize() and (grown := batcher.flush_full()):  # grown while more were waiting
                yield TrainMicroBatch(tuple(grown), pad_token_id)
            item = await channel.aget()
            if isinstance(item, StepEnd):
                ended = True
                continue
            target = _check(item, routing, replica, minibatch, by_slot)
            arrived[target] += 1
            data_bytes += payload_bytes(item)
            tokens += int(item.attention_mask.sum())
            (ready if target == minibatch else waiting[target]).append(item)
        if rest := batcher.flush():
            yield TrainMicroBatch(tuple(rest), pad_token_id)
        yield OptimizerStep(minibatch, data_bytes, tokens)
    if not ended and not isinstance(item := await channel.aget(), StepEnd):
        raise TrainFeedError(f"actor replica {replica} got a group (slot {item.slot}) beyond the step's "
                             f"{routing.groups}")


def _check(item: TrainBatch, routing: TrainRouting, replica: int, minibatch: int, by_slot: bool) -> int:
    """The mini-batch of an arriving group, checked against the routing."""
    if by_slot and routing.replica_of(item.slot) != replica:
        raise TrainFeedError(f"actor replica {replica} got the group of slot {item.slot}, which replica "
                             f"{routing.replica_of(item.slot)} trains")
    target = routing.minibatch_of(item.slot)
    if target < minibatch:
        raise TrainFeedError(f"actor replica {replica} got a group of mini-batch {target} (slot {item.slot}) after "
                             f"stepping it: more groups than the step's {routing.groups}")
    return target
