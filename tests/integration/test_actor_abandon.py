"""An ActorWorker group abandoning a step half-way (what a lost worker elsewhere makes the driver do), on a real
local Ray with Megatron on gloo: every rank's call ends (none is left in a collective), `rollback` restores the
state before the step exactly, and the step is then trained again on new channels.

- DP=2: replica 0 has trained its part of mini-batch 1 and waits in the vote before the optimizer step while
  replica 1 waits on its channel for its group; the abandon makes replica 1 vote no, and both end.
- TP=2: the input rank waits on the channel; the abandon makes it share the failure, so rank 1 (waiting for the
  shared op) ends too.
"""

from __future__ import annotations

import sys
import time

import msgspec
import pytest
import ray
import torch
from support.actor_run import make_batch, vocab_size

from rlinf_pipe.config import load_config
from rlinf_pipe.data.routing import TrainRouting
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.errors import WorkerError
from rlinf_pipe.models.tiny import ensure_tiny_model
from rlinf_pipe.channels import Channel
from rlinf_pipe.runtime.cluster import Cluster
from rlinf_pipe.planning.placement import plan_placement
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.workers.actor import ActorWorker
from rlinf_pipe.runner.step_channels import StepChannels

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.slow
GROUPS, MINIBATCHES = 4, 2


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(ensure_tiny_model(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def local_ray():
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(address="local", num_cpus=2, num_gpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def channels(tag: str, replicas: int) -> StepChannels:
    def make(name: str, item: type) -> Channel:
        return Channel.create(f"{tag}-{name}", item, maxsize=None, num_producers=1)

    return StepChannels(make("rollouts", dict), make("scored", dict),
                        [make(f"train-{r}", TrainBatch) for r in range(replicas)])


def put_groups(train: StepChannels, routing: TrainRouting, slots: list[int], vocab: int, end: bool) -> None:
    for slot in slots:
        batch = msgspec.structs.replace(make_batch(slot, 2, vocab), slot=slot)
        train.train[routing.replica_of(slot)].put(batch, weight=batch.num_sequences)
    if end:
        for channel in train.train:
            channel.end_step()


def state_of(worker) -> tuple[dict, list, int]:
    policy = worker.policy
    weights = {k: v.detach().clone() for k, v in policy.module.state_dict().items() if isinstance(v, torch.Tensor)}
    return weights, policy.require_optimizer().state_dict(), policy.step


def spans_named(worker, name: str) -> int:
    return sum(s.name == name for s in worker.tracer._spans)


def wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_an_abandoned_step_ends_on_every_rank_and_rolls_back_exactly(local_ray, model_path, tp):
    cfg = load_config(overrides=[
        f"actor.model_path={model_path}", f"actor.tensor_parallel_size={tp}", "runner.max_restarts=1",
        f"data.rollout_batch_size={GROUPS}", "algorithm.group_size=2", f"algorithm.n_minibatches={MINIBATCHES}",
        "actor.micro_batch_size=8", "cluster.num_gpus_per_node=3", "cluster.ray_address=local",
        "cluster.component_placement={rollout: 0, actor: 1-2}", "algorithm.kl_coef=0",
    ])
    replicas = 2 // tp
    routing, vocab = TrainRouting(GROUPS, MINIBATCHES, replicas), vocab_size(model_path)
    cluster = Cluster(cfg)
    first = channels(f"abandon-tp{tp}-a", replicas)
    actor = WorkerGroup.launch(ActorWorker, "actor", plan_placement(cfg).components["actor"], cluster, cfg,
                               model_path)
    try:
        put_groups(first, routing, list(range(GROUPS)), vocab, end=True)  # step 0, whole
        trained = actor.replicas.call(ActorWorker.train_step, 0, first.train).wait(120)
        assert [len(r.optimizer_steps) for r in trained] == [MINIBATCHES] * replicas
        before = actor.all.call(ActorWorker.run, state_of).wait()  # the state step 1 starts from

        call = actor.all.call(ActorWorker.train_step, 1, first.train)
        if tp == 1:  # mini-batch 0 whole, then replica 0's group of mini-batch 1 (slot 2), not replica 1's (slot 3)
            put_groups(first, routing, [0, 1, 2], vocab, end=False)
            wait_until(lambda: actor.rank(0).call(ActorWorker.run, spans_named, "train").wait() == MINIBATCHES + 2)
            # (rank 1 ends its optimizer step on its own time once their gradients met: not before rank 0 trains on)
            wait_until(lambda: actor.rank(1).call(ActorWorker.run, spans_named, "optimizer_step").wait()
                       == MINIBATCHES + 1)
        else:  # the input rank waits for the step's first group
            wait_until(lambda: actor.rank(0).call(ActorWorker.run, spans_named, "rollback_point").wait() == 2)
        actor.all.call(ActorWorker.abandon_step).wait(30)
        with pytest.raises(WorkerError, match="ChannelClosed|ReplicaInputFailed"):
            call.wait(60)
        assert asyncio_run(actor.settle(30)) == []  # every rank's call ended
        ended = actor.all.call(ActorWorker.run,
                               lambda w: [s.name for s in w.tracer._spans].count("optimizer_step")).wait()
        assert ended == [MINIBATCHES + (1 if tp == 1 else 0)] * 2  # no optimizer step after the abandon

        assert actor.all.call(ActorWorker.rollback, 1).wait() == [True, True]
        for (w0, o0, s0), (w1, o1, s1) in zip(before, actor.all.call(ActorWorker.run, state_of).wait(), strict=True):
            assert s1 == s0 == MINIBATCHES
            for name in w0:
                assert torch.equal(w0[name], w1[name]), name
            for a, b in zip(o0, o1, strict=True):  # fp32 master weights and Adam moments
                for p, q in zip(a["params"], b["params"], strict=True):
                    assert torch.equal(p, q)
                for key, state in a["optimizer"]["state"].items():
                    for n, v in state.items():
                        assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["optimizer"]["state"][key][n])), n

        second = channels(f"abandon-tp{tp}-b", replicas)  # the retry, on new channels
        put_groups(second, routing, list(range(GROUPS)), vocab, end=True)
        actor.all.call(ActorWorker.train_step, 1, second.train).wait(120)
        assert {s for _, _, s in actor.all.call(ActorWorker.run, state_of).wait()} == {2 * MINIBATCHES}
        second.abort()
    finally:
        first.abort()
        actor.shutdown(wait_s=10)
        cluster.shutdown()


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)
