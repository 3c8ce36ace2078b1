"""`plan_run`: what is checked before Ray starts beyond the config itself (the placement, the algorithm registry,
the settings that depend on the mode), and the mode decisions a run is built from."""

from __future__ import annotations

import pytest

from rlinf_pipe.config import load_config
from rlinf_pipe.errors import ConfigError, PlacementError
from rlinf_pipe.planning.run_plan import plan_run, resolve_weight_transport
from rlinf_pipe.planning.weight_routes import gathering_ranks

COLLOCATED = ["cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": all}']
REF = "algorithm.compute_ref_logprobs=true"  # gives a log-prob stage something to compute
THREE = ["cluster.num_gpus_per_node=3", "cluster.component_placement={rollout: 0, inference: 1, actor: 2}"]


def plan(*overrides: str):
    return plan_run(load_config(overrides=list(overrides)))


def test_the_default_plan_is_the_tiny_pipeline():
    p = plan()
    assert (p.collocated, p.weight_transport, p.staleness, p.dynamic_sampling, p.actor_dp) == (
        False, "broadcast", 0, False, 1)
    assert (p.logprob_stage, p.logprob_component, p.inference_workers, p.actor_logprobs) == (False, None, False, False)
    assert p.weight_receivers == ("rollout",) and p.warnings == ()
    assert [(r.sender, r.receivers) for r in p.weight_routes] == [(0, (("rollout", 0),))]
    c = plan(*COLLOCATED)
    assert (c.collocated, c.weight_transport, c.weight_receivers) == (True, "ipc", ("rollout",))


@pytest.mark.parametrize("overrides, stage", [
    ([], None), ([REF], "inference"), (["algorithm.n_minibatches=2"], "inference"), (["algorithm.kl_coef=0.1"],
                                                                                    "inference"),
    (["runner.max_staleness=1"], None), (["runner.max_staleness=1", "algorithm.n_minibatches=2"], None),
])
def test_inference_workers_run_only_when_the_algorithm_needs_a_log_prob_pass(overrides, stage):
    p = plan(*THREE, *overrides)
    assert p.logprob_component == stage and p.inference_workers == (stage == "inference")
    assert p.weight_receivers == (("rollout", "inference") if stage else ("rollout",))
    if stage:
        assert not p.warnings
    else:  # placed but not started: the warning says why and what to change
        (warning,) = p.warnings
        assert warning.startswith("inference (GPU(s) 1) has nothing to compute") and "no inference workers" in warning
        assert "Remove `inference`" in warning and "compute_ref_logprobs: true" in warning
        assert ("sampling engine's" in warning) == ("runner.max_staleness=1" in overrides)
    # without inference workers the actor computes what is needed, or nobody does
    two = plan("cluster.num_gpus_per_node=2", "cluster.component_placement={rollout: 0, actor: 1}", *overrides)
    assert two.logprob_component == ("actor" if stage else None) and two.actor_logprobs == bool(stage)


@pytest.mark.parametrize("placement, shares, by_actor, receivers", [
    ("{rollout: 0, actor: 1}", False, True, ("rollout",)),
    ('{"actor,inference": 1, rollout: 0}', False, True, ("rollout",)),
    ('{"actor,rollout": 0, inference: 1}', True, False, ("rollout", "inference")),
    ('{"rollout,inference": 0, actor: 1}', False, False, ("rollout", "inference")),
])
def test_partly_shared_placements_decide_who_takes_turns_and_who_computes_log_probs(placement, shares, by_actor,
                                                                                  receivers):
    p = plan("cluster.num_gpus_per_node=2", f"cluster.component_placement={placement}", REF)
    assert (p.engines_share_actor, p.actor_logprobs, p.collocated) == (shares, by_actor, False)
    assert bool(p.turns) == (shares or "rollout,inference" in placement)
    assert p.weight_receivers == receivers
    # auto: broadcast, but not with two members of its group on one GPU (NCCL refuses that): the actor's rank 0
    # and an engine, or an engine and a log-prob worker; nor ipc, with a receiver on no actor GPU (a CUDA IPC
    # handle opens only where the sender's GPU is visible): the object store
    shared = "actor,rollout" in placement or ("rollout,inference" in placement and len(receivers) == 2)
    assert p.weight_transport == ("object_store" if shared else "broadcast")
    assert p.buffers_steps  # a consumer waits for its producer's phase: the channels hold a step
    assert [member for route in p.weight_routes for member in route.receivers] == [(n, 0) for n in receivers]
    assert not plan().buffers_steps and plan("runner.max_staleness=1").buffers_steps
    assert not plan(*THREE, REF).buffers_steps


def test_staleness_needs_the_rollout_apart_from_the_actor_not_inference_workers():
    assert plan("cluster.num_gpus_per_node=2", "cluster.component_placement={rollout: 0, actor: 1}",
                "runner.max_staleness=1").staleness == 1
    with pytest.raises(ConfigError, match="rollout and actor take turns on the same GPUs"):
        plan("cluster.num_gpus_per_node=2", 'cluster.component_placement={"actor,rollout": 0, inference: 1}',
             "runner.max_staleness=1")


def test_the_placement_is_checked():
    with pytest.raises(PlacementError, match="out of range"):
        plan("cluster.component_placement.actor=5")


def test_unquoted_joined_key_in_flow_mapping_explains_yaml_gotcha():
    with pytest.raises(ConfigError, match="YAML splits .* quote a joined key inside the braces"):
        plan("cluster.component_placement={actor,rollout: all}")


def test_unknown_advantage_estimator_suggests_registered_ones():
    with pytest.raises(ConfigError, match=r"no estimator named 'gpro'.*did you mean `grpo`"):
        plan("algorithm.adv_estimator=gpro")


def test_every_transport_works_collocated_and_ipc_needs_a_sender_on_every_receivers_gpu():
    for transport in ("broadcast", "object_store", "ipc"):
        assert plan(*COLLOCATED, f"runner.weight_sync={transport}").weight_transport == transport
    # the default pipeline: the engine on GPU 0, the actor on GPU 1 (one node, but a process sees its own GPUs only)
    with pytest.raises(ConfigError, match=r"ipc needs each receiver on the GPU of an actor rank that sends: rollout "
                                          r"rank 0 \(GPU 0\) shares no GPU with an actor rank .* Use auto"):
        plan("runner.weight_sync=ipc")
    with pytest.raises(ConfigError, match="not one of auto, object_store, broadcast, ipc"):
        resolve_weight_transport("nccl", plan().placement, ("rollout",))


def test_staleness_needs_the_disaggregated_pipeline():
    with pytest.raises(ConfigError, match="runner.max_staleness: 1 needs the rollout on GPUs of its own"):
        plan(*COLLOCATED, "runner.max_staleness=1")
    assert plan("runner.max_staleness=1").staleness == 1


def test_auto_weight_sync_resolves_by_mode_and_reach_and_says_why():
    assert resolve_weight_transport("auto", plan().placement, ("rollout", "inference"))[0] == "broadcast"
    transport, why = resolve_weight_transport("auto", plan(*COLLOCATED).placement, ("rollout",))
    assert transport == "ipc" and why.startswith("auto: actor and rollout take turns on every GPU")
    # a collocated engine on a node without an actor rank holding a whole replica (pipeline stage 1 only): no
    # ipc, and no broadcast either (the engine on the actor's GPU): the object store
    staged = load_config(overrides=["cluster.num_nodes=2", "cluster.num_gpus_per_node=1",
                                    'cluster.component_placement={"actor,rollout": all}',
                                    "actor.pipeline_parallel_size=2"])
    staged_plan = plan_run(staged, [1, 1])
    assert staged_plan.weight_transport == "object_store"
    assert "so no IPC: the slower object store carries the weights" in staged_plan.weight_transport_why
    assert "rollout rank 1 (GPU 1) shares no GPU with an actor rank" in staged_plan.weight_transport_why
    assert resolve_weight_transport("object_store", plan().placement, ("rollout",)) == ("object_store",
                                                                                       "set by runner.weight_sync")


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


def test_ipc_routes_pair_each_engine_with_the_gathering_rank_on_its_gpu():
    """Actor TP 2 collocated with TP-1 engines on two nodes: engines 0, 2, 4, 6 share a GPU with a gathering rank;
    1, 3, 5, 7 share none (their actor rank only helps gather), and a CUDA IPC handle from another GPU does not
    open in their processes: explicit ipc is refused naming one, auto takes the object store."""
    placement = ["cluster.num_nodes=2", "cluster.num_gpus_per_node=4",
                 'cluster.component_placement={"actor,rollout": all}', "actor.tensor_parallel_size=2"]
    p = plan_run(load_config(overrides=placement), [4, 4])
    assert gathering_ranks(p.placement.components["actor"]) == [0, 2, 4, 6]  # tensor rank 0 of each replica
    assert p.weight_transport == "object_store"
    with pytest.raises(ConfigError, match=r"rollout rank 1 \(GPU 1\) shares no GPU with an actor rank"):
        plan_run(load_config(overrides=[*placement, "runner.weight_sync=ipc"]), [4, 4])
    same_tp = plan_run(load_config(overrides=[*placement, "rollout.tensor_parallel_size=2"]), [4, 4])
    assert same_tp.weight_transport == "ipc"
    assert {r.sender: [rank for _, rank in r.receivers] for r in same_tp.weight_routes} == {0: [0], 2: [1], 4: [2],
                                                                                           6: [3]}
    split = load_config(overrides=["cluster.num_nodes=2", "cluster.num_gpus_per_node=4",
                                   "cluster.component_placement={rollout: 0-3, inference: 4-5, actor: 6-7}"])
    assert plan_run(split, [4, 4]).weight_transport == "broadcast"


def test_packed_collocated_engines_take_weights_from_the_actor_rank_on_their_first_gpu():
    """Actor TP 1 and rollout TP 2 on four GPUs: two engines of two GPUs each; every actor rank holds a whole
    replica, and each engine is served over ipc by the rank that shares its first GPU."""
    p = plan("cluster.num_gpus_per_node=4", 'cluster.component_placement={"actor,rollout": all}',
             "rollout.tensor_parallel_size=2", "runner.weight_sync=auto")
    assert p.collocated and p.weight_transport == "ipc" and gathering_ranks(p.placement.components["actor"]) == [
        0, 1, 2, 3]
    assert [(r.sender, r.receivers) for r in p.weight_routes] == [(0, (("rollout", 0),)), (2, (("rollout", 1),))]


def test_with_sglang_engines_every_worker_gets_one_nccl_cumem_setting(monkeypatch):
    """sglang sets NCCL_CUMEM_ENABLE=0 in its process unless set; the actor's NCCL must agree with its schedulers."""
    from rlinf_pipe.runner.components import nccl_env

    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert nccl_env(load_config(), "broadcast") == {}  # (the torch engine: NCCL's own default everywhere)
    sglang = load_config(overrides=["rollout.backend=sglang"])
    assert nccl_env(sglang, "broadcast") == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    assert nccl_env(sglang, "ipc") == {}  # (no NCCL group with sglang's ranks)
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # the user's choices, for every worker
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert nccl_env(sglang, "broadcast") == {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "1"}


def test_megatron_workers_split_over_gpus_get_one_cuda_queue_unless_the_user_set_it(monkeypatch):
    from rlinf_pipe.runner.components import megatron_env

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert megatron_env(1) == {}
    assert megatron_env(2) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    assert megatron_env(2) == {"CUDA_DEVICE_MAX_CONNECTIONS": "4"}


def test_a_sample_longer_than_the_models_context_is_refused_naming_the_keys(tmp_path):
    """SGLang would shorten each request's max_new_tokens without a word; the torch engine and Megatron would run
    at positions the model never saw."""
    from rlinf_pipe.models.tiny import ensure_tiny_model
    from rlinf_pipe.runner.preflight import preflight

    model = str(ensure_tiny_model(tmp_path / "models"))  # max_position_embeddings 512
    preflight(load_config("examples/math/config", "tiny-grpo-megatron", [
        f"actor.model_path={model}", "data.max_prompt_length=478", "rollout.max_new_tokens=32"]))  # 510: fits
    for name in (model, "tiny"):  # (a folder, and the built-in model read from its spec before it is built)
        with pytest.raises(ConfigError, match=r"data.max_prompt_length \(479\) \+ rollout.max_new_tokens \(32\) = "
                                              r"511 tokens does not fit the context of .*\(512 tokens, from its "
                                              r"config.json, of which SGLang keeps 2 spare\): .* at most 510"):
            preflight(load_config("examples/math/config", "tiny-grpo-megatron", [
                f"actor.model_path={name}", "data.max_prompt_length=479", "rollout.max_new_tokens=32"]))


@pytest.mark.parametrize(("fields", "context"), [
    ({"max_position_embeddings": 4096}, 4096),
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 16384),
    ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}}, 32768),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
    ({"seq_length": 2048, "max_position_embeddings": 4096}, 2048),
    ({}, 2048),
])
def test_the_context_length_is_read_as_sglang_reads_it(fields, context):
    from types import SimpleNamespace

    from rlinf_pipe.runner.model_fit import context_length

    assert context_length(SimpleNamespace(**fields)) == context



def test_each_node_checks_the_models_its_workers_read_and_the_actor_nodes_the_run_folder(tmp_path):
    from rlinf_pipe.runner.components import node_paths
    from rlinf_pipe.runner.driver_inputs import DriverInputs

    p = plan_run(load_config(overrides=["cluster.num_nodes=3", REF,
                                        "cluster.component_placement={rollout: 0-3, inference: 4, actor: 5-6}"]),
                 [2, 3, 3])  # nodes: GPUs 0-1, 2-4, 5-7
    inputs = DriverInputs("/m/actor", "/m/rollout", None, [], 0)  # type: ignore[arg-type]
    wants = node_paths(p, inputs, tmp_path, "tok")
    described = {node: sorted((w.key, w.path, w.kind, w.token) for w in paths) for node, paths in wants.items()}
    assert described == {
        0: [("rollout.model_path", "/m/rollout", "model", "")],
        1: [("actor.model_path", "/m/actor", "model", ""), ("rollout.model_path", "/m/rollout", "model", "")],
        2: [("actor.model_path", "/m/actor", "model", ""),
            ("runner.output_dir", str(tmp_path / ".node-probe"), "shared", "tok")],
    }


def test_actor_nodes_check_a_checkpoint_resumed_from_outside_the_run_folder(tmp_path):
    """A checkpoint in the run folder is seen where the run folder is; one elsewhere (another run's) is probed on
    every actor node by its actor part's completion record."""
    from rlinf_pipe.runner.components import node_paths
    from rlinf_pipe.runner.driver_inputs import DriverInputs

    p = plan_run(load_config(overrides=["cluster.num_nodes=2", REF,
                                        "cluster.component_placement={rollout: 0-1, actor: 2-3}"]), [2, 2])
    inputs = DriverInputs("/m/actor", "/m/actor", None, [], 0)  # type: ignore[arg-type]
    run_dir = tmp_path / "run"
    inside = node_paths(p, inputs, run_dir, "tok", run_dir / "checkpoints" / "step_4")
    other = tmp_path / "old-run" / "checkpoints" / "step_4"
    outside = node_paths(p, inputs, run_dir, "tok", other)
    assert [w.kind for w in inside[1]] == ["model", "shared"]
    assert [(w.key, w.path, w.kind) for w in outside[1] if w.kind == "file"] == [
        ("runner.resume_dir", str(other / "actor" / "COMPLETE"), "file")]
    assert all(w.kind != "file" for w in outside[0])  # node 0 runs no actor rank


def test_a_missing_file_is_named_with_who_needs_it(tmp_path):
    from rlinf_pipe.runtime.node_paths import NodePath, missing_here

    there = tmp_path / "COMPLETE"
    there.write_text("{}")
    wants = [NodePath("runner.resume_dir", str(there), "file", "the actor"),
             NodePath("runner.resume_dir", str(tmp_path / "gone"), "file", "the actor")]
    assert missing_here(wants) == [f"runner.resume_dir: no file {tmp_path / 'gone'} (needed by the actor)"]


def test_paths_handed_to_workers_keep_their_symlinks(tmp_path, monkeypatch):
    """A link that each node points at its own copy names the same folder everywhere; its target may not."""
    from rlinf_pipe.runner.driver_inputs import run_model_path
    from rlinf_pipe.runner.run_dir import create_run_dir

    target = tmp_path / "raid" / "model"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (tmp_path / "models").symlink_to(tmp_path / "raid")
    (tmp_path / "out-target").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "out-target")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=["runner.output_dir=out", "runner.experiment_name=e"])
    assert run_model_path("models/model", cfg) == str(tmp_path / "models" / "model")
    assert create_run_dir(cfg).parent == tmp_path / "out" / "e"


def test_a_tokenizer_that_drops_spaces_is_refused_before_launch():
    """(Some transformers 5 releases load DeepSeek-R1-Distill-Qwen's ByteLevel tokenizer as a Llama one that drops
    every space: every prompt garbled, silently.)"""
    from rlinf_pipe.runner.driver_inputs import check_round_trip

    class SpaceDropping:
        def __call__(self, text, add_special_tokens=True):
            return type("Encoded", (), {"input_ids": list(text.replace(" ", "").encode())})()

        def decode(self, ids):
            return bytes(ids).decode()

    with pytest.raises(ConfigError, match=r"does not give back the text it encodes: .* -> 'Whatis12\+30\?"):
        check_round_trip(SpaceDropping(), "/models/r1")
    from transformers import AutoTokenizer

    from rlinf_pipe.models.tiny import ensure_tiny_model

    check_round_trip(AutoTokenizer.from_pretrained(str(ensure_tiny_model())), "tiny")  # a sound one passes


def test_the_driver_reads_answers_only_after_the_reasoning_where_the_chat_template_opens_it():
    """reward.thinking `auto`: DeepSeek-R1-Distill's template ends the prompt in `<think>`; the run then takes
    `closed` (a response cut off before `</think>` states no answer), which the reward workers get in the config."""
    from transformers import AutoTokenizer

    from rlinf_pipe.models.tiny import ensure_tiny_model
    from rlinf_pipe.engines.reward.extract import resolve_thinking

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    cfg = load_config()
    resolve_thinking(cfg, tokenizer)
    assert cfg.reward.thinking == "auto"  # the tiny model's template opens no block
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}")
    resolve_thinking(cfg, tokenizer)
    assert cfg.reward.thinking == "closed"
    kept = load_config(overrides=["reward.thinking=ignore"])
    resolve_thinking(kept, tokenizer)
    assert kept.reward.thinking == "ignore"


def test_the_tiny_model_of_a_run_on_a_dataset_file_is_warm_started_on_arithmetic(tmp_path, monkeypatch):
    """A run with only data.dataset set (a verl parquet, an RLinf jsonl) on the default `tiny` model: the warm start
    teaches the answer format on arithmetic problems with the run's template (the warm start reads no file)."""
    from rlinf_pipe.models import warmstart
    from rlinf_pipe.runner.driver_inputs import run_model_path

    seen = []
    monkeypatch.setattr(warmstart, "ensure_warm_tiny_model",
                        lambda cache, data: seen.append(data) or tmp_path / "warm")
    cfg = load_config(overrides=[f"data.dataset={tmp_path / 'train.parquet'}", "data.system_prompt=Be brief."])
    assert run_model_path("tiny", cfg) == str(tmp_path / "warm")
    assert seen[0].dataset == "arithmetic" and seen[0].system_prompt == "Be brief."
    assert cfg.data.dataset.endswith("train.parquet")  # (the run's own config is left as it is)


def test_placement_gpus_on_one_device_count_as_one_gpu(monkeypatch):
    """The GPU suite runs the two-GPU placements on a machine with one GPU (`RLINF_PIPE_NODE_VISIBLE_DEVICES=0,0`):
    NCCL cannot put the actor and the engine on one device, and a CUDA IPC handle opens there, so `auto` takes ipc
    and ipc routes each receiver to the actor rank on its device."""
    from rlinf_pipe.planning.weight_routes import NODE_DEVICES_ENV, gpu_devices

    hybrid = load_config("examples/math/config", "tiny-grpo-megatron-hybrid")
    assert plan().weight_transport == "broadcast" and plan_run(hybrid).weight_transport == "object_store"
    monkeypatch.setenv(NODE_DEVICES_ENV, "0,0")
    assert gpu_devices(plan().placement.components.values()) == {0: "0", 1: "0"}
    assert plan().weight_transport == "ipc" and plan("runner.weight_sync=ipc").weight_routes[0].sender == 0
    assert plan_run(hybrid).weight_transport == "ipc"
    assert [r.receivers for r in plan_run(hybrid).weight_routes] == [(("rollout", 0), ("inference", 0))]
    monkeypatch.setenv(NODE_DEVICES_ENV, "0,1")  # (devices of their own: as without it)
    assert plan().weight_transport == "broadcast"
    two_nodes = load_config(overrides=["cluster.num_nodes=2", "cluster.num_gpus_per_node=1"])
    assert gpu_devices(plan_run(two_nodes, [1, 1]).placement.components.values()) == {}  # (one node's list only)
