"""`WeightInbox.wait_for`: a step's generation asked for while its weights still sync starts once they are loaded,
and fails (instead of generating with the old weights, or waiting forever) when that sync fails or the step is
abandoned, without failing a retried step's wait. The actor's send of a version asked for while it trains
(`VersionWait`) follows the same rules."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import pytest

from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.weights import LoadedWeights, WeightReceiver, WeightSyncError, WeightVersion
from rlinf_pipe.workers.version_wait import VersionWait
from rlinf_pipe.workers.weight_inbox import WeightInbox


class GatedReceiver(WeightReceiver):
    """Receives once the test opens its gate; fails when told to."""

    transport = "test"

    def __init__(self) -> None:
        self.gate: asyncio.Event | None = None
        self.fail = False

    async def receive(self, published, load_bucket, verify=False):
        await self.gate.wait()
        if self.fail:
            raise WeightSyncError("the sender is gone")
        await load_bucket([])
        return LoadedWeights(published.version, 0, 0, 0)


class Model:
    def __init__(self) -> None:
        self.version = 0

    @contextlib.asynccontextmanager
    async def session(self, version: int):
        yield lambda bucket: asyncio.sleep(0)
        self.version = version


def _inbox() -> tuple[WeightInbox, GatedReceiver, Model]:
    inbox = WeightInbox("rollout/0", None, Tracer("rollout/0"))
    inbox.receiver = receiver = GatedReceiver()
    return inbox, receiver, Model()


async def abandon_ends(wait: Any, cancel: Any) -> None:
    """`wait` (waiting for a version nothing makes) ends with "abandoned" once `cancel` runs: from another thread,
    as the driver's abandon call does."""
    waiting = asyncio.ensure_future(wait)
    await asyncio.sleep(0)
    abandon = threading.Thread(target=cancel)
    abandon.start()
    with pytest.raises(WeightSyncError, match="abandoned"):
        await waiting
    abandon.join()


def test_a_generation_waits_for_the_version_being_loaded():
    inbox, receiver, model = _inbox()

    async def run() -> list[str]:
        receiver.gate = asyncio.Event()
        order: list[str] = []

        async def generate() -> None:
            await inbox.wait_for(1, lambda: model.version)
            order.append(f"generate with version {model.version}")

        waiting = asyncio.ensure_future(generate())  # asked for before the sync even started
        receiving = asyncio.ensure_future(inbox.receive(WeightVersion(1), model.version, model.session, False))
        await asyncio.sleep(0)
        order.append("loaded" if model.version == 1 else "not loaded yet")
        receiver.gate.set()
        await asyncio.gather(receiving, waiting)
        await inbox.wait_for(1, lambda: model.version)  # held already: returns at once
        return order

    assert asyncio.run(run()) == ["not loaded yet", "generate with version 1"]


def test_a_failed_sync_fails_the_wait_and_an_abandon_ends_it_but_not_the_retry():
    inbox, receiver, model = _inbox()

    async def run() -> None:
        receiver.gate, receiver.fail = asyncio.Event(), True
        waiting = asyncio.ensure_future(inbox.wait_for(1, lambda: model.version))
        receiving = asyncio.ensure_future(inbox.receive(WeightVersion(1), model.version, model.session, False))
        receiver.gate.set()
        with pytest.raises(WeightSyncError, match="the sender is gone"):
            await receiving
        with pytest.raises(WeightSyncError, match="version 1 did not load: WeightSyncError: the sender is gone"):
            await waiting

        # Abandoned: a wait with no sync coming ends.
        await abandon_ends(inbox.wait_for(2, lambda: model.version), inbox.cancel)

        # The retried step: its wait does not trip over the failure before, and its sync loads.
        receiver.gate, receiver.fail = asyncio.Event(), False
        waiting = asyncio.ensure_future(inbox.wait_for(1, lambda: model.version))
        await asyncio.sleep(0)
        assert not waiting.done()
        receiver.gate.set()
        await inbox.receive(WeightVersion(1), model.version, model.session, False)
        await waiting
        assert model.version == 1

    asyncio.run(run())


def test_a_receive_asked_for_ahead_spans_only_the_loading_and_records_its_wait():
    """A pushed version's receive is asked for before the sender sends: its `weight_sync` span starts when the bytes
    arrive (the timeline shows the engine idle, not syncing, while the actor trains), and says how long it
    waited."""
    inbox, receiver, model = _inbox()

    async def run() -> float:
        receiver.gate = asyncio.Event()
        receiving = asyncio.ensure_future(inbox.receive(WeightVersion(1), model.version, model.session, False))
        await asyncio.sleep(0)  # (the receive is posted and waits at the gate)
        opened = time.time()
        receiver.gate.set()
        await receiving
        return opened

    opened = asyncio.run(run())
    (span,) = inbox.tracer.drain()
    assert span.name == "weight_sync" and span.args["version"] == 1 and span.start >= opened
    assert 0 < span.args["waited_s"] and span.start - span.args["waited_s"] <= opened  # (posted before the gate)


def test_a_send_asked_for_during_training_waits_for_it_and_fails_with_it():
    """The actor's send of version s + 1 is asked for while step s trains (`VersionWait` with the verb "train"):
    it goes out once the step trained the version; a failed step fails it, naming why; an abandoned step ends it."""
    trained = VersionWait("actor/0", "train")
    holder = Model()

    async def run() -> None:
        waiting = asyncio.ensure_future(trained.wait_for(1, lambda: holder.version))
        await asyncio.sleep(0)
        assert not waiting.done()
        with trained.making(1):
            holder.version = 1
        await waiting
        waiting = asyncio.ensure_future(trained.wait_for(2, lambda: holder.version))
        with pytest.raises(ValueError), trained.making(2):
            raise ValueError("a replica failed")
        with pytest.raises(WeightSyncError, match="version 2 did not train: ValueError: a replica failed"):
            await waiting
        await abandon_ends(trained.wait_for(3, lambda: holder.version), trained.cancel)

    asyncio.run(run())
