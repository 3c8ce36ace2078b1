"""A step's calls failing together (`StageCalls`, `PlainGeneration`, `Step`): the step raises the first failure, and the
others, dropped with the abandoned step, log nothing ("exception was never retrieved" with a traceback, printed
once they are collected, long after the runner handled the loss)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable
from types import SimpleNamespace

from support.local_group import LocalGroup

from rlinf_pipe.runner.generation import PlainGeneration
from rlinf_pipe.runner.stage_calls import StageCalls


def unseen_failures() -> list[str]:
    """Collect this loop's unretrieved-failure reports (call before the tasks exist)."""
    reports: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: reports.append(context["message"]))
    return reports


async def failure(call: Awaitable[None]) -> str:
    """The RuntimeError `call` raises, as text (pytest.raises would keep its traceback, and with it every task the
    step's frames hold, out of the garbage collector's reach)."""
    try:
        await call
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("the step did not fail")


async def fail(why: str, after: asyncio.Event | None = None) -> None:
    if after is not None:
        await after.wait()
    raise RuntimeError(why)


async def test_stage_calls_failing_together_raise_the_first_and_leave_none_unseen():
    reports = unseen_failures()
    calls = StageCalls()
    first, second = calls.start("rollout", fail("engine lost")), calls.start("reward", fail("reward lost"))
    later_event = asyncio.Event()
    later = calls.watch("reward_ahead", fail("scoring ahead lost", after=later_event))
    await asyncio.wait({first, second})  # both failed before the step looks
    assert await failure(calls.until_all()) in ("engine lost", "reward lost")
    await asyncio.wait({later})
    assert later.cancelled()  # (the step's other calls go with it)
    del calls, first, second, later
    gc.collect()
    assert reports == []


async def test_an_abandoned_step_still_reports_a_failure_nobody_retrieved_elsewhere():
    """The handler does catch what is not marked (the test above could not pass by accident)."""
    reports = unseen_failures()
    task = asyncio.ensure_future(fail("nobody looks"))
    await asyncio.wait({task})
    del task
    gc.collect()
    assert reports == ["Task exception was never retrieved"]


async def test_a_generation_whose_scoring_fails_leaves_its_result_unseen_without_a_report():
    reports = unseen_failures()
    rollout = LocalGroup([SimpleNamespace(generate_step=lambda prompts, step, dst, weights: asyncio.sleep(0))])
    reward = LocalGroup([SimpleNamespace(score_step=lambda step, src, dst: fail("reward worker lost"))])
    calls = StageCalls()
    channels = SimpleNamespace(rollouts="rollouts", reward_output="scored")
    started = PlainGeneration(rollout, reward, lambda: channels).start(0, [], calls)
    assert await failure(calls.until_all()) == "reward worker lost"
    await asyncio.wait({started.result})
    del calls, started
    gc.collect()
    assert reports == []


async def test_a_call_watched_into_the_next_step_that_never_starts_is_dropped_without_a_report():
    """Step s started step s+1's generation; a lost worker relaunched everything before step s+1 adopted it."""
    reports = unseen_failures()
    calls = StageCalls()
    lost = asyncio.Event()
    ahead = calls.watch("rollout_ahead", fail("engine lost", after=lost))
    calls.start("train", asyncio.sleep(0))
    await calls.until_all()  # (the watched call is not waited for)
    lost.set()  # it fails after step s ended
    await asyncio.wait({ahead})
    assert ahead.done() and not ahead.cancelled()  # (failed; asking its exception here would mark it seen)
    del calls, ahead
    gc.collect()
    assert reports == []


async def test_a_step_abandoned_outside_its_calls_cancels_them_and_leaves_none_unseen():
    """The heartbeat found a lost worker while the step waited for the actor's GPUs, not on its calls: the step is
    cancelled there, and its generation call, which fails later (the engine was the lost worker), goes with it."""
    from contextlib import asynccontextmanager

    from rlinf_pipe.runner.generation import GenerationCalls
    from rlinf_pipe.runner.steps import Step

    reports = unseen_failures()
    lost, waiting = asyncio.Event(), asyncio.Event()
    started: list[asyncio.Future] = []

    async def synced(version: int) -> dict[str, float]:
        return {}

    async def nothing(calls: StageCalls, step: int) -> None:
        return None

    def start(step: int, calls: StageCalls, prompts: list, weights: int) -> GenerationCalls:
        rollout = calls.start("rollout", fail("engine lost", after=lost))
        started.append(rollout)
        return GenerationCalls(rollout, asyncio.ensure_future(asyncio.sleep(0)), weights)

    @asynccontextmanager
    async def actor_phase(step: int):
        waiting.set()
        await asyncio.Event().wait()  # (the GPUs never come)
        yield

    weights = SimpleNamespace(generation_beside=lambda: True, sync=synced)
    schedule = SimpleNamespace(finish_ahead=nothing, draw=list, start=start)
    step = Step(weights, schedule, lambda: SimpleNamespace(), None, None, actor_phase, False, 2)  # type: ignore[arg-type]
    running = asyncio.ensure_future(step.run(0))
    await waiting.wait()
    running.cancel()
    await asyncio.wait({running})
    lost.set()
    (rollout,) = started
    await asyncio.wait({rollout})
    assert running.cancelled() and rollout.cancelled()
    del running, rollout, started, step
    gc.collect()
    assert reports == []
