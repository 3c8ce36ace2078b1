"""What a rehearsal changes in a cluster config to run it on this machine, and the streams its report names
(`rlinf_pipe.runner.rehearsal`)."""

from __future__ import annotations

from rlinf_pipe.config import load_config
from rlinf_pipe.runner.rehearsal import BATCH_CAP, CAPS, HEARTBEAT_S_PER_SHARE, crossings, scale_down


def overrides(name: str, processes: int, cores: int, *extra: str) -> dict[str, str]:
    cfg = load_config("examples/math/config", name, list(extra))
    changes = scale_down(cfg, 8, 2, "tiny", "out", True, processes, cores)
    return dict(c.override.split("=", 1) for c in changes)


def test_the_seed_pipeline_keeps_its_placement_and_scales_down_only_sizes():
    got = overrides("qwen2.5-1.5b-grpo-megatron-pipeline", 34, 2)
    assert got["actor.model_path"] == "tiny" and got["runner.max_steps"] == "2"
    assert "cluster.component_placement" not in got and not any(k.startswith("cluster.") for k in got)
    for key, cap in CAPS.items():
        if key in got:
            assert int(got[key]) == cap
    minibatches = load_config("examples/math/config", "qwen2.5-1.5b-grpo-megatron-pipeline").algorithm.n_minibatches
    # a group for each of the 8 actor replicas in every mini-batch, and no more than that where it passes the cap
    assert int(got["data.rollout_batch_size"]) == 8 * minibatches * max(1, BATCH_CAP // (8 * minibatches))


def test_the_heartbeat_limit_grows_with_the_processes_each_core_runs():
    crowded = overrides("qwen2.5-1.5b-grpo-megatron", 66, 2)
    assert float(crowded["runner.heartbeat_timeout_s"]) == HEARTBEAT_S_PER_SHARE * 33
    roomy = overrides("qwen2.5-1.5b-grpo-megatron", 4, 16)  # (one process a core or less: the config's own)
    assert "runner.heartbeat_timeout_s" not in roomy
    kept = overrides("qwen2.5-1.5b-grpo-megatron", 66, 2, "runner.heartbeat_timeout_s=5000")
    assert "runner.heartbeat_timeout_s" not in kept  # (never lowered)


def streams(name: str) -> list[str]:
    from rlinf_pipe.planning.run_plan import plan_run

    plan = plan_run(load_config("examples/math/config", name))
    return crossings(plan.placement, plan.weight_transport, ["rollout", "reward", "inference", "actor"],
                     plan.weight_routes)


def test_the_report_names_the_streams_that_cross_nodes():
    assert streams("qwen2.5-1.5b-grpo-megatron-pipeline") == [
        "channel rollout (node 0-2) -> inference (node 2): crosses nodes (TCP)",
        "channel inference (node 2) -> actor (node 3): crosses nodes (TCP)",
        "weights actor rank 0 (node 3) -> rollout over broadcast: to node 0-2 across nodes",
        "weights actor rank 0 (node 3) -> inference over broadcast: to node 2 across nodes"]
    # collocated: each engine takes the weights from the actor rank on its own GPU (ipc), never across nodes
    assert streams("qwen2.5-1.5b-grpo-megatron")[-1] == (
        "weights 32 actor ranks (node 0-3) -> rollout over ipc: each within its node")
