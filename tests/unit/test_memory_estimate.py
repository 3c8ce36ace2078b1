"""The per-GPU memory estimate of `rlinf-pipe plan`: parameter counts against the real model class, the example
configs against 80 GB, and the direction of every knob the warning names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlinf_pipe.cli import main
from rlinf_pipe.config import load_config
from rlinf_pipe.models.arch import model_arch
from rlinf_pipe.models.known import known_config
from rlinf_pipe.planning.memory import GIB, PROCESS_OVERHEAD, estimate_memory, gpu_capacity_bytes, memory_report
from rlinf_pipe.planning.model_sizes import kv_cache_bytes, layer_params, num_params, params_per_rank
from rlinf_pipe.planning.run_plan import plan_run
from rlinf_pipe.planning.placement import plan_placement
from rlinf_pipe.planning.plan_report import render_plan

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "math" / "config"
R1_DISTILL = "/models/DeepSeek-R1-Distill-Qwen-1.5B"  # not on this machine: the shipped config.json is used
CAPACITY = 80 * 10**9


def _estimate(config_name: str, *overrides: str) -> dict:
    """The estimate of an example config, with the weight transport its run would use."""
    cfg = load_config(CONFIGS, config_name, overrides)
    shape, _ = model_arch(cfg.actor.model_path)
    assert shape is not None
    return estimate_memory(cfg, plan_run(cfg), shape, CAPACITY)


def _meta_model_params(hf_config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


@pytest.mark.parametrize("tied", [False, True])
def test_shape_counts_the_parameters_of_the_real_model_class(tied):
    hf_config = AutoConfig.from_pretrained(str(known_config(R1_DISTILL).parent))
    hf_config.tie_word_embeddings = tied
    shape, _ = model_arch(R1_DISTILL)
    if tied:
        from rlinf_pipe.models.arch import hf_arch

        shape = hf_arch(hf_config)
    assert num_params(shape) == _meta_model_params(hf_config)
    assert num_params(shape) == (1_777_088_000 if not tied else 1_543_714_304)
    # TP halves the layers and the (vocab-split) embedding; PP puts the ends on the first and last stage
    one, tp2, pp2 = params_per_rank(shape, 1, 1), params_per_rank(shape, 2, 1), params_per_rank(shape, 1, 2)
    assert abs(one - num_params(shape)) <= shape.hidden_size
    assert tp2 == pytest.approx(one / 2, rel=1e-3)
    assert params_per_rank(shape, 1, 1) > pp2 > shape.num_layers // 2 * layer_params(shape)


def test_the_tiny_model_has_a_shape():
    shape, source = model_arch("tiny")
    assert shape is not None and source == "the tiny model" and num_params(shape) > 0
    shape, source = model_arch(R1_DISTILL)  # not on this machine: the estimate says whose config it read
    assert shape is not None and source.startswith(str(known_config(R1_DISTILL)))
    assert f"no model folder at {R1_DISTILL} on this machine" in source


@pytest.mark.parametrize("config_name", ["qwen2.5-1.5b-grpo-megatron-pipeline", "qwen2.5-1.5b-grpo-megatron",
                                         "qwen2.5-1.5b-grpo-megatron-pipeline-1node"])
def test_the_example_configs_fit_80gb_gpus(config_name):
    estimate = _estimate(config_name)
    assert set(estimate) >= {"actor", "rollout"}
    for memory in estimate.values():
        assert memory.fits, f"{config_name}: {memory.component} needs {memory.total / GIB:.1f} GiB"
    actor = estimate["actor"].per_gpu_bytes
    # the response length the examples train on is long: activations are the actor's largest part
    assert actor["activations"] == max(actor.values())


def test_what_the_examples_used_to_say_does_not_fit():
    """Micro-batches of 4 x (1024 + 8192) tokens without recompute: the issue's "well over 80 GB per GPU"."""
    estimate = _estimate("qwen2.5-1.5b-grpo-megatron-pipeline", "actor.micro_batch_tokens=null",
                         "actor.micro_batch_size=4", "actor.recompute=none", "actor.tensor_parallel_size=2")
    assert not estimate["actor"].fits and estimate["actor"].total > 2 * CAPACITY
    # micro-batches that grow while the actor is behind (actor.max_micro_batch_size) are sized at their largest
    fixed = _estimate("qwen2.5-1.5b-grpo-megatron-pipeline", "actor.micro_batch_tokens=null", "actor.micro_batch_size=1")
    grown = _estimate("qwen2.5-1.5b-grpo-megatron-pipeline", "actor.micro_batch_tokens=null", "actor.micro_batch_size=1",
                      "actor.max_micro_batch_size=4")
    assert grown["actor"].per_gpu_bytes["activations"] > fixed["actor"].per_gpu_bytes["activations"]


def test_each_knob_the_warning_names_lowers_the_estimate():
    base = "qwen2.5-1.5b-grpo-megatron-pipeline"
    actor = _estimate(base)["actor"].per_gpu_bytes
    assert _estimate(base, "actor.recompute=full")["actor"].per_gpu_bytes["activations"] < actor["activations"]
    assert _estimate(base, "actor.recompute=none")["actor"].per_gpu_bytes["activations"] > actor["activations"]
    halved = _estimate(base, "actor.micro_batch_tokens=4608")["actor"].per_gpu_bytes
    assert halved["activations"] < actor["activations"]
    tp2 = _estimate(base, "actor.tensor_parallel_size=2")["actor"].per_gpu_bytes
    assert tp2["weights"] == pytest.approx(actor["weights"] / 2, rel=1e-3) and tp2["grads"] < actor["grads"]
    # the distributed optimizer divides Adam's state (and the fp32 master weights) over the replicas
    dp2 = _estimate(base, "cluster.component_placement.actor=24-25")["actor"].per_gpu_bytes
    assert dp2["optimizer"] == pytest.approx(4 * actor["optimizer"], rel=1e-6)
    assert dp2["weights"] == actor["weights"]
    fp32 = _estimate(base, "actor.params_dtype=float32")["actor"].per_gpu_bytes
    assert fp32["weights"] == 2 * actor["weights"] and fp32["optimizer"] < actor["optimizer"]  # no master copy


def test_sglang_takes_its_memory_fraction_of_what_is_free_and_less_when_collocated():
    """sglang 0.5.23 sizes its KV cache as `mem_fraction_static` of the memory free when it starts, less its weights:
    the CUDA contexts of the set's processes are not free (one process alone, the engine and the actor collocated)."""
    alone = _estimate("qwen2.5-1.5b-grpo-megatron-pipeline")["rollout"]
    weights = alone.per_gpu_bytes["weights"]
    assert alone.per_gpu_bytes["kv_cache"] == pytest.approx(0.85 * (CAPACITY - PROCESS_OVERHEAD) - weights, abs=1)
    shared = _estimate("qwen2.5-1.5b-grpo-megatron")["rollout"]
    assert shared.per_gpu_bytes["kv_cache"] == pytest.approx(0.5 * (CAPACITY - 2 * PROCESS_OVERHEAD) - weights, abs=1)
    tuned = _estimate("qwen2.5-1.5b-grpo-megatron", "rollout.gpu_memory_fraction=0.3")["rollout"]
    assert tuned.per_gpu_bytes["kv_cache"] == pytest.approx(0.3 * (CAPACITY - 2 * PROCESS_OVERHEAD) - weights, abs=1)
    assert alone.per_gpu_bytes["resident"] == 0
    # the actor offloads its state: beside the collocated engine stay only the ipc transport's slots (tested below)
    assert 0 < shared.per_gpu_bytes["resident"] < weights


SHARED_WITH_INFERENCE = ('cluster.component_placement={"rollout,inference": 0-23, actor: 24-31}',)


@pytest.mark.parametrize("ref", [False, True])
def test_log_prob_workers_on_the_engines_gpus_keep_their_models_there(ref):
    """While the engines generate, the log-prob workers' models stay loaded on the same GPUs (twice with reference
    log-probs): counted for the engine, and out of the memory sglang finds free when it starts."""
    base = "qwen2.5-1.5b-grpo-megatron-pipeline"
    extra = (f"algorithm.compute_ref_logprobs={str(ref).lower()}", "rollout.gpu_memory_fraction=0.7")
    estimate = _estimate(base, *SHARED_WITH_INFERENCE, *extra)
    rollout, inference = estimate["rollout"].per_gpu_bytes, estimate["inference"].per_gpu_bytes
    assert rollout["resident"] == inference["weights"] == (2 if ref else 1) * rollout["weights"]
    free = CAPACITY - rollout["resident"] - 2 * PROCESS_OVERHEAD
    assert rollout["kv_cache"] == pytest.approx(0.7 * free - rollout["weights"], abs=1)
    assert inference["resident"] == 0  # the engines release theirs while they sleep
    assert _estimate(base, *extra)["rollout"].per_gpu_bytes["resident"] == 0  # inference on GPUs of its own


def test_an_sglang_share_that_cannot_hold_its_weights_does_not_fit_and_says_why():
    cfg = load_config(CONFIGS, "qwen2.5-1.5b-grpo-megatron-pipeline", [
        *SHARED_WITH_INFERENCE, "algorithm.compute_ref_logprobs=true", "cluster.gpu_memory_gb=24",
        "rollout.gpu_memory_fraction=0.25"])
    report = memory_report(cfg, plan_run(cfg))
    rollout = report.components["rollout"]
    assert rollout.total < rollout.capacity_bytes and not rollout.fits and rollout.per_gpu_bytes["kv_cache"] == 0
    (warning,) = [w for w in report.warnings() if w.startswith("rollout:")]
    assert "rollout.gpu_memory_fraction 0.25 of the" in warning and "log-prob workers' models" in warning
    assert "raise rollout.gpu_memory_fraction" in warning and "inference.tensor_parallel_size" in warning
    assert rollout.to_json()["problem"] == rollout.problem and "DOES NOT FIT" in render_plan(plan_placement(cfg), report)


def test_collocated_actor_phase_holds_the_reference_model_only_when_it_is_used():
    with_ref = _estimate("qwen2.5-1.5b-grpo-megatron", "algorithm.compute_ref_logprobs=true")["actor"].per_gpu_bytes[
        "weights"]
    without = _estimate("qwen2.5-1.5b-grpo-megatron")  # kl_coef 0: no reference model by default
    assert with_ref == 2 * without["actor"].per_gpu_bytes["weights"]


def test_capacity_comes_from_the_config_else_the_gpu_else_80gb(monkeypatch):
    assert gpu_capacity_bytes(load_config(overrides=["cluster.gpu_memory_gb=24"])) == 24 * 10**9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_capacity_bytes(load_config()) == CAPACITY


def test_a_model_without_config_json_gives_a_reason_not_a_crash(tmp_path):
    cfg = load_config(overrides=[f"actor.model_path={tmp_path / 'missing-model'}"])
    report = memory_report(cfg, plan_run(cfg))
    assert report.components == {} and "config.json" in report.note and report.warnings() == []
    assert "memory: no estimate (no config.json at" in render_plan(plan_placement(cfg), report)


def test_inference_workers_that_do_not_start_have_no_estimate_and_no_share():
    """Inference placed for an algorithm with no log-prob pass is not started: no estimate of its own, and the engine
    on the same GPUs counts one process there (its CUDA context), not two."""
    base = "qwen2.5-1.5b-grpo-megatron-pipeline"
    assert "inference" in _estimate(base)  # 4 mini-batches a step: the old log-probs are recomputed
    one_update = ("algorithm.n_minibatches=1",)
    assert "inference" not in _estimate(base, *one_update)
    assert "inference" in _estimate(base, *one_update, "algorithm.compute_ref_logprobs=true")
    shared = ('cluster.component_placement={"rollout,inference": 0-23, actor: 24-31}',)
    idle = _estimate(base, *one_update, *shared)["rollout"].per_gpu_bytes["activations"]
    busy = _estimate(base, *one_update, *shared, "algorithm.compute_ref_logprobs=true")["rollout"].per_gpu_bytes
    assert busy["activations"] - idle == pytest.approx(PROCESS_OVERHEAD, rel=1e-6)
    # ... and the engines, which then take no turns (no device locks), keep SGLang's share of GPUs of their own
    alone = _estimate(base, *one_update, *shared)["rollout"].per_gpu_bytes
    assert alone["resident"] == 0
    assert alone["kv_cache"] == pytest.approx(0.85 * (CAPACITY - PROCESS_OVERHEAD) - alone["weights"], abs=1)


def test_the_torch_engine_holds_the_whole_model_on_one_gpu_whatever_its_tp():
    base = ("qwen2.5-1.5b-grpo-megatron-pipeline", "rollout.backend=torch")
    one, two = (_estimate(*base, f"rollout.tensor_parallel_size={tp}")["rollout"].per_gpu_bytes for tp in (1, 2))
    assert one == two and one["weights"] == 2 * params_per_rank(model_arch(R1_DISTILL)[0], 1, 1)


def test_an_sglang_kv_cache_shorter_than_one_sample_does_not_fit_and_says_why():
    """sglang 0.5.23 caps each request's max_new_tokens to what its KV cache can hold (scheduler.py,
    `max_new_tokens_for_memory`): responses would be cut short without a word."""
    name, capacity = "qwen2.5-1.5b-grpo-megatron-pipeline", ("cluster.gpu_memory_gb=24",)
    roomy = _estimate(name, *capacity)["rollout"]
    assert roomy.fits and not roomy.problem
    free = 24 * 10**9 - PROCESS_OVERHEAD
    fraction = (roomy.per_gpu_bytes["weights"] + 100 * 2**20) / free  # a KV cache of 100 MiB: about 3.6k tokens
    cfg = load_config(CONFIGS, name, [*capacity, f"rollout.gpu_memory_fraction={fraction:.6f}"])
    rollout = memory_report(cfg, plan_run(cfg)).components["rollout"]
    assert not rollout.fits and rollout.per_gpu_bytes["kv_cache"] > 0
    seq_len = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    assert f"fewer than one sample's data.max_prompt_length + rollout.max_new_tokens = {seq_len}" in rollout.problem
    assert "cut responses short" in rollout.problem and "lower rollout.max_new_tokens" in rollout.problem


def test_tensor_parallel_ranks_past_the_kv_head_count_each_hold_a_whole_head():
    """sglang replicates KV heads over ranks when TP exceeds their count (the 1.5B model has 2)."""
    shape, _ = model_arch(R1_DISTILL)
    assert shape is not None and shape.num_kv_heads == 2
    one = kv_cache_bytes(shape, 1, 1, 1)
    assert kv_cache_bytes(shape, 1, 1, 2) == one / 2 == kv_cache_bytes(shape, 1, 1, 4) == kv_cache_bytes(shape, 1, 1, 8)


@pytest.mark.parametrize("backend", ["sglang", "torch"])
def test_the_engines_weights_are_counted_in_their_own_dtype_not_the_actors(backend):
    """SGLang loads the folder's weights as they are (`dtype=auto`: bf16 for this checkpoint), the torch engine in
    bf16 on GPUs, whatever `actor.params_dtype` (an fp32 actor once doubled the engine's row)."""
    name, engine = "qwen2.5-1.5b-grpo-megatron-pipeline", f"rollout.backend={backend}"
    fp32 = load_config(CONFIGS, name, [engine, "actor.params_dtype=float32"])
    rollout = memory_report(fp32, plan_run(fp32)).components["rollout"]
    assert rollout.per_gpu_bytes["weights"] == 2 * params_per_rank(model_arch(R1_DISTILL)[0], 1, 1)
    actor = memory_report(fp32, plan_run(fp32)).components["actor"]
    assert actor.per_gpu_bytes["weights"] == 4 * params_per_rank(model_arch(R1_DISTILL)[0], 1, 1)


def test_a_checkpoints_dtype_is_read_from_its_config():
    from transformers import PretrainedConfig

    from rlinf_pipe.models.arch import model_config
    from rlinf_pipe.planning.memory import dtype_bytes_of

    assert dtype_bytes_of(model_config(R1_DISTILL)[0]) == 2  # torch_dtype: bfloat16
    assert dtype_bytes_of(model_config("tiny")[0]) == 4  # the tiny model is saved in float32
    assert dtype_bytes_of(PretrainedConfig()) == 2  # (says nothing)


def test_what_stays_on_the_gpu_beside_a_collocated_actor_and_its_engines():
    """The `ipc` transport's two bucket slots (the largest bucket: the 1.5B model's embedding, 151,936 x 1,536 bf16)
    stay on the actor's GPUs through every phase, and SGLang takes its weights back onto them to load a version
    while the actor still holds its state; neither is there with the pipeline's broadcast to GPUs of their own."""
    from rlinf_pipe.planning.memory import ipc_slot_bytes

    cfg = load_config(CONFIGS, "qwen2.5-1.5b-grpo-megatron")
    shape, _ = model_arch(cfg.actor.model_path)
    slots = ipc_slot_bytes(cfg, shape, 2)
    assert slots == 2 * 151_936 * 1_536 * 2
    unknown = _estimate("qwen2.5-1.5b-grpo-megatron", "runner.weight_sync=object_store")  # (no slots, nothing taken back)
    ipc = _estimate("qwen2.5-1.5b-grpo-megatron")
    engine_weights = params_per_rank(shape, cfg.rollout.tensor_parallel_size, 1) * 2
    assert unknown["actor"].per_gpu_bytes["resident"] == 0
    assert ipc["actor"].per_gpu_bytes["resident"] == pytest.approx(slots + engine_weights, abs=1)
    assert ipc["rollout"].per_gpu_bytes["resident"] == slots
    # (made after SGLang sized its KV cache from the memory free when it started: that share is unchanged)
    assert ipc["rollout"].per_gpu_bytes["kv_cache"] == unknown["rollout"].per_gpu_bytes["kv_cache"]
    assert all(ipc[name].fits for name in ipc)
    pipeline = _estimate("qwen2.5-1.5b-grpo-megatron-pipeline")
    assert all(memory.per_gpu_bytes["resident"] == 0 for memory in pipeline.values())


def test_sequence_and_context_parallelism_divide_the_actors_activations_and_plan_names_the_cp_that_fits(capsys):
    """SP divides what TP alone replicates (the norms' and projections' inputs); CP gives each rank a slice of every
    sequence (keeping the others' keys and values). A 17k-token sample's activations do not fit one actor GPU of
    the 1.5B model: the estimate names the CP size that does, and the long-response example, which takes it, fits."""
    from rlinf_pipe.planning.model_sizes import layer_activations, training_activations

    shape, _ = model_arch(R1_DISTILL)
    assert layer_activations(shape, 2, sequence_parallel=True) < layer_activations(shape, 2)
    one = training_activations(shape, 17408, 17408, 1, 1, "selective")
    halves = training_activations(shape, 17408, 17408, 1, 1, "selective", cp=2)
    assert one / 2 < halves < one * 0.6  # (half the tokens, plus the gathered keys and values)
    long = ["--no-files", str(CONFIGS / "qwen2.5-1.5b-grpo-megatron-long-1node.yaml")]
    assert main(["plan", *long, "actor.context_parallel_size=1"]) == 0
    warning = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: actor:"))
    assert "(activations" in warning and "actor.context_parallel_size: 2 fits 17408-token samples" in warning
    assert main(["plan", *long]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out and "warning" not in out


def test_the_contexts_of_sglang_ranks_mapping_buckets_on_the_first_gpu_are_counted_and_refused_with_the_fix():
    """With TP > 1 over the object store (or ipc) every bucket lies on the engine's first GPU and each other rank
    opens a CUDA context there after SGLang sized its KV cache; a broadcast reaches each rank on its own GPU."""
    from rlinf_pipe.planning.engine_sizes import PEER_CONTEXT_BYTES

    base = ("qwen2.5-1.5b-grpo-megatron-pipeline", "rollout.tensor_parallel_size=4")
    stored = _estimate(*base, "runner.weight_sync=object_store")["rollout"]
    broadcast = _estimate(*base)["rollout"]
    assert stored.per_gpu_bytes["resident"] == 3 * PEER_CONTEXT_BYTES and broadcast.per_gpu_bytes["resident"] == 0
    assert stored.per_gpu_bytes["kv_cache"] == broadcast.per_gpu_bytes["kv_cache"] and stored.fits
    tight = _estimate(*base, "runner.weight_sync=object_store", "rollout.gpu_memory_fraction=0.98")["rollout"]
    assert not tight.fits and "use runner.weight_sync=broadcast" in tight.problem
    assert "rollout.gpu_memory_fraction <= 0.97" in tight.problem and "3 other TP ranks" in tight.problem
    assert _estimate(*base, "runner.weight_sync=object_store", "rollout.gpu_memory_fraction=0.97")["rollout"].fits
    assert _estimate(*base, "rollout.gpu_memory_fraction=0.98")["rollout"].fits  # (broadcast: nothing mapped there)


def test_context_parallel_log_prob_workers_hold_a_slice_of_every_sequence_and_sequence_parallel_ones_the_same():
    """inference.context_parallel_size as the actor's: each rank of a log-prob replica runs 1/CP of the pass's
    tokens and keeps the gathered keys and values of its layer; its weights are whole on every CP rank. Forward
    only, sequence parallelism keeps the peak (each projection gathers the whole sequence again). Both placed and
    estimated: TP 2 x CP 2 (with SP) on 4 log-prob GPUs is one replica."""
    from rlinf_pipe.planning.model_sizes import forward_activations

    shape, _ = model_arch(R1_DISTILL)
    one, halves = forward_activations(shape, 17408, 1), forward_activations(shape, 17408, 1, cp=2)
    assert one / 2 < halves < one * 0.6  # (half the tokens, plus the gathered keys and values)
    long = ("qwen2.5-1.5b-grpo-megatron-long-1node", "algorithm.compute_ref_logprobs=true")
    base = _estimate(*long)["inference"].per_gpu_bytes
    cp2 = _estimate(*long, "inference.context_parallel_size=2")
    assert cp2["inference"].per_gpu_bytes["weights"] == base["weights"]
    assert cp2["inference"].per_gpu_bytes["activations"] - PROCESS_OVERHEAD == pytest.approx(
        forward_activations(shape, 17408, 1, cp=2), rel=1e-9)
    assert cp2["inference"].per_gpu_bytes["activations"] < base["activations"]
    wide = ("cluster.num_gpus_per_node=10", "cluster.component_placement={rollout: 0-3, inference: 4-7, actor: 8-9}",
            "inference.tensor_parallel_size=2", "inference.context_parallel_size=2")
    tp2cp2 = _estimate(*long, *wide)["inference"].per_gpu_bytes
    assert tp2cp2 == _estimate(*long, *wide, "inference.sequence_parallel=true")["inference"].per_gpu_bytes
    assert tp2cp2["activations"] - PROCESS_OVERHEAD == pytest.approx(forward_activations(shape, 17408, 2, cp=2),
                                                                     rel=1e-9)
    from rlinf_pipe.planning.run_plan import plan_run

    placed = plan_run(load_config(CONFIGS, long[0], [*long[1:], *wide])).placement.components["inference"]
    assert (placed.tp, placed.cp, placed.dp) == (2, 2, 1)
