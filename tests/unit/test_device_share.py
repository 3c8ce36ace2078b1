"""`DeviceShare` where a component's GPUs are its own: every hold, take and give-back does nothing, and the hooks that
wake or put an engine to sleep never run (no Ray: a share alone talks to no lock table)."""

import asyncio
import pickle

import pytest

from rlinf_pipe.runtime.locks import DeviceShare, device_shares


def test_a_share_alone_holds_without_a_lock_table_and_runs_no_hooks():
    calls = []

    async def hook() -> None:
        calls.append("hook")

    async def run() -> None:
        share = DeviceShare()
        async with share.hold([0, 1], "rollout/0", after_take=hook, before_give_back=hook):
            calls.append("inside")
        await share.take([0], "actor/0")
        await share.give_back("actor/0")
        await share.forfeit(["actor/0"])
        await share.reset()

    asyncio.run(run())
    assert calls == ["inside"] and not DeviceShare().in_turns


def test_a_share_alone_still_raises_what_its_block_raises():
    async def run() -> None:
        async with DeviceShare().hold([0], "rollout/0"):
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        asyncio.run(run())


def test_each_component_taking_turns_gets_a_share_of_the_one_table():
    table = object()
    shares = device_shares({"rollout": ("actor", "inference"), "actor": ("rollout",)}, table)
    assert {name: (s.locks is table, s.turns_with, s.in_turns) for name, s in shares.items()} == {
        "rollout": (True, ("actor", "inference"), True), "actor": (True, ("rollout",), True)}
    assert pickle.loads(pickle.dumps(DeviceShare(None, ("actor",)))) == DeviceShare(None, ("actor",))
