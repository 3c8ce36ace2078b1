"""A pushed weight version goes to the actor only once every receiver is idle: a sender that posts its buckets
earlier waits for late receivers inside its collectives, which time out, and on NCCL the timeout ends the actor's
process (torch's watchdog) when engines generating ahead outlast the step's training."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest
from support.local_group import LocalGroup

from rlinf_pipe.planning.weight_routes import WeightRoute
from rlinf_pipe.runner.weight_sync import WeightSync
from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.weights import LoadedWeights, WeightVersion


def fake_group(calls: list[str], name: str, method: str, result) -> LocalGroup:
    async def call(*args):
        calls.append(name)
        return result(args[0])

    return LocalGroup([SimpleNamespace(**{method: call})])


def weight_sync(calls: list[str]) -> WeightSync:
    actor = fake_group(calls, "publish", "publish_weights", lambda version: WeightVersion(version, 64, 2))
    engines = fake_group(calls, "receive", "receive_weights", lambda sent: LoadedWeights(sent.version, 64, 2, 1))
    return WeightSync("broadcast", [WeightRoute(0, (("rollout", 0),))], actor, {"rollout": engines}, verify=False,
                      tracer=Tracer("driver"), actor_phase=lambda version: contextlib.nullcontext(),
                      engines_share_actor=False)


async def turns(n: int = 20) -> None:
    for _ in range(n):  # (let every ready task run: no time passes)
        await asyncio.sleep(0)


async def test_the_actor_is_asked_to_send_only_once_every_receiver_is_idle():
    calls: list[str] = []
    sync = weight_sync(calls)
    assert sync.pushes
    generating_ahead = asyncio.get_running_loop().create_future()
    transfer = sync.push(3, {"rollout": [generating_ahead], "inference": []})
    await turns()
    assert calls == [] and not transfer.done()  # neither end has begun
    generating_ahead.set_result(None)
    assert await transfer == 64.0
    assert sorted(calls) == ["publish", "receive"]
    assert await sync.sync(3) == {"bytes": 64.0}


async def test_a_receiver_call_that_fails_fails_the_push_without_asking_the_actor():
    calls: list[str] = []
    sync = weight_sync(calls)
    generating_ahead = asyncio.get_running_loop().create_future()
    transfer = sync.push(3, {"rollout": [generating_ahead]})
    generating_ahead.set_exception(RuntimeError("the engine failed"))
    with pytest.raises(RuntimeError, match="the engine failed"):
        await transfer
    assert calls == []



async def test_the_after_training_hook_pushes_only_where_the_receivers_load_beside_the_engines():
    """Inference on the engines' GPUs loads there: nothing is pushed, and no generation starts beside a sync."""
    calls: list[str] = []
    sync = weight_sync(calls)
    transfer = sync.after_training(2, {"rollout": []})
    assert transfer is not None and await transfer == 64.0
    shared = weight_sync(calls)
    shared.beside_generation = False
    await shared.sync(1)
    assert shared.after_training(2, {"rollout": []}) is None and not shared.generation_beside()
    assert sync.versions_known() is False and sync.generation_beside() is False  # (no sync yet: the first completes)
