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
        self.calls[step] = GenerationCalls(done, done)
        return self.calls[step]


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
            await schedule.finish_ahead(calls)
            prompts = schedule.draw()  # as a step does while the weights sync; None when started ahead
            assert (prompts is None) == bool(schedule.ahead)
            current = schedule.start(step, calls, prompts, weights=step)  # the version this step syncs
            assert current is generation.calls[step]  # a step always trains its own generation
            assert len(schedule.ahead) == min(staleness, max_steps - 1 - step)
            states.append(schedule.sampler_state())
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
