"""The stage graph decided from the run plan: which component runs each stage, the channels each reads and writes,
who takes turns on GPUs, and the channels' producers and buffering."""

from __future__ import annotations

import pytest

from rlinf_pipe.config import load_config
from rlinf_pipe.planning.run_plan import plan_run
from rlinf_pipe.planning.stage_graph import stage_graph

REF = "algorithm.compute_ref_logprobs=true"
THIRDS = "data.rollout_batch_size=12"  # (a batch that splits over 1, 2 and 3 actor replicas)


def graph(*overrides: str):
    return stage_graph(plan_run(load_config(overrides=list(overrides))))


def flow(g) -> list[tuple[str, str, str | None, str | None]]:
    return [(s.name, s.component, s.reads, s.writes) for s in g.stages]


def test_without_a_log_prob_pass_the_reward_workers_feed_the_actor():
    g = graph()
    assert flow(g) == [("generate", "rollout", None, "rollouts"), ("score", "reward", "rollouts", "train"),
                       ("train", "actor", "train", None)]
    assert [(c.name, c.producers, c.per_replica, c.unbounded) for c in g.channels] == [
        ("rollouts", 1, False, False), ("train", 1, True, True)]
    assert all(not s.turns_with for s in g.stages) and g.stage("logprob") is None


@pytest.mark.parametrize("placement, logprob, turns", [
    ("{rollout: 0, inference: 1, actor: 2}", "inference", {}),
    ("{rollout: 0-1, actor: 2}", "actor", {}),
    ('{"rollout,inference": 0-1, actor: 2}', "inference", {"generate": ("inference",), "logprob": ("rollout",)}),
    ('{"actor,rollout": 0-1, inference: 2}', "inference", {"generate": ("actor",), "train": ("rollout",)}),
    ('{"actor,rollout": all}', "actor", {"generate": ("actor",), "logprob": ("rollout",), "train": ("rollout",)}),
])
def test_the_log_prob_stage_reads_the_scored_channel_where_the_plan_puts_it(placement, logprob, turns):
    g = graph("cluster.num_gpus_per_node=3", f"cluster.component_placement={placement}", REF, THIRDS)
    assert flow(g) == [("generate", "rollout", None, "rollouts"), ("score", "reward", "rollouts", "scored"),
                       ("logprob", logprob, "scored", "train"), ("train", "actor", "train", None)]
    assert {s.name: s.turns_with for s in g.stages if s.turns_with} == turns
    train = g.channel("train")
    comps = plan_run(load_config(overrides=["cluster.num_gpus_per_node=3",
                                            f"cluster.component_placement={placement}", REF,
                                            THIRDS])).placement.components
    assert train is not None and train.producers == comps[logprob].dp  # every log-prob replica feeds it
    assert g.channel("rollouts").producers == len(comps["rollout"].processes)
    # a consumer that waits for its producer's phase (shared GPUs, the actor's log-probs first) buffers a step
    assert g.channel("scored").unbounded == (bool(turns) or logprob == "actor")


def test_the_plan_prints_one_line_per_stage():
    lines = graph("cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": all}',
                  REF).describe()
    assert lines[0].split() == ["generate", "rollout", "prompts", "->", "[rollouts];", "takes", "turns", "on", "its",
                                "GPUs", "with", "actor"]
    assert lines[2].split()[:5] == ["logprob", "actor", "[scored]", "->", "[train];"]
    assert lines[3].split()[:5] == ["train", "actor", "[train]", "->", "weights;"]
