"""`plan_run`: what is checked before Ray starts beyond the config itself (the placement, the algorithm registry,
the settings that depend on the mode), and the mode decisions a run is built from."""

from __future__ import annotations

import pytest

from rlinf_pipe.config import load_config
from rlinf_pipe.errors import ConfigError, PlacementError
from rlinf_pipe.runner.plan import plan_run, resolve_weight_transport

COLLOCATED = ["cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": all}']


def plan(*overrides: str):
    return plan_run(load_config(overrides=list(overrides)))


def test_the_default_plan_is_the_tiny_pipeline():
    p = plan()
    assert (p.collocated, p.weight_transport, p.staleness, p.dynamic_sampling, p.actor_dp) == (
        False, "broadcast", 0, False, 1)
    c = plan(*COLLOCATED)
    assert (c.collocated, c.weight_transport) == (True, "object_store")


def test_the_placement_is_checked():
    with pytest.raises(PlacementError, match="out of range"):
        plan("cluster.component_placement.actor=5")


def test_unquoted_joined_key_in_flow_mapping_explains_yaml_gotcha():
    with pytest.raises(PlacementError, match="quote joined keys"):
        plan("cluster.component_placement={actor,rollout: all}")


def test_unknown_advantage_estimator_suggests_registered_ones():
    with pytest.raises(ConfigError, match=r"no estimator named 'gpro'.*did you mean `grpo`"):
        plan("algorithm.adv_estimator=gpro")


def test_broadcast_weight_sync_needs_the_disaggregated_pipeline():
    with pytest.raises(ConfigError, match="runner.weight_sync: broadcast needs the disaggregated pipeline"):
        plan(*COLLOCATED, "runner.weight_sync=broadcast")
    assert plan(*COLLOCATED, "runner.weight_sync=object_store").weight_transport == "object_store"


def test_staleness_needs_the_disaggregated_pipeline():
    with pytest.raises(ConfigError, match="runner.max_staleness: 1 needs the disaggregated pipeline"):
        plan(*COLLOCATED, "runner.max_staleness=1")
    assert plan("runner.max_staleness=1").staleness == 1


def test_auto_weight_sync_resolves_by_mode():
    assert resolve_weight_transport("auto", collocated=False) == "broadcast"
    assert resolve_weight_transport("auto", collocated=True) == "object_store"
    assert resolve_weight_transport("object_store", collocated=False) == "object_store"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["runner.max_staleness=1"], "cannot run with runner.max_staleness: 1"),
        (["algorithm.adv_estimator=reinforce_plus_plus"], "needs a group-scoped advantage estimator"),
    ],
)
def test_dynamic_sampling_rejects_what_it_cannot_do(overrides, expected):
    with pytest.raises(ConfigError) as info:
        plan("algorithm.dynamic_sampling=true", *overrides)
    assert expected in str(info.value)
    assert plan("algorithm.dynamic_sampling=true").dynamic_sampling
