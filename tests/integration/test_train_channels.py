"""The train channels of a pipeline with several actor replicas, as `create_channels` makes them, between a real
producer process and the replicas' readers (`train_ops`): a replica that has its mini-batch waits in the step's
vote for the others (the actor's `agree`) and reads nothing meanwhile. The groups the others need must still get
through the producer that feeds them all, whatever order the groups finish in."""

from __future__ import annotations

import asyncio
import sys

import msgspec
import pytest
import ray
from support.actor_run import make_batch
from support.channel_cluster import nodes_fixture, on_node

from rlinf_pipe.config import load_config
from rlinf_pipe.data.packing import MicroBatcher
from rlinf_pipe.data.routing import TrainRouting
from rlinf_pipe.runner.step_channels import create_channels
from rlinf_pipe.planning.run_plan import plan_run
from rlinf_pipe.channels import Channel
from rlinf_pipe.workers.train_feed import OptimizerStep, train_ops

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow

_created: list[Channel] = []
nodes = nodes_fixture(_created)
GROUP_SIZE = 16  # a group's weight in the channel: its sample count


@ray.remote(num_cpus=0)
class Feeder:
    """The stage before the actor (the log-prob workers): puts each finished group into its replica's channel, in
    the order the groups finish."""

    def __init__(self, train: list[Channel]):
        self.train = train

    def feed(self, order: list[tuple[int, int]]) -> int:
        """Put the groups of `order` ((replica, slot) pairs), then end the step on every channel."""
        for replica, slot in order:
            batch = msgspec.structs.replace(make_batch(slot, rows=2, vocab=16), slot=slot)
            self.train[replica].put(batch, weight=GROUP_SIZE)
        for channel in self.train:
            channel.end_step()
        return len(order)


async def test_a_replica_waiting_in_the_vote_does_not_hold_up_the_groups_the_others_need(nodes):
    # the three-stage pipeline: log-prob workers stream to the actor's replicas while they train (no step buffered)
    cfg = load_config(overrides=["cluster.num_gpus_per_node=4", "algorithm.compute_ref_logprobs=true",
                                 "cluster.component_placement={rollout: 0, inference: 1, actor: 2-3}",
                                 "data.rollout_batch_size=24", f"algorithm.group_size={GROUP_SIZE}",
                                 "algorithm.n_minibatches=2"])
    plan = plan_run(cfg, [4])
    assert not plan.buffers_steps and plan.actor_dp == 2
    train = create_channels(plan).train
    _created.extend(train)
    routing = TrainRouting(groups=24, n_minibatches=2, dp=2)
    slots = {(r, m): [s for s in range(24) if (routing.replica_of(s), routing.minibatch_of(s)) == (r, m)]
             for r in range(2) for m in range(2)}
    # Replica 0's groups of both mini-batches finish first (6 of mini-batch 1 come while it waits in the vote),
    # then replica 1's: with 4 groups' weight allowed untaken per producer, the feeder would block on replica 0's
    # fifth before replica 1 had its first mini-batch, and both replicas would wait for ever.
    order = [(r, s) for r, m in [(0, 0), (0, 1), (1, 0), (1, 1)] for s in slots[(r, m)]]
    # (the stage before the actor has a producer per process: the first finishes every group, the others none)
    feeders = [on_node(Feeder, nodes[1]).remote(train) for _ in range(train[0].spec.num_producers)]
    fed = [feeder.feed.remote(order if i == 0 else []) for i, feeder in enumerate(feeders)]

    reached = [asyncio.Event() for _ in range(2)]
    waiting = [0, 0]

    async def vote(minibatch: int) -> None:  # every replica's optimizer step waits for the others (`agree`)
        waiting[minibatch] += 1
        if waiting[minibatch] == 2:
            reached[minibatch].set()
        await reached[minibatch].wait()

    async def replica(r: int) -> list[int]:
        stepped = []
        async for op in train_ops(train[r], routing, r, MicroBatcher(1), pad_token_id=0):
            if isinstance(op, OptimizerStep):
                await vote(op.minibatch)
                stepped.append(op.minibatch)
        return stepped

    try:
        stepped = await asyncio.wait_for(asyncio.gather(replica(0), replica(1)), timeout=60)
    except TimeoutError:
        pytest.fail(f"the replicas stopped at the votes {waiting}: the feeder is blocked on the channel of a replica "
                    "that waits for the other")
    assert stepped == [[0, 1], [0, 1]]
    assert await asyncio.gather(*fed) == [24] + [0] * (len(fed) - 1)
