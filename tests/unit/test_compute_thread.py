"""`ComputeThread`: every call on one thread, with its intra-op thread count; how the CPU shares are worked out
from the placement (`cpu_share`, `node_procs`) and lent within a step (`CpuLending`)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest
import torch
from support.local_group import LocalGroup

from rlinf_pipe.config import load_config
from rlinf_pipe.runner.cpu_shares import CpuLending, cpu_stages, node_procs
from rlinf_pipe.planning.placement import ComponentPlacement, ProcessPlacement
from rlinf_pipe.runtime.worker import cpu_share, node_procs_env, read_node_procs
from rlinf_pipe.utils.compute_thread import ComputeThread

WHO = contextvars.ContextVar("who", default="nobody")


def test_calls_run_on_one_thread_with_its_thread_count_and_the_callers_context():
    compute = ComputeThread(threads=2)
    seen: list[tuple[int, int, str]] = []

    def probe() -> int:
        seen.append((threading.get_ident(), torch.get_num_threads(), WHO.get()))
        return len(seen)

    async def calls() -> list[int]:
        WHO.set("caller")
        results = [await compute.run(probe)]
        results += await asyncio.gather(*(asyncio.to_thread(compute.call, probe) for _ in range(4)))
        return results

    try:
        assert sorted(asyncio.run(calls())) == [1, 2, 3, 4, 5]
        assert len({ident for ident, _, _ in seen}) == 1 and seen[0][0] != threading.get_ident()
        assert {threads for _, threads, _ in seen} == {2}
        assert {who for _, _, who in seen} == {"caller"}
        compute.threads = 1  # a new share applies from the next call on
        assert compute.call(torch.get_num_threads) == 1
    finally:
        compute.close()


def test_a_nested_call_runs_inline_and_errors_reach_the_caller():
    compute = ComputeThread()

    def outer() -> int:
        return compute.call(lambda: threading.get_ident()) + 0 * compute.call(int)

    def fail() -> None:
        raise ValueError("bad batch")

    try:
        assert compute.call(outer) == compute.ident  # no deadlock: the inner call did not queue behind the outer
        with pytest.raises(ValueError, match="bad batch"):
            asyncio.run(compute.run(fail))
    finally:
        compute.close()
    with pytest.raises(ValueError, match="threads"):
        ComputeThread(threads=0)


def _placement(name: str, procs: list[tuple[int, tuple[int, ...]]]) -> ComponentPlacement:
    processes = tuple(ProcessPlacement(rank, node, gpus, gpus) for rank, (node, gpus) in enumerate(procs))
    return ComponentPlacement(name, name, tuple(g for _, gs in procs for g in gs), 1, 1, processes)


def test_processes_on_the_same_gpus_take_turns_and_count_once():
    rollout = _placement("rollout", [(0, (0,)), (0, (1,)), (1, (4,))])
    actor = _placement("actor", [(0, (0,)), (0, (1,)), (1, (4,)), (1, (5,))])  # collocated with the rollout
    inference = _placement("inference", [(1, (6,))])
    assert node_procs([rollout, actor, inference]) == {0: 2, 1: 3}
    assert node_procs([_placement("reward", [(0, ()), (0, ())])]) == {0: 2}  # without GPUs: one each


def test_log_prob_workers_share_cpus_only_when_they_compute_something():
    assert cpu_stages(load_config()) == ("rollout", "actor")  # old log-probs the policy's own, no reference model
    for override in ("algorithm.compute_ref_logprobs=true", "algorithm.n_minibatches=2", "algorithm.kl_coef=0.1"):
        assert cpu_stages(load_config(overrides=[override])) == ("rollout", "inference", "actor"), override


def test_cpu_share_divides_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert [cpu_share({0: n}, 0) for n in (1, 2, 3, 8, 9)] == [8, 4, 2, 1, 1]
    assert cpu_share({}, 0) == 1 and cpu_share({1: 2}, 0) == 1  # unknown node: one thread
    monkeypatch.setenv("RLINF_PIPE_NODE_PROCS", node_procs_env({0: 3, 1: 2})["RLINF_PIPE_NODE_PROCS"])
    assert read_node_procs() == {0: 3, 1: 2}


class _Group(LocalGroup):
    """A stand-in for a `WorkerGroup` of one rank, itself: its placement, and the `share_cpus` calls it received."""

    def __init__(self, placement: ComponentPlacement):
        super().__init__([self], placement)
        self.received: list[dict[int, int]] = []

    def share_cpus(self, procs: dict[int, int]) -> None:
        self.received.append(procs)


def test_a_finished_stage_lends_its_cpus_to_the_stages_still_working_on_its_node():
    rollout, inference, actor = (_Group(_placement(n, [(0, (g,))])) for n, g in
                                 (("rollout", 0), ("inference", 1), ("actor", 2)))
    lending = CpuLending({"rollout": rollout, "inference": inference, "actor": actor})
    lending.start_step()  # the placement's shares already hold: no call
    assert rollout.received == inference.received == actor.received == []
    lending.done("rollout")
    assert inference.received == actor.received == [{0: 2}] and rollout.received == []
    lending.done("rollout")  # once per step
    lending.done("inference")
    assert actor.received == [{0: 2}, {0: 1}] and len(inference.received) == 1
    lending.start_step()  # back to the placement's shares, for every stage
    assert rollout.received == [{0: 3}] and inference.received[-1] == actor.received[-1] == {0: 3}
