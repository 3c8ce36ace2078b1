"""A profile from several runs (`pool_costs`, `plan --profile RUN RUN ...`): the median of each figure over the runs
that measured it, every run's response lengths, what every run missed; runs of different replica sizes refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_planner_profile import write_run, write_spans

from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.costs import Curve, Parallel
from rlinf_pipe.planning.profile import read_profile, read_run
from rlinf_pipe.planning.profile_pool import pool_costs, read_profiles, reduction_hop
from rlinf_pipe.planning.tp_comm import TpShape, extra_tp_s
from rlinf_pipe.planning.tp_hop import pass_hop
from rlinf_pipe.utils.tracing import Span


def test_each_figure_is_the_median_of_the_runs_and_the_samples_are_all_kept(tmp_path):
    base = read_profile(write_run(tmp_path / "run"))
    runs = [dataclasses.replace(base, train_tokens_per_s=rate, co_run_slowdown=c, weight_sync_s={"broadcast": sync},
                                decode=Curve(points), response_lengths=lengths, missing=missing)
            for rate, c, sync, points, lengths, missing in (
                (100.0, 0.11, 0.03, ((1, 10.0), (4, 40.0)), (5,), ("a", "c")),
                (300.0, 0.26, 0.01, ((1, 20.0), (2, 30.0)), (7, 9), ("b", "c")),
                (200.0, 0.21, 0.02, ((1, 30.0), (4, 20.0)), (11,), ("a", "c")))]
    pooled = pool_costs(runs, ["r1", "r2", "r3"])
    assert pooled.train_tokens_per_s == 200.0 and pooled.co_run_slowdown == 0.21
    assert pooled.weight_sync_s == {"broadcast": 0.02}
    # at x=2 the runs' curves read 20 (a third of the way from 10 to 40), 30, and 26.7 (from 30 to 20); at x=4:
    # 40, 30 (flat past its last point) and 20
    assert pooled.decode.points == ((1, 20.0), (2, pytest.approx(80 / 3)), (4, 30.0))
    assert sorted(pooled.response_lengths) == [5, 7, 9, 11]
    assert pooled.missing == ("c",)  # (what every run missed)
    assert pooled.source.startswith("profile of 3 runs") and "r1, r2, r3" in pooled.source
    assert pooled.optimizer_step_s == base.optimizer_step_s  # (alike in every run)


def test_a_figure_is_pooled_over_the_runs_that_measured_it_only(tmp_path):
    # a pipeline run measures a pushed broadcast's hop and no phase switch; a collocated run the reverse (its
    # stand-ins: the default's 2e-5 s hop, a 0.5 s switch). Each figure comes from the run that measured it, each
    # transport's sync from the run that used it; a rate both measured is their median.
    base = read_profile(write_run(tmp_path / "run"))
    pipeline = dataclasses.replace(base, collective_s=1e-3, switch_s={"actor": 0.5}, train_tokens_per_s=100.0,
                                   weight_sync_s={"broadcast": 0.02, "ipc": 0.01},
                                   measured=("collective_s", "train_tokens_per_s", "weight_sync_s.broadcast"))
    collocated = dataclasses.replace(base, collective_s=2e-5, switch_s={"actor": 0.004}, train_tokens_per_s=300.0,
                                     weight_sync_s={"broadcast": 0.04, "ipc": 0.006},
                                     measured=("switch_s.actor", "train_tokens_per_s", "weight_sync_s.ipc"))
    pooled = pool_costs([pipeline, collocated], ["p", "c"])
    assert pooled.collective_s == 1e-3 and pooled.switch_s == {"actor": 0.004}
    assert pooled.weight_sync_s == {"broadcast": 0.02, "ipc": 0.006}
    assert pooled.train_tokens_per_s == 200.0
    assert pooled.measured == ("collective_s", "switch_s.actor", "train_tokens_per_s", "weight_sync_s.broadcast",
                               "weight_sync_s.ipc")
    # a figure neither measured: the median of their stand-ins
    assert pool_costs([dataclasses.replace(pipeline, measured=()), dataclasses.replace(collocated, measured=())],
                      ["p", "c"]).collective_s == pytest.approx((1e-3 + 2e-5) / 2)


def test_one_run_is_its_own_profile_and_runs_of_other_replica_sizes_are_refused(tmp_path):
    run = write_run(tmp_path / "run")
    assert read_profiles([run]) == read_profile(run)
    other = dataclasses.replace(read_profile(run), train_parallel=Parallel(tp=2))
    with pytest.raises(ConfigError, match="train replicas of different sizes.*give one run"):
        pool_costs([read_profile(run), other], ["a", "b"])


def test_plan_validate_takes_several_profile_runs(tmp_path, capsys):
    from rlinf_pipe.cli import main

    first, second = write_run(tmp_path / "a"), write_run(tmp_path / "b", gap=0.1)
    assert main(["plan", "--validate", str(first), "--json", "--profile", str(first), str(second)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["source"].startswith("profile of 2 runs")
    alone = [read_profile(first).step_gap_s, read_profile(second).step_gap_s]
    assert read_profiles([first, second]).step_gap_s == pytest.approx(sum(alone) / 2)  # (the median of two)


def test_a_config_file_taken_into_the_profile_list_is_named(tmp_path, capsys):
    from rlinf_pipe.cli import main

    run = write_run(tmp_path / "run")
    config = tmp_path / "my.yaml"
    config.write_text("cluster: {}\n")
    assert main(["plan", "--search", "--profile", str(run), str(config)]) == 2
    err = capsys.readouterr().err
    assert f"--profile {config}: a file, where run folders go; give the config before --profile" in err


def test_the_hop_comes_from_the_data_parallel_reduction_of_runs_with_and_without_it(tmp_path):
    # one rank: a 3 ms optimizer step. Two ranks: 4 collectives of 2 hops each (8 hops of 1.5 ms) and 1 ms of
    # bytes (2 x 1/2 x 1 MB at 1 GB/s) more: 16 ms as measured, of which the profile took its default's hops off.
    base = dataclasses.replace(read_profile(write_run(tmp_path / "run")), grad_bytes=1e6, collective_bytes_per_s=1e9)
    alone = dataclasses.replace(base, optimizer_step_s=0.003, measured=("optimizer_step_s",))
    reducing = dataclasses.replace(base, collective_s=2e-5, measured=())
    reducing = dataclasses.replace(reducing, optimizer_step_s=0.016 - reducing.reduce_s(Parallel(), 2))
    sizes = [(Parallel(), 1), (Parallel(), 2)]
    assert reduction_hop([alone, reducing], sizes) == pytest.approx(0.0015)
    # without a run of one rank, or where the reducing run's hop was measured (its step already net of it): none
    assert reduction_hop([reducing], sizes[1:]) is None
    measured = dataclasses.replace(reducing, measured=("optimizer_step_s",))
    assert reduction_hop([alone, measured], sizes) is None


def test_a_collocated_run_beside_a_pipeline_run_gives_the_hop_and_the_step_alone(tmp_path):
    # the pipeline run (one actor rank): optimizer steps of 0.05 s. A collocated run on 2 GPUs (two ranks, weights
    # by ipc: no broadcast, no hop of its own): 0.05 s + 8 hops of 2 ms, plus the tiny model's gradient bytes
    pipeline = write_run(tmp_path / "pipeline")
    spans = []
    for step in range(3):
        t = 2.0 * step
        spans += [Span("step", "driver", t, t + 1.0, (), {"step": step}),
                  Span("optimizer_step", "actor/0", t + 0.5, t + 0.566, (0,), {"step": step, "minibatch": 0}),
                  Span("optimizer_step", "actor/1", t + 0.5, t + 0.566, (1,), {"step": step, "minibatch": 0})]
    collocated = write_spans(tmp_path / "collocated", spans, ('cluster.component_placement={"actor,rollout": all}',))
    alone = read_profile(collocated)
    assert "optimizer_step_s" not in alone.measured  # (its reduction taken off at the default's hop: a stand-in)
    pooled = read_profiles([pipeline, collocated])
    assert pooled.optimizer_step_s == pytest.approx(read_profile(pipeline).optimizer_step_s)
    data = dataclasses.replace(alone, collective_s=0.0).reduce_s(Parallel(), 2)
    assert pooled.collective_s == pytest.approx((0.016 - data) / 8)
    assert "data-parallel reduction" in pooled.notes["collective_s"]


def tp2_run(folder, hop: float, pp: int = 1):
    """A collocated run of a TP-2 actor (over GPUs 0 and 1) whose ranks train the pipeline run's passes (40 tokens
    each, at 160 tokens/s on TP 1: 40 / (160 x 2 x 0.9) s at TP 2, `costs.TP_EFFICIENCY`) side by side, each pass
    waiting on 4 all-reduces a layer of the tiny model's 2, of 2 hops of `hop` each: 16 hops."""
    seconds = 40 / (160 * 2 * 0.9) + 16 * hop
    spans = []
    for step in range(3):
        t = 2.0 * step
        spans += [Span("step", "driver", t, t + 1.0, (), {"step": step})]
        spans += [Span("train", f"actor/{rank}", t + 0.1 + i * seconds, t + 0.1 + (i + 1) * seconds, (rank,),
                       {"tokens": 20, "sequences": 2, "sequence_tokens": 60}) for rank in (0, 1) for i in range(2)]
    return write_spans(folder, spans, ('cluster.component_placement={"actor,rollout": all}',
                                       "actor.tensor_parallel_size=2", f"actor.pipeline_parallel_size={pp}",
                                       f"cluster.num_gpus_per_node={2 * pp}"))


def test_a_run_at_another_tensor_parallel_size_gives_the_all_reduces_hop(tmp_path):
    pipeline = write_run(tmp_path / "pipeline")
    alone = read_profile(pipeline)
    assert alone.train_tokens_per_s == pytest.approx(160.0) and alone.co_run_slowdown == 0.0
    # (the bytes: 40 tokens x 64 values of 2 bytes, half of them sent each of 16 hops: 5 MB/s links, about 0.4 ms;
    # the TP run's ranks compute beside each other all the time, at no slowdown here)
    data = extra_tp_s(alone, TpShape(2, 64), "train", 40, 2, 1, hop=0.0)
    assert data == pytest.approx(16 * 2560 / 5e9)
    pooled = read_profiles([tp2_run(tmp_path / "tp2", 0.003 + data / 16), pipeline])
    assert pooled.tp_hop_s == pytest.approx(0.003) and pooled.tp_hop == pooled.tp_hop_s
    assert "tp_hop_s" in pooled.measured and "tensor-parallel" in pooled.notes["tp_hop_s"]
    # the rates are the TP-1 run's (the smallest replicas), the TP run's passes not among them
    assert pooled.train_tokens_per_s == alone.train_tokens_per_s and pooled.train_parallel == Parallel()
    assert pooled.collective_s == alone.collective_s
    # with a co-run slowdown of 0.5 each pass computes 1.5 x as long (its ranks beside each other all its time):
    # less is left for the hops
    compute = 40 / (160 * 2 * 0.9)
    hops = pass_hop(dataclasses.replace(alone, co_run_slowdown=0.5), read_run(tmp_path / "tp2", warmup=1))
    assert hops == pytest.approx([0.003 - 0.5 * compute / 16] * 8)  # (2 ranks x 2 passes x the 2 steps kept)
    # runs of other pipeline sizes: refused, naming both
    with pytest.raises(ConfigError, match="other pipeline or context-parallel sizes.*TP 1 PP 1.*TP 2 PP 2"):
        read_profiles([pipeline, tp2_run(tmp_path / "pp2", 0.003, pp=2)])


def test_a_tensor_parallel_run_gives_the_wait_for_a_passs_input_shared_among_its_ranks(tmp_path):
    # The TP-2 actor computes reference log-probs: per step 3 passes on each rank, 1.5 ms apart, where the profile's
    # log-prob worker reads its next group in `logprob_handoff_s`: the rest is the input's share among the ranks.
    pipeline = write_run(tmp_path / "pipeline")
    spans = []
    for step in range(3):
        t = 2.0 * step
        spans.append(Span("step", "driver", t, t + 1.0, (), {"step": step}))
        spans += [Span("logprob", f"actor/{rank}", t + 0.1 + i * 0.0115, t + 0.11 + i * 0.0115, (rank,),
                       {"step": step, "sequences": 2, "tokens": 60}) for rank in (0, 1) for i in range(3)]
    tp2 = write_spans(tmp_path / "tp2", spans, ('cluster.component_placement={"actor,rollout": all}',
                                                "actor.tensor_parallel_size=2", "algorithm.compute_ref_logprobs=true"))
    pooled = read_profiles([pipeline, tp2])
    assert pooled.share_s == pytest.approx(0.0015 - read_profile(pipeline).logprob_handoff_s)
    assert "share_s" in pooled.measured and "share_s" in pooled.notes
