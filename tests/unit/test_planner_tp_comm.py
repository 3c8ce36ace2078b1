"""Tensor-parallel all-reduces counted apart where a hop is slow (`planning/tp_comm.py`), by hand."""

from __future__ import annotations

import pytest
from test_planner_simulate import costs, predict

from rlinf_pipe.planning.tp_comm import TpShape, allreduce_s, extra_tp_hops, extra_tp_s


def test_a_ring_all_reduce_pays_two_hops_per_extra_rank_and_a_pass_its_layers_all_reduces():
    slow = costs(collective_s=0.001, collective_bytes_per_s=1e30)  # (latency only)
    assert allreduce_s(slow, 1, 1e6) == 0.0
    assert allreduce_s(slow, 2, 1e6) == pytest.approx(0.002) and allreduce_s(slow, 4, 1e6) == pytest.approx(0.006)
    # bandwidth only: 1,000 values of 2 bytes, of which a ring sends 2 (tp - 1) / tp, at 1,000 bytes/s
    assert allreduce_s(costs(collective_s=0.0, collective_bytes_per_s=1000.0), 2, 1000) == pytest.approx(2.0)
    shape = TpShape(layers=2, hidden=64)
    # a training pass: 4 all-reduces a layer, 2 layers, 2 ms each at TP 2
    assert extra_tp_s(slow, shape, "train", 100, 2, 1) == pytest.approx(0.016)
    assert extra_tp_s(slow, shape, "logprob", 100, 2, 1) == pytest.approx(0.008)
    assert extra_tp_s(slow, shape, "train", 100, 2, 2) == 0.0  # (the profile's rate holds them)
    assert extra_tp_s(slow, shape, "train", 100, 1, 2) == pytest.approx(-0.016)
    assert extra_tp_s(costs(collective_s=2e-5), shape, "train", 100, 2, 1) == 0.0  # (a GPU's hop: not counted)
    # a TP all-reduce's own hop, where a run at TP 2 measured it, in place of the other collectives' hop
    assert extra_tp_s(costs(collective_s=2e-5, tp_hop_s=0.003, collective_bytes_per_s=1e30), shape, "train", 100, 2,
                      1) == pytest.approx(0.048)
    assert extra_tp_s(slow, shape, "train", 100, 2, 1, hop=0.0) == pytest.approx(0.0, abs=1e-20)  # (bytes alone)
    assert extra_tp_hops(shape, "train", 2, 1) == 16 and extra_tp_hops(shape, "logprob", 4, 2) == 16


def test_a_tensor_parallel_actor_pays_its_all_reduces_on_each_training_pass():
    # The tiny model (2 layers): a TP-2 actor beside the engines trains 2 passes (a group each); each pays 4 x 2
    # all-reduces of 2 hops of 10 ms: 0.16 s, 0.32 s a step.
    tp2 = ("cluster.num_gpus_per_node=2", 'cluster.component_placement={"actor,rollout": all}',
           "actor.tensor_parallel_size=2")
    slow = predict(costs(collective_s=0.01, collective_bytes_per_s=1e30), *tp2).step_s
    fast = predict(costs(collective_s=0.0, collective_bytes_per_s=1e30), *tp2).step_s
    assert slow - fast == pytest.approx(0.32)
    one = ("cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": all}')  # (TP 1: none)
    assert predict(costs(collective_s=0.01), *one).step_s == predict(costs(collective_s=0.0), *one).step_s


def test_a_log_prob_pass_of_a_replica_over_several_gpus_waits_for_its_input_to_be_shared():
    # The TP-2 actor computes reference log-probs: each of its 2 passes (a group each) first shares its group among
    # its ranks, 10 ms; a TP-1 actor's passes do not wait so.
    tp2 = ("cluster.num_gpus_per_node=2", 'cluster.component_placement={"actor,rollout": all}',
           "actor.tensor_parallel_size=2", "algorithm.compute_ref_logprobs=true")
    shared, plain = (predict(costs(share_s=s), *tp2).step_s for s in (0.01, 0.0))
    assert shared - plain == pytest.approx(0.02)
    one = ("cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": all}',
           "algorithm.compute_ref_logprobs=true")
    assert predict(costs(share_s=0.01), *one).step_s == predict(costs(), *one).step_s


def test_pipeline_stages_add_no_throughput_to_a_streaming_pass():
    # The actor's passes send one micro-batch through the stages one after the other: an actor of PP 2 on GPUs 1-2
    # trains as fast as one of PP 1 on GPU 1 (each stage holds half the model, and they take turns).
    from rlinf_pipe.planning.costs import Parallel

    c = costs()
    assert c.train_rate(Parallel(pp=2)) == c.train_rate(Parallel())
    assert c.logprob_rate(Parallel(tp=2, pp=4)) == c.logprob_rate(Parallel(tp=2))
    pp2 = predict(c, "cluster.num_gpus_per_node=3", "cluster.component_placement={rollout: 0, actor: 1-2}",
                  "actor.pipeline_parallel_size=2").step_s
    assert pp2 == pytest.approx(predict(c, "cluster.num_gpus_per_node=2").step_s)


def test_only_an_sglang_engine_pays_all_reduces_per_decode_step():
    # Rollout at TP 2 on GPUs 0-1, the actor on GPU 2: SGLang shards the model (two all-reduces a layer a decode
    # step); the torch engine runs it whole in one process, whatever its GPUs.
    tp2 = ("cluster.num_gpus_per_node=3", "cluster.component_placement={rollout: 0-1, actor: 2}",
           "rollout.tensor_parallel_size=2")
    slow, free = costs(collective_s=0.01, collective_bytes_per_s=1e30), costs(collective_s=0.0)
    assert predict(slow, *tp2).step_s == pytest.approx(predict(free, *tp2).step_s)
    sglang = (*tp2, "rollout.backend=sglang")
    assert predict(slow, *sglang).step_s > predict(free, *sglang).step_s + 0.5  # (100 decode steps of 2 x 2 x 20 ms)
