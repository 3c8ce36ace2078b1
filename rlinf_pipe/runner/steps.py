"""One training step of each mode, as the driver runs it. Only control passes through the driver: step numbers
and counts go out, metrics come back; the data streams through the channels.

    sync weights (version = step) -> prompts -> rollout -> [rollouts] -> reward -> [scored] -> log-probs
        -> [train/r] -> actor replica r (micro-batches; an optimizer step after each mini-batch)

Without a log-prob stage (the algorithm needs no old or reference log-probs) the reward workers put into [train/r].

Disaggregated: every stage runs at once on its own GPUs and the channels stream between them, and the version a step
trains moves into the receivers as soon as its training ends (`WeightSync.push`). Collocated: the
rollout phase finishes before the actor phase takes the same GPUs. Partly shared placements mix the two (`Step`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from rlinf_pipe.runner.cpu_shares import CpuLending
from rlinf_pipe.runner.devices import ActorPhase
from rlinf_pipe.runner.generation import GenerationCalls, GenerationResult, RolloutSchedule
from rlinf_pipe.runner.roles import LogprobComputing
from rlinf_pipe.runner.stage_calls import StageCalls
from rlinf_pipe.runner.step_channels import StepChannels
from rlinf_pipe.runner.weight_sync import WeightSync
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.workers.actor import ActorWorker, TrainResult


@dataclass
class StepOutcome:
    """What the driver learned in a step: weight-sync bytes, the generation's counts, each replica's training, and
    whether its generation was started during an earlier step (run ahead, or started early)."""

    sync: dict[str, float]
    generation: GenerationResult
    train: list[TrainResult]
    started_ahead: bool = False


async def sync_and_generate(weights: WeightSync, schedule: RolloutSchedule, step: int,
                            calls: StageCalls) -> tuple[dict[str, float], GenerationCalls]:
    """Sync version `step` into the engines and start the step's generation at once: the driver draws the step's
    prompts in a thread while the weights sync (tokenising them takes milliseconds) and asks for the generation as
    soon as they are drawn; each engine starts it once it holds version `step` (`weights=step`), a Ray round trip
    sooner than if the driver waited for the sync's answer first. A failed sync fails the engines' wait too. The
    first sync of a run (or after a relaunch) completes first: it may move the version the engines already hold,
    which a generation beside it would not wait for; so does every sync where other receivers load on the engines'
    GPUs, which they must not share while the engines generate (`WeightSync.generation_beside`)."""
    beside = weights.generation_beside()
    syncing = asyncio.ensure_future(weights.sync(version=step))
    try:
        prompts = await asyncio.to_thread(schedule.draw)
        if not beside:
            await asyncio.shield(syncing)
        generation = schedule.start(step, calls, prompts, weights=step)
    except BaseException:
        await asyncio.gather(syncing, return_exceptions=True)
        raise
    return await syncing, generation


@dataclass
class Step:
    """One step of any placement. Stages on GPUs of their own run at once and stream; where the engines take turns
    with the actor (`engines_share_actor`) the rollout phase ends before the actor's phase takes the GPUs; where
    the actor computes the log-probs (`logprob` is the actor) it does so before it trains. With `cpus`, a stage
    done with the step lends its CPUs to those still working. `logprob` is who computes the log-probs (None: no
    log-prob stage)."""

    weights: WeightSync
    schedule: RolloutSchedule
    channels: Callable[[], StepChannels]  # the job's current step channels (new ones after a lost worker)
    logprob: WorkerGroup[LogprobComputing] | None
    actor: WorkerGroup[ActorWorker]
    actor_phase: ActorPhase
    engines_share_actor: bool
    max_steps: int
    cpus: CpuLending | None = None
    # Steps whose generation starts at the step's own start, never during the step before: a profiled step (its
    # profiler starts with the step) and one validated first (validation waits until the engines are idle, and a
    # generation started early may never be: its output fills the bounded channels, and nothing trains it before
    # the step starts).
    starts_itself: Callable[[int], bool] = lambda step: False  # noqa: E731

    async def run(self, step: int) -> StepOutcome:
        calls = StageCalls()
        try:
            return await self._run(step, calls)
        except BaseException:  # abandoned anywhere (a lost worker found by the heartbeat cancels it): no call of
            calls.cancel()     # the step fails later unseen
            raise

    async def _run(self, step: int, calls: StageCalls) -> StepOutcome:
        await self.schedule.finish_ahead(calls, step)  # max_staleness 1: the engines finish the rollouts ahead
        if self.cpus is not None:
            self.cpus.start_step()  # (before the step's calls go out)
        sync, generation = await sync_and_generate(self.weights, self.schedule, step, calls)
        ch = self.channels()
        by_actor = self.logprob is self.actor
        logprob = None if by_actor or self.logprob is None else calls.start(
            "logprob", self.logprob.all.call(LogprobComputing.logprob_step, step, src=ch.logprob_input,
                                             dst=ch.train))
        if (cpus := self.cpus) is not None:
            def lend(stage: str) -> Callable[[asyncio.Future], None]:
                return lambda _: cpus.done(stage)

            for name, call in (("rollout", generation.rollout), ("inference", logprob)):
                if call is not None:
                    call.add_done_callback(lend(name))
        if self.engines_share_actor:
            await calls.until(generation.rollout)  # the engines give the devices back
        async with self.actor_phase(step):
            if by_actor:  # before any update; meanwhile the engines on other GPUs go on generating
                logprobs = calls.start("logprob", self.actor.all.call(ActorWorker.logprob_step, step,
                                                                      src=ch.logprob_input, dst=ch.train))
                await calls.until(logprobs)
            train = calls.start("train", self.actor.replicas.call(ActorWorker.train_step, step, src=ch.train))
            idle = {"rollout": [generation.rollout, *self.schedule.rollouts_before(step + 1)],
                    "inference": [logprob] if logprob is not None else []}
            pushed = self.weights.after_training(step + 1, idle) if step + 1 < self.max_steps else None
            if pushed is not None:  # (the next step's sync collects it)
                calls.watch("weight_push", pushed)
                if self.schedule.starts_next_early and not self.starts_itself(step + 1):  # on the pushed version
                    self.schedule.start_next(step + 1, calls, generation)
            await calls.until_all()
            if step + 1 < self.max_steps:
                await self.weights.publish(step + 1)  # (while the actor holds its devices)
        return StepOutcome(sync, await generation.result, train.result(), generation.ahead)
