"""Property tests: valid random placements cover each GPU at most once per mode; anything else raises
PlacementError, never another exception."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlinf_pipe.config import Config
from rlinf_pipe.errors import PlacementError
from rlinf_pipe.planning.gpu_ids import NodeLayout, format_ids
from rlinf_pipe.planning.placement import plan_placement

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_config(gpus_per_node: list[int], placement: dict, batch: int = 1):
    cfg = Config()
    cfg.cluster.num_nodes, cfg.cluster.num_gpus_per_node = len(gpus_per_node), gpus_per_node
    cfg.cluster.component_placement = placement
    cfg.data.rollout_batch_size = batch
    cfg.algorithm.group_size = 1
    return cfg


clusters = st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4)


@st.composite
def disaggregated(draw):
    gpus_per_node = draw(clusters)
    world = sum(gpus_per_node)
    owner = draw(st.lists(st.sampled_from([None, "rollout", "inference", "actor"]), min_size=world, max_size=world))
    ids = {name: [g for g, o in enumerate(owner) if o == name] for name in ("rollout", "inference", "actor")}
    if not ids["rollout"] or not ids["actor"]:
        ids["rollout"], ids["actor"] = [0], [world - 1] if world > 1 else [0]
        if world == 1:
            return None
        ids["inference"] = [g for g in ids["inference"] if g not in (0, world - 1)]
    placement = {name: format_ids(gs) for name, gs in ids.items() if gs}
    return gpus_per_node, placement, ids


@given(disaggregated())
@SETTINGS
def test_valid_disaggregated_placements_cover_each_gpu_at_most_once(case):
    if case is None:
        return
    gpus_per_node, placement, ids = case
    result = plan_placement(make_config(gpus_per_node, placement, batch=len(ids["actor"])))
    assert result.mode == "disaggregated"
    layout = NodeLayout(gpus_per_node)
    seen: list[int] = []
    for name, comp in result.components.items():
        covered = [g for proc in comp.processes for g in proc.global_gpus]
        assert sorted(covered) == ids[name]
        for proc in comp.processes:
            assert all(layout.node_of(g) == proc.node_rank for g in proc.global_gpus)
            assert proc.local_gpus == tuple(layout.local_id(g) for g in proc.global_gpus)
        seen += covered
    assert len(seen) == len(set(seen))
    unused = sum(gpus_per_node) - len(seen)
    assert (len(result.warnings) == 1) == (unused > 0)


@st.composite
def collocated(draw):
    gpus_per_node = draw(clusters)
    per_node_tp = min(gpus_per_node)
    actor_tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= per_node_tp]))
    rollout_tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= actor_tp and actor_tp % t == 0]))
    return gpus_per_node, actor_tp, rollout_tp


@given(collocated())
@SETTINGS
def test_valid_collocated_placements_share_every_gpu_once_per_component(case):
    gpus_per_node, actor_tp, rollout_tp = case
    world = sum(gpus_per_node)
    cfg = make_config(gpus_per_node, {"actor,rollout": "all"}, batch=world)
    cfg.actor.tensor_parallel_size, cfg.rollout.tensor_parallel_size = actor_tp, rollout_tp
    result = plan_placement(cfg)
    assert result.mode == "collocated"
    for comp in result.components.values():
        covered = sorted(g for proc in comp.processes for g in proc.global_gpus)
        assert covered == list(range(world))
    actor = result.components["actor"]
    assert all(len(p.global_gpus) == rollout_tp for p in result.components["rollout"].processes)
    # every rollout engine stays inside one actor tensor-parallel group
    for proc in result.components["rollout"].processes:
        assert len({actor.gpus.index(g) // actor_tp for g in proc.global_gpus}) == 1


names = st.sampled_from(["actor", "rollout", "inference", "reward", "actr", "", "actor,rollout", "rollout,actor",
                         "actor,rollout,inference", "reward,rollout", "critic"])
values = st.one_of(
    st.integers(min_value=-3, max_value=40),
    st.text(alphabet="0123456789-, al", max_size=12),
    st.sampled_from(["all", "cpu", "0-3", "4-7", "0-31", "7-0", "0-3,8-11"]),
    st.lists(st.integers(min_value=-1, max_value=40), max_size=5),
    st.booleans(),
)


@given(clusters, st.dictionaries(names, values, max_size=4), st.sampled_from([1, 2, 4]),
       st.sampled_from([1, 2]), st.integers(min_value=1, max_value=16))
@SETTINGS
def test_arbitrary_placements_raise_only_placement_errors(gpus_per_node, placement, tp, pp, batch):
    cfg = make_config(gpus_per_node, placement, batch=batch)
    cfg.actor.tensor_parallel_size = cfg.rollout.tensor_parallel_size = tp
    cfg.actor.pipeline_parallel_size = pp
    try:
        result = plan_placement(cfg)
    except PlacementError as exc:
        assert exc.key is not None and exc.rule and exc.fix
        return
    for comp in result.components.values():
        covered = [g for proc in comp.processes for g in proc.global_gpus]
        assert len(covered) == len(set(covered))
    sets = result.gpu_sets()
    assert all(set(a.gpus).isdisjoint(b.gpus) for i, a in enumerate(sets) for b in sets[i + 1:])
    expected = ("collocated" if len(sets) == 1 else "disaggregated" if all(len(s.components) == 1 for s in sets)
                else "hybrid")
    assert result.mode == expected
