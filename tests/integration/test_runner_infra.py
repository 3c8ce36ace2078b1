"""Runner infrastructure on a real local Ray: device locks, and channel handles passed in every call."""

from __future__ import annotations

import asyncio

import pytest
import ray

from rlinf_pipe.channels import Channel, StepEnd
from rlinf_pipe.runtime.locks import DeviceLocks, DeviceShare, LockRequestDropped


@pytest.fixture(scope="module")
def local_ray():
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def queued(locks, count: int, polls: int = 10_000) -> bool:
    """Whether `count` requests are waiting, polling the lock table (each poll is a round trip)."""
    return any(ray.get(locks.num_waiting.remote()) >= count for _ in range(polls))


def test_device_lock_serialises_owners_first_come_first_served_per_device(local_ray):
    locks = DeviceLocks.remote()
    ray.get(locks.acquire.remote([0, 1], "actor/0"))
    ray.get(locks.acquire.remote([0], "actor/0"))  # re-entrant for the same owner
    waiting = locks.acquire.remote([1], "rollout/0")
    assert queued(locks, 1)  # async actor calls may start out of order: let this one queue first
    behind = locks.acquire.remote([1, 2], "rollout/1")  # device 1 is rollout/0's next: 2 free does not let it pass
    assert queued(locks, 2)
    ray.get(locks.acquire.remote([5], "reward/0"), timeout=30)  # nobody waits for device 5: granted at once
    ready, _ = ray.wait([waiting, behind], timeout=0.3)
    assert ready == [] and ray.get(locks.holders.remote()) == {0: "actor/0", 1: "actor/0", 5: "reward/0"}
    ray.get(locks.release.remote("actor/0"))
    assert ray.get(locks.holders.remote()) == {0: "actor/0", 1: "actor/0", 5: "reward/0"}  # still held once
    ray.get(locks.release.remote("actor/0"))
    ray.get(waiting, timeout=30)
    assert ray.wait([behind], timeout=0.3)[0] == []
    ray.get(locks.release.remote("rollout/0"))
    ray.get(behind, timeout=30)
    assert ray.get(locks.holders.remote()) == {1: "rollout/1", 2: "rollout/1", 5: "reward/0"}


@pytest.mark.parametrize("engine_gpus", [[0], [1], [0, 1]], ids=["tp1-engine-0", "tp1-engine-1", "tp2-engine"])
def test_the_ranks_of_a_gang_never_wait_behind_an_engine_that_waits_for_them(local_ray, engine_gpus):
    """Log-prob replica with TP 2 on GPUs 0-1, taken in turns with the engines (each rank asks for both GPUs under
    the group's gang name). Its rank 0 is granted and waits in a collective for rank 1; an engine asks for GPU 0,
    GPU 1 or both in between. It must not get them before the gang ends, and rank 1 must be granted ahead of it,
    or the ranks wait for each other (or for a whole generation). Once both ranks release, the engine runs, and the
    replica's next group queues behind it."""
    locks = DeviceLocks.remote()
    ray.get(locks.acquire.remote([0, 1], "inference/0", "replica0@1.0"))
    engine = locks.acquire.remote(engine_gpus, "rollout/0")
    assert queued(locks, 1)
    ray.get(locks.acquire.remote([0, 1], "inference/1", "replica0@1.0"), timeout=30)
    assert ray.get(locks.holders.remote()) == {0: "replica0@1.0", 1: "replica0@1.0"}
    ray.get(locks.release.remote("inference/1", "replica0@1.0"))
    assert ray.wait([engine], timeout=0.3)[0] == []  # rank 0 still computes: the gang holds both GPUs
    ray.get(locks.release.remote("inference/0", "replica0@1.0"))
    ray.get(engine, timeout=30)
    after = locks.acquire.remote([0, 1], "inference/1", "replica0@1.1")  # the next group: a new gang, in the queue
    assert queued(locks, 1) and ray.wait([after], timeout=0.3)[0] == []
    ray.get(locks.release.remote("rollout/0"))
    ray.get(after, timeout=30)
    assert ray.get(locks.holders.remote()) == {0: "replica0@1.1", 1: "replica0@1.1"}


def test_a_lost_workers_queued_request_is_dropped_not_granted_later(local_ray):
    """Ray runs a killed caller's request on: granted after the recovery, nobody would release it, and the
    engines would wait for those GPUs forever. `forfeit` drops the lost owner's queued requests, `reset` all."""
    locks = DeviceLocks.remote()
    ray.get(locks.acquire.remote([0], "rollout/0"))
    lost = locks.acquire.remote([0], "inference/0", "replica0@1.0")  # ... and then inference/0 is killed
    survivor = locks.acquire.remote([0], "actor/0")
    assert queued(locks, 2)
    ray.get(locks.forfeit.remote(["inference/0"]))
    with pytest.raises(LockRequestDropped, match="inference/0"):
        ray.get(lost, timeout=30)
    ray.get(locks.release.remote("rollout/0"))
    ray.get(survivor, timeout=30)
    leftover = locks.acquire.remote([0], "inference/1", "replica0@1.0")
    assert queued(locks, 1)
    ray.get(locks.reset.remote())
    with pytest.raises(LockRequestDropped):
        ray.get(leftover, timeout=30)
    assert ray.get(locks.holders.remote()) == {} and ray.get(locks.num_waiting.remote()) == 0


def test_a_device_share_gives_its_devices_back_on_error(local_ray):
    locks = DeviceLocks.remote()

    async def fail_inside():
        async with DeviceShare(locks, ("rollout",)).hold([3], "actor/0"):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(fail_inside())
    assert ray.get(locks.holders.remote()) == {}


def test_a_device_share_runs_its_hooks_while_holding_the_devices(local_ray):
    """An engine wakes once its GPUs are taken and sleeps before they are given back; the inference worker hands
    its cached GPU memory back there, before the engine sharing the GPU can wake."""
    locks = DeviceLocks.remote()
    share = DeviceShare(locks, ("rollout",))
    seen = []

    async def holders(event: str) -> None:
        seen.append((event, await locks.holders.remote()))

    async def compute(fail: bool) -> None:
        async with share.hold([2], "inference/0", after_take=lambda: holders("take"),
                              before_give_back=lambda: holders("give back")):
            if fail:
                raise RuntimeError("boom")

    asyncio.run(compute(False))
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(compute(True))
    assert seen == [("take", {2: "inference/0"}), ("give back", {2: "inference/0"})] * 2
    assert ray.get(locks.holders.remote()) == {}


def test_forfeit_and_reset_free_the_devices_of_owners_that_are_gone(local_ray):
    """A worker lost while holding its devices never releases them: the recovery forfeits what the lost one held
    (whoever waited gets the devices), and once the others settled, resets the table."""
    locks = DeviceLocks.remote()
    ray.get(locks.acquire.remote([0, 1], "rollout/0"))  # ... and then rollout/0 is killed
    ray.get(locks.acquire.remote([2], "inference/0"))
    waiting = locks.acquire.remote([0], "actor/0")
    assert queued(locks, 1)
    ray.get(locks.forfeit.remote(["rollout/0"]))
    ray.get(waiting, timeout=30)
    assert ray.get(locks.holders.remote()) == {0: "actor/0", 2: "inference/0"}
    ray.get(locks.acquire.remote([4], "inference/0", "replica0@2.0"))  # a gang loses one of its ranks
    ray.get(locks.acquire.remote([5], "inference/1", "replica0@2.0"))
    ray.get(locks.forfeit.remote(["inference/1"]))
    assert ray.get(locks.holders.remote()) == {0: "actor/0", 2: "inference/0"}
    ray.get(locks.reset.remote())
    assert ray.get(locks.holders.remote()) == {}


@ray.remote
class StepProducer:
    def produce(self, channel: Channel, step: int, count: int) -> int:
        for i in range(count):
            channel.put({"step": step, "i": i})
        channel.end_step()
        return step


def test_channel_passed_in_every_call_keeps_one_producer(local_ray):
    """A worker that receives the channel anew in each call must stay ONE producer (its step count lives in its
    producing end); otherwise the consumer would wait forever for step 1."""
    channel = Channel.create("per-call", dict, num_producers=1)
    producer = StepProducer.remote()
    for step in range(3):
        ray.get(producer.produce.remote(channel, step, 2))
        got = []
        while not isinstance(item := channel.get(timeout=30), StepEnd):
            got.append(item)
        assert [g["step"] for g in got] == [step, step] and item == StepEnd(step)


def test_the_step_channels_get_the_configured_shared_memory_and_encryption(local_ray):
    """`runner.channel_shared_mb` reaches every step channel's spec (0: sockets only), beside the unbounded
    buffering of a collocated run, and so does `runner.channel_encryption`; every spec carries the run's key."""
    from rlinf_pipe.config import load_config
    from rlinf_pipe.runner.step_channels import create_channels
    from rlinf_pipe.planning.run_plan import plan_run

    default = create_channels(plan_run(load_config()))
    try:
        assert {(ch.spec.shared_bytes, ch.spec.encrypt) for ch in default.train} == {(64 * 1024 * 1024, False)}
        key = default.train[0].spec.key
    finally:
        default.abort()
    plan = plan_run(load_config(overrides=[
        "runner.channel_shared_mb=0", 'cluster.component_placement={"actor,rollout": all}',
        "algorithm.compute_ref_logprobs=true", "runner.channel_encryption=true",
    ]))
    channels = create_channels(plan)
    try:
        specs = [channels.rollouts.spec, channels.scored.spec, *(ch.spec for ch in channels.train)]
        assert {(spec.shared_bytes, spec.maxsize, spec.encrypt, spec.key) for spec in specs} == {(0, None, True, key)}
        assert key is not None
    finally:
        channels.abort()
