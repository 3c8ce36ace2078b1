"""`RewardWorker`: the Ray worker of the `reward:` placement component, a `RewardPool` between two channels.

Each step it scores the `RolloutGroup`s of the rollout channel its call names and puts `ScoredGroup`s (rewards +
advantages) into the scored channel. A run without a log-prob stage (nothing to compute: `RunPlan.logprob_component`
None) names the actor replicas' train channels instead: each scored group goes, packed as a `TrainBatch`, to the
replica that trains its slot (`rlinf_pipe.data.routing`), one stage and one hop fewer. With dynamic sampling it
offers each group to the job's `SamplingRounds` and passes on only the groups kept there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec

from rlinf_pipe.algorithms.advantages import advantage_scope
from rlinf_pipe.algorithms.scoring import RewardTally, score_groups
from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.packing import pack_train_batch
from rlinf_pipe.data.structs import RolloutGroup, ScoredGroup
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.engines.reward.context import RewardContext, reward_context
from rlinf_pipe.engines.reward.pool import remove_process_temp_folder
from rlinf_pipe.engines.reward.registry import reward_pool
from rlinf_pipe.channels import Channel, StepEnd
from rlinf_pipe.runtime.worker import Worker, control_call
from rlinf_pipe.workers.logprob_stage import train_routing
from rlinf_pipe.workers.replica_balance import TrainRoute


# the scored channel, or the actor replicas' train channels
Output = Channel[ScoredGroup] | Sequence[Channel[TrainBatch]]


def advantage_options(cfg: Config) -> dict[str, Any]:
    return {"norm_by_std": cfg.algorithm.norm_by_std} if cfg.algorithm.adv_estimator == "grpo" else {}


class RewardWorker(Worker):
    """Scores rollouts in a process pool with per-item timeouts (`reward.*`) and computes their advantages. Its
    output is the scored channel, or (no log-prob stage) the `actor_dp` replicas' train channels, packed with
    `pad_token_id`. `sampling_rounds` gives each scored group its slot where the prompt's own
    does not stand: dynamic sampling's `SamplingRounds`, or `ArrivalSlots` (`algorithm.minibatch_order: arrival`);
    `balancer` the replica of each group written to the train channels by tokens (`ReplicaBalancer`)."""

    def __init__(self, cfg: Config, actor_dp: int, sampling_rounds: Any = None, pad_token_id: int = 0,
                 balancer: Any = None):
        super().__init__()
        self.pool = reward_pool(cfg.reward)
        self.sampling_rounds = sampling_rounds
        self.route = TrainRoute(train_routing(cfg, actor_dp), balancer)
        self.pad_token_id = pad_token_id
        self.estimator, self.adv_options = cfg.algorithm.adv_estimator, advantage_options(cfg)

    @control_call
    def before_stop(self) -> None:
        """Stop the pool's processes and remove the forkserver's socket folder, which a kill would leave in /tmp."""
        self.pool.close()
        remove_process_temp_folder()

    async def _put(self, step: int, scored: ScoredGroup, dst: Output) -> None:
        """Pass a scored group of step `step` on: into the scored channel, or packed into its replica's train
        channel (`dst` a list of them)."""
        if isinstance(dst, Channel):
            await dst.aput(scored, weight=scored.num_sequences)
            return
        batch = pack_train_batch([scored], self.pad_token_id)
        await dst[await self.route.replica(step, batch)].aput(batch, weight=batch.num_sequences)

    async def _slot(self, group: RolloutGroup, rewards: list[float]) -> int | None:
        """Where the group trains: its prompt's slot, or the slot `sampling_rounds` gives it (dynamic sampling: None
        when dropped; arrival order: the next free one)."""
        if self.sampling_rounds is None:
            return group.prompt.slot
        return await self.sampling_rounds.offer.remote(rewards)

    async def score_step(self, step: int, src: Channel[RolloutGroup], dst: Output,
                         end_step: bool = True) -> RewardTally:
        """Score `src`'s groups (the rollouts) up to its step end into `dst`: the scored channel, or the actor
        replicas' train channels (no log-prob stage); each as it is scored (group-scoped estimators) or all once
        the step is complete (batch-scoped ones). `end_step` False leaves the output's step open (a
        dynamic-sampling round that may be followed by another)."""
        streaming = advantage_scope(self.estimator) == "group"
        tally = RewardTally()
        held: list[tuple[RolloutGroup, list[float], int]] = []
        while not isinstance(group := await src.aget(), StepEnd):
            with self.tracer.span("reward", step=step, version=group.version, samples=group.num_sequences,
                                  prompt_tokens=len(group.prompt.prompt_ids),
                                  response_tokens=[s.num_tokens for s in group.samples]) as args:
                context = reward_context(group.prompt)
                results = await asyncio.to_thread(self.pool.score_batch, [(s.text, context) for s in group.samples])
                rewards = [r.reward for r in results]
                tally.add(group, rewards, [r.correct for r in results], [r.parsed for r in results],
                          [r.timed_out for r in results], [r.error is not None for r in results],
                          [r.extras for r in results])
                slot = args["slot"] = await self._slot(group, rewards)  # (None: dropped)
                if slot is None:
                    continue
                if streaming:
                    (scored,) = score_groups([group], [rewards], self.estimator, **self.adv_options)
                    await self._put(step, msgspec.structs.replace(scored, slot=slot), dst)
                else:
                    held.append((group, rewards, slot))
        if held:
            with self.tracer.span("advantages", step=step, groups=len(held)):
                scored_groups = score_groups([g for g, _, _ in held], [r for _, r, _ in held], self.estimator,
                                             **self.adv_options)
                for scored, (_, _, slot) in zip(scored_groups, held, strict=True):
                    await self._put(step, msgspec.structs.replace(scored, slot=slot), dst)
        if end_step:
            self.end_step(dst)
        return tally

    def end_step(self, dst: Output) -> None:
        """End the output's step (after the last dynamic-sampling round)."""
        for channel in [dst] if isinstance(dst, Channel) else dst:
            channel.end_step()

    def metrics(self) -> dict[str, float]:
        """Counters since start: items, correct, parse_failures, timeouts, errors, restarts, accuracy."""
        return self.pool.metrics()

    async def judge(self, pairs: Sequence[tuple[str, str | RewardContext]]) -> list[bool]:
        """Whether each (response, reference answer or `RewardContext`) is correct: evaluation's scoring, outside the
        channels."""
        results = await asyncio.to_thread(self.pool.score_batch, pairs)
        return [r.correct for r in results]
