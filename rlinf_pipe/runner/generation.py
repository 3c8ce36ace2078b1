"""A step's generation: prompts -> rollout engines -> reward workers, as the driver starts it.

`PlainGeneration` runs one rollout call and one scoring call per step; `DynamicSampling` runs rounds of both
until the step holds enough groups whose rewards vary (`algorithm.dynamic_sampling`). `RolloutSchedule` decides
when a step's generation starts: in the step (`runner.max_staleness: 0`), or up to N steps ahead, while earlier
steps train, with weights up to N versions behind (`max_staleness: N`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from rlinf_pipe.algorithms.scoring import RewardTally
from rlinf_pipe.data.sampler import PromptSampler
from rlinf_pipe.data.structs import PromptItem
from rlinf_pipe.runner.stage_calls import StageCalls
from rlinf_pipe.runner.step_channels import StepChannels
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.utils.futures import mark_retrieved
from rlinf_pipe.workers.reward import RewardWorker
from rlinf_pipe.workers.rollout import RolloutWorker


T = TypeVar("T")


def draw_prompts(sampler: PromptSampler, count: int | None = None) -> list[PromptItem]:
    """The next prompts, each with its slot (its position in the batch; see `rlinf_pipe.data.routing`)."""
    return [msgspec.structs.replace(p, slot=i) for i, p in enumerate(sampler.next_batch(count))]


@dataclass
class GenerationResult:
    """What a step's generation reports: the reward tallies of every group generated, and dynamic sampling's
    counts."""

    tallies: list[RewardTally] = field(default_factory=list)
    sampling: dict[str, float] = field(default_factory=dict)


@dataclass
class GenerationCalls:
    """A step's running generation: `rollout` is done when the engines are idle again, `result` when every group is
    scored (a `GenerationResult`); `weights`: the version the engines wait for before generating (None: the one
    they hold); `ahead`: started during an earlier step."""

    rollout: asyncio.Future
    result: asyncio.Future
    weights: int | None = None
    ahead: bool = False


async def _after(previous: asyncio.Future | None, call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, made once `previous` (a call of the step before) is done: a group call goes out when it is made."""
    if previous is not None:
        await asyncio.shield(previous)
    return await call()


class Generation(Protocol):
    runs_ahead: bool  # whether a step's generation can start while the step before runs

    def start(self, step: int, prompts: list[PromptItem], calls: StageCalls, after: GenerationCalls | None = None,
              ahead: bool = False, weights: int | None = None) -> GenerationCalls: ...


async def begin_routing(balancer: Any, step: int) -> None:
    """Before a step's groups are scored: their actor replicas are chosen by tokens afresh (`balancer`, a
    `ReplicaBalancer`; None: by slot, nothing to do)."""
    if balancer is not None:
        await balancer.begin.remote(step)


class PlainGeneration:
    """One rollout call (prompts sharded over the engines) and one scoring call (every reward process) a step."""

    runs_ahead = True

    def __init__(self, rollout: WorkerGroup[RolloutWorker], reward: WorkerGroup[RewardWorker],
                 channels: Callable[[], StepChannels], arrival_slots: Any = None, balancer: Any = None):
        self.rollout, self.reward, self.channels = rollout, reward, channels
        self.arrival_slots, self.balancer = arrival_slots, balancer

    async def _score(self, step: int, ch: StepChannels) -> list[RewardTally]:
        if self.arrival_slots is not None:  # (the step's groups take slots from 0 in the order they are scored)
            await self.arrival_slots.reset.remote()
        await begin_routing(self.balancer, step)
        return await self.reward.all.call(RewardWorker.score_step, step, src=ch.rollouts, dst=ch.reward_output)

    def start(self, step: int, prompts: list[PromptItem], calls: StageCalls, after: GenerationCalls | None = None,
              ahead: bool = False, weights: int | None = None) -> GenerationCalls:
        """Start the step's calls; each follows its counterpart of `after` (the step before, when started ahead).
        With `weights` the engines first wait until they hold that version (its sync may still be loading)."""
        launch = calls.watch if ahead else calls.start
        suffix = "_ahead" if ahead else ""
        ch = self.channels()
        rollout = launch("rollout" + suffix, _after(after.rollout if after else None, lambda: self.rollout.sharded.call(
            RolloutWorker.generate_step, prompts, step, dst=ch.rollouts, weights=weights)))
        scoring = launch("reward" + suffix, _after(after.result if after else None, lambda: self._score(step, ch)))

        async def result() -> GenerationResult:
            return GenerationResult(await scoring)

        results = asyncio.ensure_future(result())
        results.add_done_callback(mark_retrieved)  # (its failure is the scoring call's, which fails the step)
        return GenerationCalls(rollout, results, weights, ahead)


class DynamicSampling:
    """Rounds of rollout and scoring until the step keeps `len(prompts)` groups whose rewards vary, or
    `algorithm.max_extra_rounds` extra rounds are spent (see `rlinf_pipe.workers.dynamic_sampling`). Kept groups
    stream on to the log-prob stage while later rounds generate; every generated group counts in the rewards."""

    runs_ahead = False

    def __init__(self, rollout: WorkerGroup[RolloutWorker], reward: WorkerGroup[RewardWorker],
                 channels: Callable[[], StepChannels], rounds: Any, sampler: PromptSampler, max_extra_rounds: int,
                 balancer: Any = None):
        self.rollout, self.reward, self.channels = rollout, reward, channels
        self.rounds, self.balancer = rounds, balancer
        self.sampler, self.max_extra_rounds = sampler, max_extra_rounds

    async def _run(self, step: int, prompts: list[PromptItem], weights: int | None) -> GenerationResult:
        await self.rounds.reset.remote(len(prompts), self.max_extra_rounds)
        await begin_routing(self.balancer, step)
        result = GenerationResult()
        ch = self.channels()
        while not await self.rounds.done.remote():
            wanted = await self.rounds.start_round.remote()
            round_prompts = prompts if not result.tallies else draw_prompts(self.sampler, wanted)
            _, tallies = await asyncio.gather(
                self.rollout.sharded.call(RolloutWorker.generate_step, round_prompts, step, dst=ch.rollouts,
                                          weights=weights),
                self.reward.all.call(RewardWorker.score_step, step, src=ch.rollouts, dst=ch.reward_output,
                                     end_step=False))
            result.tallies += tallies
        await self.reward.all.call(RewardWorker.end_step, ch.reward_output)
        result.sampling = await self.rounds.metrics.remote()
        return result

    def start(self, step: int, prompts: list[PromptItem], calls: StageCalls, after: GenerationCalls | None = None,
              ahead: bool = False, weights: int | None = None) -> GenerationCalls:
        """Start the rounds; the engines are idle again only when the last round is scored (`rollout` and
        `result` finish together)."""
        if after is not None or ahead:
            raise ValueError("dynamic sampling cannot run a step ahead (runner.max_staleness must be 0)")
        rounds = calls.start("generate", self._run(step, prompts, weights))
        return GenerationCalls(rounds, rounds, weights)


class RolloutSchedule:
    """Where each step's generation comes from (see the module docstring). With `staleness` N, the generations of
    the next N steps are started ahead (each after the one before), so step s trains samples of version s - N or
    later. `sampler_state()` is the sampler's state before the prompts that were drawn ahead, which a checkpoint
    saves so a resume draws them again."""

    def __init__(self, generation: Generation, sampler: PromptSampler, staleness: int, max_steps: int):
        self.generation, self.sampler, self.staleness, self.max_steps = generation, sampler, staleness, max_steps
        self.ahead: deque[GenerationCalls] = deque()
        self.states_before_ahead: deque[dict[str, Any]] = deque()  # the sampler's state before each ahead draw

    async def finish_ahead(self, calls: StageCalls, step: int) -> None:
        """Before step `step`'s weight sync: wait until the engines finished every generation started ahead on an
        older version (the sync must not load under them); every generation started ahead becomes a call of this
        step (a failure fails it)."""
        for i, ahead in enumerate(self.ahead):
            if i == 0:  # this step's generation: its calls are the step's own
                calls.adopt("rollout", ahead.rollout)
                calls.adopt("reward", ahead.result)
            else:  # a later step's: the engines finish it before the sync; its scoring runs on into that step
                calls.adopt(f"rollout_ahead_{i}", ahead.rollout)
                calls.watch(f"reward_ahead_{i}", ahead.result)
        older = self.rollouts_before(step)
        if older:
            await calls.until(*older)

    async def engines_idle(self) -> None:
        """Wait until the engines finished the rollouts started ahead, e.g. before validating."""
        for ahead in list(self.ahead):
            await asyncio.shield(ahead.rollout)

    def rollouts_before(self, version: int) -> list[asyncio.Future]:
        """The rollout calls of the generations started ahead on versions older than `version` (the engines finish
        them before they load it)."""
        return [ahead.rollout for ahead in self.ahead if ahead.weights != version]

    @property
    def starts_next_early(self) -> bool:
        """Whether `start_next` may start the next step's generation during a step (max_staleness 0, a generation
        that can start ahead)."""
        return self.staleness == 0 and self.generation.runs_ahead

    def start_next(self, step: int, calls: StageCalls, current: GenerationCalls) -> None:
        """During step `step - 1` (max_staleness 0, the weights pushed as soon as trained): start step `step`'s
        generation now, after `current` (the running step's), waiting on the engines for version `step`. It is as
        on-policy as if the driver asked for it at the step's start, and the engines begin it as soon as they hold
        the version, with no call from the driver between the steps."""
        if step < self.max_steps:
            self._start_ahead(step, calls, current, weights=step)

    def draw(self) -> list[PromptItem] | None:
        """The prompts of the step about to start, or None when its generation was started ahead: drawn apart from
        `start` so that the driver draws them (tokenising each) while the weights sync."""
        return None if self.ahead else draw_prompts(self.sampler)

    def start(self, step: int, calls: StageCalls, prompts: list[PromptItem] | None,
              weights: int | None = None) -> GenerationCalls:
        """This step's generation (started now on `prompts`, what `draw()` gave, or the oldest started ahead, when
        `draw()` gave None), and the next steps' started ahead up to `staleness` of them. With `weights` (the version
        this step syncs, which may still be loading) the generations started now begin once the engines hold it:
        those started ahead too, so that each uses the newest weights when it begins."""
        if self.ahead:
            current = self.ahead.popleft()
            self.states_before_ahead.popleft()
        elif prompts is None:
            raise ValueError(f"step {step}: no prompts to start its generation on, and none started ahead")
        else:
            current = self.generation.start(step, prompts, calls, weights=weights)
        while len(self.ahead) < self.staleness and step + len(self.ahead) + 1 < self.max_steps:
            self._start_ahead(step + len(self.ahead) + 1, calls, self.ahead[-1] if self.ahead else current, weights)
        return current

    def _start_ahead(self, step: int, calls: StageCalls, after: GenerationCalls, weights: int | None) -> None:
        """Start step `step`'s generation now, after `after`, on prompts drawn now (the sampler's state before them
        kept for a checkpoint)."""
        self.states_before_ahead.append(self.sampler.state_dict())
        self.ahead.append(self.generation.start(step, draw_prompts(self.sampler), calls, after=after, ahead=True,
                                                weights=weights))

    def sampler_state(self) -> dict[str, Any]:
        return self.states_before_ahead[0] if self.states_before_ahead else self.sampler.state_dict()
