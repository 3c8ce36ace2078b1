"""Two ways a request's life in sglang 0.5.23's tokenizer manager bites the adapter, against the CPU stand-in
(tests/support/sglang_standin): an abort that arrives before the request reached the scheduler is dropped (the
sample would run to `max_new_tokens`), and the model-update lock a request holds until its generator goes past its
result (a generator left for the garbage collector holds back every weight update while anything refers to it)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import sglang_standin

from rlinf_pipe.engines.rollout import GenerateRequest, GenerateResult, SamplingParams
from rlinf_pipe.engines.rollout.sglang_engine import SGLangEngine
from rlinf_pipe.models.tiny import ensure_tiny_model

PROMPT = [40, 41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models"), arch="qwen2")


def make_engine(path: Path) -> SGLangEngine:
    return SGLangEngine(path, dtype="float32", sglang=sglang_standin)


def req(rid: str, max_new_tokens: int, n: int = 1) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=PROMPT,
                           sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, n=n))


async def run(engine: SGLangEngine, requests: list[GenerateRequest]) -> dict[str, GenerateResult]:
    return {r.request_id: r async for r in engine.generate(requests)}


async def until(condition: Any) -> None:
    """Let the loop run until `condition()` holds (each turn lets the stand-in's tasks move)."""
    while not condition():
        await asyncio.sleep(0)


async def test_an_abort_before_the_request_reached_the_scheduler_still_ends_it(model_path: Path) -> None:
    """sglang registers a request, then tokenises it and waits for the model-update lock before it sends it; an
    abort meanwhile goes to a scheduler that does not hold it and is dropped, and sglang sends no second abort for
    it. The adapter's abort waits until the request was sent."""
    engine = make_engine(model_path)
    tm = engine.engine.tokenizer_manager
    tm.dispatch_gate = asyncio.Event()  # requests stay registered, not yet sent (as while being tokenised)
    generating = asyncio.ensure_future(run(engine, [req("held", 300, n=2)]))
    await until(lambda: len(tm.rid_to_state) == 2)
    engine.abort()
    tm.dispatch_gate.set()
    samples = (await asyncio.wait_for(generating, 60))["held"].samples
    assert [s.finish_reason for s in samples] == ["abort", "abort"]
    assert all(len(s.response_ids) < 300 for s in samples)
    # a consumer that stops early aborts what it left the same way (the generator's cleanup waits for it)
    scheduler = engine.engine.scheduler
    tm.dispatch_gate = asyncio.Event()
    gen = engine.generate([req("long", 300)])
    first = asyncio.ensure_future(gen.__anext__())
    await until(lambda: len(tm.rid_to_state) == 1)
    first.cancel()  # the consumer stops: the adapter aborts the sample it asked for
    await until(lambda: engine._aborts.waiting or any(s.abort_sent for s in tm.rid_to_state.values()))
    iterations = scheduler.iterations
    tm.dispatch_gate.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(first, 60)
    assert scheduler.iterations - iterations < 300 and not tm.rid_to_state  # aborted once sent, not run out


async def test_a_finished_sample_holds_no_model_update_lock(model_path: Path) -> None:
    """sglang's generator holds the model-update lock as a reader until it goes past its result; `Engine.
    async_generate` leaves it suspended there, to be finalised when collected. Here nothing finalises it (as
    when a reference to it outlives the call): a weight update must still get the lock."""
    engine = make_engine(model_path)
    left: list[Any] = []
    hooks = sys.get_asyncgen_hooks()
    sys.set_asyncgen_hooks(finalizer=left.append)  # generators dropped unfinished are kept, not finalised
    try:
        results = await run(engine, [req("a", 3), req("b", 5)])
    finally:
        sys.set_asyncgen_hooks(*hooks)
    assert sorted(results) == ["a", "b"] and not left
    assert engine.engine.tokenizer_manager.model_update_lock.readers == 0
    weights = [(k, v.detach().clone()) for k, v in engine.engine.scheduler.model.state_dict().items()]
    await asyncio.wait_for(engine.update_weights(weights, version=1), 60)
    assert engine.version == 1
