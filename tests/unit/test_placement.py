"""Placement: grammar, mode derivation, every rule, process layout."""

from __future__ import annotations

import pytest

from rlinf_pipe.config import Config
from rlinf_pipe.errors import PlacementError
from rlinf_pipe.planning.gpu_ids import NodeLayout, format_ids, parse_gpu_ids
from rlinf_pipe.planning.placement import plan_placement


def plan(placement: dict, nodes: int = 4, gpus: int | list[int] = 8, **overrides):
    """Plan a placement on a described cluster; overrides are dotted config keys."""
    cfg = Config()
    cfg.cluster.num_nodes, cfg.cluster.num_gpus_per_node = nodes, gpus
    cfg.cluster.component_placement = placement
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return plan_placement(cfg)


def placement_error(placement: dict, **kwargs) -> PlacementError:
    with pytest.raises(PlacementError) as info:
        plan(placement, **kwargs)
    return info.value


# --- grammar -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("all", list(range(16))),
        (3, [3]),
        ("3", [3]),
        ("0-3", [0, 1, 2, 3]),
        ("0-3,8-11", [0, 1, 2, 3, 8, 9, 10, 11]),
        (" 5 , 1-2 ", [1, 2, 5]),
        ("4 - 6", [4, 5, 6]),
        ([0, 2, 4], [0, 2, 4]),
        ("ALL", list(range(16))),
        ("0-3,", [0, 1, 2, 3]),
        ("1, 2 ,", [1, 2]),
    ],
)
def test_grammar(value, expected):
    assert list(parse_gpu_ids("actor", value, NodeLayout([8, 8]))) == expected


@pytest.mark.parametrize(
    "value, rule",
    [
        ("3-1", "reversed"),
        ("0-16", "out of range"),
        (16, "out of range"),
        ("a-b", "not a GPU id"),
        ("-1", "not a GPU id"),
        ("0,,1", "an empty entry between two commas"),
        ("", "no GPUs given"),
        (",", "no GPUs given"),
        (None, "no GPUs given: YAML reads an empty value"),
        ("0-3,2", "listed twice"),
        (True, "not a boolean"),
        ("1.5", "not a GPU id"),
        ([], "no GPUs given"),
    ],
)
def test_grammar_errors(value, rule):
    with pytest.raises(PlacementError) as info:
        parse_gpu_ids("actor", value, NodeLayout([8, 8]))
    assert rule in info.value.rule
    assert info.value.key == "actor" and "actor:" in str(info.value)
    assert info.value.fix


def test_format_ids_compacts_ranges():
    assert format_ids([5, 0, 1, 2, 9, 10]) == "0-2,5,9-10"
    assert format_ids([]) == ""


# --- the user-story layouts ------------------------------------------------------------------------------------


def test_four_node_pipeline_example():
    p = plan(
        {"rollout": "0-19", "inference": "20-23", "actor": "24-31"},
        rollout__tensor_parallel_size=2,
        actor__tensor_parallel_size=2,
    )
    assert p.mode == "disaggregated" and p.warnings == ()
    rollout, inference, actor = (p.components[n] for n in ("rollout", "inference", "actor"))
    assert [proc.global_gpus for proc in rollout.processes] == [(i, i + 1) for i in range(0, 20, 2)]
    assert rollout.processes[8].node_rank == 2 and rollout.processes[8].local_gpus == (0, 1)
    assert [proc.local_gpus for proc in inference.processes] == [(4,), (5,), (6,), (7,)]
    assert {proc.node_rank for proc in inference.processes} == {2}
    assert [proc.node_rank for proc in actor.processes] == [3] * 8
    assert (actor.tp, actor.pp, actor.dp) == (2, 1, 4)
    assert (rollout.dp, inference.dp) == (10, 4)


def test_context_parallel_ranks_count_in_a_replica():
    """A Megatron replica's GPUs are TP x PP x CP (rank order tp-cp-dp-pp): the gathering ranks are tensor rank 0
    of every context-parallel rank of stage 0, the output ranks tensor and context rank 0 of the last stage."""
    from rlinf_pipe.planning.weight_routes import gathering_ranks
    from rlinf_pipe.planning.plan_report import _table

    p = plan({"rollout": "0-7", "actor": "8-23"}, nodes=3, actor__tensor_parallel_size=2,
             actor__context_parallel_size=2, inference__context_parallel_size=1)
    actor = p.components["actor"]
    assert (actor.tp, actor.pp, actor.cp, actor.dp) == (2, 1, 2, 4)
    assert gathering_ranks(actor) == list(range(0, 16, 2))
    table = _table(p)
    assert table[0].split()[-2:] == ["CP", "DP"] and table[-1].split()[-4:] == ["2", "1", "2", "4"]
    error = placement_error({"rollout": "0-7", "actor": "8-13"}, nodes=2, actor__tensor_parallel_size=2,
                            actor__context_parallel_size=2)
    assert "actor.context_parallel_size = 4" in str(error) and "multiple of 4 GPUs" in str(error)


def test_pipeline_and_context_parallel_ranks_of_both_megatron_components():
    """PP 2 x CP 2 for the actor, TP 2 x CP 2 for the log-prob workers: a replica of four GPUs each; the actor's
    weights are gathered on each CP rank of stage 0 (ranks 0 and 1 of each replica: tp-cp-dp-pp order)."""
    from rlinf_pipe.planning.weight_routes import gathering_ranks

    p = plan({"rollout": "0-7", "inference": "8-15", "actor": "16-23"}, nodes=3, actor__pipeline_parallel_size=2,
             actor__context_parallel_size=2, inference__tensor_parallel_size=2, inference__context_parallel_size=2)
    actor, inference = p.components["actor"], p.components["inference"]
    assert (actor.tp, actor.pp, actor.cp, actor.dp) == (1, 2, 2, 2)
    assert (inference.tp, inference.pp, inference.cp, inference.dp) == (2, 1, 2, 2)
    assert gathering_ranks(actor) == [0, 1, 2, 3]  # (stage 0: the first tp x cp x dp ranks)


def test_collocated_all():
    p = plan({"actor,rollout": "all"})
    assert p.mode == "collocated"
    assert p.components["actor"].gpus == p.components["rollout"].gpus == tuple(range(32))
    assert [proc.global_gpus for proc in p.components["rollout"].processes] == [(i,) for i in range(32)]
    assert p.components["actor"].key == "actor,rollout"


def test_collocated_rollout_is_strided_inside_actor_tp_groups():
    p = plan({"actor,rollout": "all"}, nodes=1, actor__tensor_parallel_size=4, rollout__tensor_parallel_size=2)
    engines = [proc.global_gpus for proc in p.components["rollout"].processes]
    assert engines == [(0, 2), (1, 3), (4, 6), (5, 7)]
    # rollout TP rank r of engine j sits on the device of actor TP shard j + r * stride (stride 2)
    actor_gpus = p.components["actor"].gpus
    for j, engine in enumerate(engines):
        group_start = (j // 2) * 4
        for r, gpu in enumerate(engine):
            assert actor_gpus.index(gpu) == group_start + (j % 2) + r * 2


def test_collocated_equal_tp_is_not_strided():
    p = plan({"actor,rollout": "0-7"}, nodes=1, actor__tensor_parallel_size=2, rollout__tensor_parallel_size=2)
    assert [proc.global_gpus for proc in p.components["rollout"].processes] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_separate_keys_with_identical_gpus_are_collocated():
    assert plan({"actor": "0-7", "rollout": "0-7"}, nodes=1).mode == "collocated"


def test_heterogeneous_nodes_global_ids_are_cumulative():
    p = plan({"rollout": "0-11", "actor": "12-27"}, nodes=3, gpus=[4, 8, 16], rollout__tensor_parallel_size=4)
    rollout = p.components["rollout"].processes
    assert [(proc.node_rank, proc.local_gpus) for proc in rollout] == [(0, (0, 1, 2, 3)), (1, (0, 1, 2, 3)),
                                                                      (1, (4, 5, 6, 7))]
    actor = p.components["actor"].processes
    assert actor[0].node_rank == 2 and actor[0].local_gpus == (0,)
    assert actor[-1].global_gpus == (27,) and actor[-1].local_gpus == (15,)
    assert p.to_json()["gpus_per_node"] == [4, 8, 16]


def test_reward_may_share_rollout_gpus_or_run_on_cpu():
    p = plan({"rollout": "0-3", "reward": "0-3", "actor": "4-7"}, nodes=1)
    assert p.mode == "disaggregated"
    assert [proc.global_gpus for proc in p.components["reward"].processes] == [(0,), (1,), (2,), (3,)]
    p = plan({"actor,rollout": "all", "reward": "cpu"}, nodes=1)
    reward = p.components["reward"]
    assert reward.gpus == () and reward.dp == 1
    assert [(proc.node_rank, proc.local_gpus, proc.global_gpus) for proc in reward.processes] == [(0, (), ())]


def test_unused_gpus_warn():
    p = plan({"rollout": "0-3", "actor": "4-5"}, nodes=1)
    assert len(p.warnings) == 1 and "6-7" in p.warnings[0] and "not used" in p.warnings[0]


def test_tp_group_across_nodes_warns():
    p = plan({"rollout": "0-5", "actor": "6-9"}, nodes=2, actor__tensor_parallel_size=4)
    assert any("spans nodes" in w and "6-9" in w for w in p.warnings)


def test_json_shape():
    data = plan({"rollout": 0, "inference": 1, "actor": 2}, nodes=1, gpus=3).to_json()
    assert data["mode"] == "disaggregated" and data["num_nodes"] == 1 and data["gpus_per_node"] == [3]
    assert data["components"]["inference"] == [{"rank": 0, "node_rank": 0, "local_gpus": [1], "global_gpus": [1]}]


# --- rules -----------------------------------------------------------------------------------------------------


def test_id_out_of_range_names_cluster_size():
    err = placement_error({"rollout": "0-19", "inference": "20-23", "actor": "24-32"})
    assert err.key == "actor" and err.value == "24-32" and "32" in err.rule and "0-31" in err.rule


def test_reversed_range():
    err = placement_error({"rollout": "19-0", "actor": "24-31"})
    assert err.key == "rollout" and "reversed" in err.rule and "0-19" in err.fix


def test_overlap_between_disaggregated_components():
    err = placement_error({"rollout": "0-19", "inference": "18-23", "actor": "24-31"})
    assert err.key == "inference" and "rollout (0-19) and inference (18-23) share GPU(s) 18-19" in err.rule


def test_partial_actor_rollout_overlap():
    err = placement_error({"rollout": "0-19", "actor": "16-31"})
    assert "share GPU(s) 16-19 but are not identical" in err.rule and "collocated" in err.fix


def test_unknown_component_suggests_closest():
    err = placement_error({"rolout": "0-19", "actor": "24-31"})
    assert err.key == "rolout" and "not a component" in err.rule and "`rollout`" in err.fix


def test_empty_name_in_joined_key():
    err = placement_error({"actor,,rollout": "all"})
    assert "empty name" in err.rule and "stray comma" in err.fix


def test_trailing_comma_in_a_joined_key_is_tolerated():
    assert plan({"actor,rollout,": "all"}).mode == "collocated"


def test_an_unquoted_colon_value_read_as_base_60_is_explained():
    """YAML 1.1 reads `actor: 1:0` as 60; the error says so instead of only "GPU id 60 out of range"."""
    import yaml

    assert yaml.safe_load("actor: 1:0") == {"actor": 60}
    err = placement_error({"rollout": "0-3", "actor": 60}, nodes=1)
    assert "GPU id 60 is out of range" in err.rule and "`1:00` (or `1:0`)" in err.rule and "base-60" in err.rule
    assert "base-60" not in placement_error({"rollout": "0-3", "actor": 9}, nodes=1).rule


def test_component_placed_twice():
    err = placement_error({"actor,rollout": "all", "actor": "0-3"})
    assert "placed twice" in err.rule


@pytest.mark.parametrize("missing", ["actor", "rollout"])
def test_missing_actor_or_rollout(missing):
    present = {"actor": "0-3", "rollout": "4-7"}
    present.pop(missing)
    err = placement_error(present, nodes=1)
    assert err.key == missing and "must be placed" in err.rule


def test_empty_placement():
    assert "no component" in placement_error({}).rule


def test_rollout_process_would_span_nodes():
    err = placement_error({"rollout": "6-13", "actor": "0-3"}, nodes=2, rollout__tensor_parallel_size=4)
    assert err.key == "rollout" and "span" in err.rule and "nodes 0, 1" in err.rule


def test_collocated_engine_would_span_nodes():
    # actor TP groups of 4 starting at 6 cross the node boundary at 8; so would the rollout engines on them
    err = placement_error({"actor,rollout": "6-13"}, nodes=2, actor__tensor_parallel_size=4,
                          rollout__tensor_parallel_size=2)
    assert "never spans nodes" in err.rule


@pytest.mark.parametrize("component", ["rollout", "inference", "actor"])
def test_gpu_count_not_divisible_by_model_parallel_size(component):
    placement = {"rollout": "0-5", "inference": "6-11", "actor": "12-17"}
    err = placement_error(placement, nodes=4, **{f"{component}__tensor_parallel_size": 4})
    assert err.key == component and "6 GPU(s), not a multiple of" in err.rule and "= 4" in err.rule


def test_pipeline_parallel_counts_in_divisibility():
    err = placement_error({"rollout": "0-3", "actor": "4-9"}, nodes=2, actor__tensor_parallel_size=2,
                          actor__pipeline_parallel_size=2)
    assert "actor.tensor_parallel_size x actor.pipeline_parallel_size = 4" in err.rule


def test_collocated_rollout_tp_larger_than_actor_tp_packs_engines_over_whole_actor_tp_groups():
    p = plan({"actor,rollout": "all"}, nodes=1, actor__tensor_parallel_size=2, rollout__tensor_parallel_size=4)
    assert [proc.global_gpus for proc in p.components["rollout"].processes] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    p = plan({"actor,rollout": "0-3"}, nodes=1, actor__tensor_parallel_size=1, rollout__tensor_parallel_size=2)
    assert p.mode == "collocated" and p.components["actor"].dp == 4
    assert [proc.global_gpus for proc in p.components["rollout"].processes] == [(0, 1), (2, 3)]


def test_collocated_tp_sizes_that_do_not_divide_one_another():
    err = placement_error({"actor,rollout": "0-5"}, nodes=1, actor__tensor_parallel_size=2,
                          rollout__tensor_parallel_size=3, data__rollout_batch_size=3)
    assert "do not divide one another" in err.rule and "collocated" in err.rule
    assert err.fix.endswith("e.g. 1, 2, 6")  # divisors and multiples of 2 that split 6 GPUs


def test_strided_engine_across_nodes_names_the_stride_and_a_fix_that_works():
    """2 nodes x 4, actor TP 8, rollout TP 2: each node holds a multiple of 2 GPUs, so the cause is the stride."""
    err = placement_error({"actor,rollout": "all"}, nodes=2, gpus=4, actor__tensor_parallel_size=8,
                          rollout__tensor_parallel_size=2)
    assert "GPUs 0,4 on nodes 0, 1" in err.rule and "strided" in err.rule and "j+4" in err.rule
    assert "actor.tensor_parallel_size <= 4" in err.fix and "rollout.tensor_parallel_size 1" in err.fix
    assert "multiple of" not in err.fix
    for fixed in ({"actor__tensor_parallel_size": 4}, {"rollout__tensor_parallel_size": 1}):
        plan({"actor,rollout": "all"}, nodes=2, gpus=4, **{"actor__tensor_parallel_size": 8,
                                                          "rollout__tensor_parallel_size": 2, **fixed})


def test_batch_not_divisible_by_actor_dp():
    err = placement_error({"rollout": "0-1", "actor": "2-7"}, nodes=1, data__rollout_batch_size=3,
                          algorithm__group_size=3)
    assert err.key == "actor" and "9 samples" in err.rule and "6 data-parallel" in err.rule


@pytest.mark.parametrize("reward", ["4", "4-7", "8-9", "0,4"])
def test_reward_may_go_anywhere(reward):
    """reward is a CPU component: on the actor's GPUs, on GPUs of its own or across sets; one process per GPU."""
    p = plan({"rollout": "0-3", "reward": reward, "actor": "4-7"}, nodes=2)
    assert p.mode == "disaggregated" and p.components["reward"].gpus == parse_gpu_ids("r", reward, NodeLayout([8, 8]))
    assert len(p.components["reward"].processes) == len(p.components["reward"].gpus)


def test_engines_on_the_actor_gpus_with_inference_apart_is_hybrid():
    p = plan({"actor,rollout": "0-3", "inference": "4-7"}, nodes=1)
    assert p.mode == "hybrid" and p.rollout_on_actor_gpus and p.inference_placed
    assert [(s.gpus, s.components) for s in p.gpu_sets()] == [((0, 1, 2, 3), ("rollout", "actor")),
                                                              ((4, 5, 6, 7), ("inference",))]
    assert "time-shared by rollout and actor" in p.gpu_sets()[0].sharing
    assert p.to_json()["gpu_sets"][1] == {"gpus": "4-7", "components": ["inference"],
                                          "sharing": "inference alone, streaming to the other stages"}


@pytest.mark.parametrize("entries", [{"actor,inference": "4-7", "rollout": "0-3"},
                                     {"actor": "4-7", "rollout": "0-3"}])
def test_log_probs_on_the_actor_gpus_merge_into_the_actor(entries):
    """`actor,inference` on one set, or no inference entry: the actor computes the log-probs; no inference workers."""
    p = plan(entries, nodes=1)
    assert p.mode == "disaggregated" and not p.inference_placed and not p.rollout_on_actor_gpus
    assert "inference" not in p.components and "actor (+ log-probs) alone" in p.gpu_sets()[1].sharing
    assert any("actor computes the old and reference log-probs" in w for w in p.warnings) == ("actor,inference"
                                                                                            in entries)


def test_every_component_on_one_set_is_collocated():
    p = plan({"actor,rollout,inference": "all"}, nodes=1)
    assert p.mode == "collocated" and not p.inference_placed and p.rollout_on_actor_gpus


def test_inference_taking_turns_with_the_engines_is_hybrid():
    p = plan({"rollout,inference": "0-3", "actor": "4-7"}, nodes=1)
    assert p.mode == "hybrid" and p.inference_on_rollout_gpus and not p.rollout_on_actor_gpus
    assert "inference takes the GPUs group by group" in p.gpu_sets()[0].sharing


def test_error_message_is_one_readable_block():
    err = placement_error({"rollout": "0-19", "actor": "24-33"})
    lines = str(err).splitlines()
    assert lines[0] == "invalid placement `actor: 24-33` (cluster.component_placement)"
    assert lines[1].startswith("  rule: ") and lines[2].startswith("  fix:  ")


def test_the_largest_supported_cluster_plans_in_linear_time():
    """65,536 GPUs (8,192 nodes): every GPU is looked up once per node boundary search (bisect) and every id is
    counted once, so this plans in about a second (the quadratic check took minutes)."""
    from rlinf_pipe.config import load_config

    cfg = load_config(overrides=[
        "cluster.num_nodes=8192", "cluster.num_gpus_per_node=8", "data.rollout_batch_size=8192",
        "cluster.component_placement={rollout: 0-32767, inference: 32768-49151, actor: 49152-65535}",
    ])
    placement = plan_placement(cfg)
    actor = placement.components["actor"]
    assert len(actor.processes) == 16384 and actor.processes[-1].node_rank == 8191
    assert actor.processes[-1].local_gpus == (7,)
