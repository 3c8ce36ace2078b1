"""`StepChannels`: the streams of a job's step, created by the driver from the stage graph
(`rlinf_pipe.planning.stage_graph`) and passed to each stage call that reads or writes them.

    rollouts: engines -> reward workers          (RolloutGroup)
    scored:   reward workers -> log-prob stage   (ScoredGroup; None without a log-prob stage)
    train[r]: log-prob stage -> actor replica r  (TrainBatch; from the reward workers without a log-prob stage)

After a lost worker the driver creates a new set (`create_channels`) and passes it from then on: a step abandoned
half-way leaves nothing behind in the new channels, and no worker holds a channel between calls.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from rlinf_pipe.channels import Channel
from rlinf_pipe.data.structs import RolloutGroup, ScoredGroup
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.planning.run_plan import RunPlan
from rlinf_pipe.planning.stage_graph import ROLLOUTS, SCORED, TRAIN, StageGraph, stage_graph

ITEM_TYPES: dict[str, type] = {"RolloutGroup": RolloutGroup, "ScoredGroup": ScoredGroup, "TrainBatch": TrainBatch}


@dataclass
class StepChannels:
    """The step's streams (see the module docstring)."""

    rollouts: Channel[RolloutGroup]
    scored: Channel[ScoredGroup] | None
    train: list[Channel[TrainBatch]]

    @property
    def reward_output(self) -> Channel[ScoredGroup] | list[Channel[TrainBatch]]:
        """Where the reward workers write: the scored channel, or the train channels (no log-prob stage)."""
        return self.scored if self.scored is not None else self.train

    @property
    def logprob_input(self) -> Channel[ScoredGroup]:
        """What the log-prob stage reads: the scored channel (a job without a log-prob stage has none)."""
        if self.scored is None:
            raise ValueError("this job has no log-prob stage, so no scored channel")
        return self.scored

    def abort(self) -> None:
        """Stop this process's ends of the channels (before Ray goes, or when they are replaced)."""
        for channel in (self.rollouts, self.scored, *self.train):
            if channel is not None:
                channel.abort()


def create_channels(plan: RunPlan, graph: StageGraph | None = None) -> StepChannels:
    """The channels of `graph` (default: `plan`'s). Where a consumer starts only once its producer's phase ended
    (`RunPlan.buffers_steps`: GPUs taken in turns, the actor's log-probs before its training, rollout run ahead) they
    buffer a step unbounded. The train channels are always unbounded: a replica that has its mini-batch reads
    nothing while it waits in the step's vote for the others, and a producer blocked on its channel would hold back,
    behind it, the groups the others wait for (every producer feeds every replica). What they hold is bounded by the
    batches of the steps in flight (`runner.max_staleness` + 1: the driver hands out a step's prompts only when it
    may begin)."""
    graph = graph or stage_graph(plan)
    run_id = uuid.uuid4().hex[:8]
    made: dict[str, list[Channel]] = {}
    for spec in graph.channels:
        options: dict[str, Any] = {"shared_bytes": plan.channel_shared_bytes, "encrypt": plan.channel_encrypt,
                                   "num_producers": spec.producers}
        if spec.unbounded:
            options["maxsize"] = None
        names = ([f"{run_id}-{spec.name}-{replica}" for replica in range(plan.actor_dp)] if spec.per_replica
                 else [f"{run_id}-{spec.name}"])
        made[spec.name] = [Channel.create(name, ITEM_TYPES[spec.item], **options) for name in names]
    return StepChannels(rollouts=made[ROLLOUTS][0], scored=made[SCORED][0] if SCORED in made else None,
                        train=made[TRAIN])
