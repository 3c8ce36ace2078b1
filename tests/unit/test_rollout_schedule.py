"""`RolloutSchedule` with a recording stand-in for the generation: how many steps run ahead, in which order, after
which, and which sampler state a checkpoint saves (no Ray: the driver-side logic only)."""

from __future__ import annotations

import asyncio

import pytest

from rlinf_pipe.data.arithmetic import ArithmeticDataset
from rlinf_pipe.data.sampler import PromptSampler
from rlinf_pipe.runner.generation import GenerationCalls, GenerationResult, RolloutSchedule
from rlinf_pipe.runner.stage_calls import StageCalls


class RecordingGeneration:
    """Starts nothing: records each start (step, first prompt, ahead, which generation it follows) and the weight
    version it waits for."""

    runs_ahead = True

    def __init__(self) -> None:
        self.started: list[tuple[int, str, bool, int | None]] = []
        self.weights: dict[int, int | None] = {}
        self.calls: dict[int, GenerationCalls] = {}

    def start(self, step, prompts, calls, after=None, ahead=False, weights=None) -> GenerationCalls:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        done.set_result(GenerationResult())
        follows = next((s for s, c in self.calls.items() if c is after), None)
        self.started.append((step, prompts[0].id, ahead, follows))
        self.weights[step] = weights
        self.calls[step] = GenerationCalls(loop.create_future(), done, weights)  # (the rollout ends in `finish`)
        return self.calls[step]

    def finish(self, step: int) -> None:
        """The engines are done with step `step`'s generation."""
        self.calls[step].rollout.set_result(None)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_n_steps_start_ahead_each_after_the_one_before_and_resume_redraws_them(staleness):
    max_steps = 6
    sampler = PromptSampler(ArithmeticDataset(), batch_size=2, seed=1)
    generation = RecordingGeneration()
    schedule = RolloutSchedule(generation, sampler, staleness, max_steps)
    plain = PromptSampler(ArithmeticDataset(), batch_size=2, seed=1)
    batches = [plain.next_batch()[0].id for _ in range(max_steps)]  # step k's first prompt without running ahead

    async def steps() -> list[dict]:
        states = []
        for step in range(max_steps):
            calls = StageCalls()
            await schedule.finish_ahead(calls, step)
            prompts = schedule.draw()  # as a step does while the weights sync; None when started ahead
            assert (prompts is None) == bool(schedule.ahead)
            current = schedule.start(step, calls, prompts, weights=step)  # the version this step syncs
            assert current is generation.calls[step]  # a step always trains its own generation
            assert len(schedule.ahead) == min(staleness, max_steps - 1 - step)
            states.append(schedule.sampler_state())
            for started in range(step + 1 + len(schedule.ahead)):  # (those ahead finish before the next sync)
                if not generation.calls[started].rollout.done():
                    generation.finish(started)
            await calls.until_all()
        return states

    states = asyncio.run(steps())
    assert [s for s, _, _, _ in generation.started] == list(range(max_steps))  # in step order
    assert [p for _, p, _, _ in generation.started] == batches  # the data order is that of staleness 0
    for step, _, ahead, follows in generation.started:
        assert ahead == (step > 0 and staleness > 0)
        assert follows == (step - 1 if ahead else None)  # each ahead generation follows the step before
        # ... and waits for the version synced by the step that started it: its own, or up to `staleness` behind
        assert generation.weights[step] == (max(0, step - staleness) if ahead else step)
    # A checkpoint after step k's start saves the state before the prompts drawn ahead: a resume draws them again.
    for step, state in enumerate(states[:-1]):
        resumed = PromptSampler(ArithmeticDataset(), batch_size=2, seed=1)
        resumed.load_state_dict(state)
        assert resumed.next_batch()[0].id == batches[step + 1]


def test_at_staleness_0_the_next_step_starts_in_the_step_before_on_its_own_version():
    """With the weights pushed as soon as trained, step s + 1's generation is started during step s
    (`start_next`): it follows step s's, waits for version s + 1 (so it is as on-policy as at staleness 0), is not
    waited for before step s + 1's sync (that sync moves the very version it waits for), and a checkpoint taken
    meanwhile saves the sampler's state before its prompts."""
    max_steps = 4
    sampler = PromptSampler(ArithmeticDataset(), batch_size=2, seed=1)
    generation = RecordingGeneration()
    schedule = RolloutSchedule(generation, sampler, 0, max_steps)
    plain = PromptSampler(ArithmeticDataset(), batch_size=2, seed=1)
    batches = [plain.next_batch()[0].id for _ in range(max_steps)]
    assert schedule.starts_next_early

    async def steps() -> list[dict]:
        states = []
        for step in range(max_steps):
            calls = StageCalls()
            assert schedule.rollouts_before(step) == []  # the early generation waits for this step's version
            await schedule.finish_ahead(calls, step)  # (its rollout still runs: waiting for it would hang)
            current = schedule.start(step, calls, schedule.draw(), weights=step)
            assert current is generation.calls[step] and not schedule.ahead
            schedule.start_next(step + 1, calls, current)  # while the step trains
            assert len(schedule.ahead) == (1 if step + 1 < max_steps else 0)
            assert schedule.rollouts_before(step + 1) == []  # the push of version step + 1 does not wait for it
            states.append(schedule.sampler_state())
            generation.finish(step)
            await calls.until_all()
        return states

    states = asyncio.run(steps())
    assert [p for _, p, _, _ in generation.started] == batches  # the data order of staleness 0
    for step, _, ahead, follows in generation.started:
        assert (ahead, follows, generation.weights[step]) == ((step > 0), (step - 1 if step else None), step)
    for step, state in enumerate(states[:-1]):  # a checkpoint after step k: the resume draws step k + 1 again
        resumed = PromptSampler(ArithmeticDataset(), batch_size=2, seed=1)
        resumed.load_state_dict(state)
        assert resumed.next_batch()[0].id == batches[step + 1]
