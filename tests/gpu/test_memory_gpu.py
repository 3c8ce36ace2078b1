"""A training micro-batch at the example configs' shape fits one GPU, and the estimate of `rlinf-pipe plan` is not
below what it really takes: DeepSeek-R1-Distill-Qwen-1.5B (randomly initialised from the shipped `config.json`),
bf16, selective recompute, one sequence of 1024 + 8192 tokens, two optimizer steps at DP 1. The measured peak and
the estimate are printed (`pytest -s`) for docs/memory.md. The second step's peak (Adam's moments exist from the first
step on), reserved plus what the process holds outside the allocator, must be within the estimate, and the estimate
not more than 15% above it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from support.actor_run import LOSS, one_sequence_batch, spawn
from support.gpu import backend, measures_memory

from rlinf_pipe.config import load_config
from rlinf_pipe.models.known import known_config
from rlinf_pipe.models.arch import model_arch
from rlinf_pipe.planning.memory import GIB, estimate_memory
from rlinf_pipe.planning.run_plan import plan_run

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.gpu

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "math" / "config"
EXAMPLE = "qwen2.5-1.5b-grpo-megatron-pipeline"
MODEL = "DeepSeek-R1-Distill-Qwen-1.5B"


def _one_step(rank: int, model_path: str, tokens: int, recompute: str) -> dict:
    from rlinf_pipe.engines.policy.policy import MegatronPolicy

    policy = MegatronPolicy(model_path, lr=1e-6, params_dtype="bfloat16", recompute=recompute, load_weights=False)
    batch = one_sequence_batch(policy.vocab_size, tokens)
    # Adam's moments appear at the first optimizer step: only from the second step on does the backward pass run
    # beside the whole state, so the second step is the one measured (the first one's peak is reported too).
    peaks = []
    for _ in range(2):
        if measures_memory():
            torch.cuda.reset_peak_memory_stats()
        policy.train_micro_batch(batch, LOSS)
        metrics = policy.optimizer_step()
        peaks.append(torch.cuda.max_memory_allocated() if measures_memory() else 0)
    if not measures_memory():
        return {"peak": 0, "first_peak": 0, "loss": metrics["loss"], "reserved": 0, "held": 0, "context": 0}
    free, total = torch.cuda.mem_get_info()
    # the only process on its GPU: what the driver counts beyond the allocator's reservation is the CUDA context
    return {"peak": peaks[1], "first_peak": peaks[0], "loss": metrics["loss"],
            "reserved": torch.cuda.max_memory_reserved(), "held": torch.cuda.memory_allocated(),
            "context": total - free - torch.cuda.memory_reserved()}


def test_a_micro_batch_at_the_example_shape_fits_within_the_estimate(tmp_path):
    cfg = load_config(CONFIGS, EXAMPLE, [
        "cluster.num_nodes=1", "cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": 0}',
        "algorithm.compute_ref_logprobs=false",
    ])
    tokens = cfg.actor.micro_batch_tokens
    assert tokens == cfg.data.max_prompt_length + cfg.rollout.max_new_tokens == 9216
    if measures_memory():
        folder = tmp_path / MODEL
        folder.mkdir()
        shutil.copy(known_config(MODEL), folder / "config.json")  # the architecture only: random weights
        shape, _ = model_arch(str(folder))
    else:  # a dry run on CPU: the same code on the tiny model
        from rlinf_pipe.models.tiny import ensure_tiny_model

        folder, tokens = ensure_tiny_model(tmp_path / "tiny"), 64
        shape, _ = model_arch(str(folder))
        cfg = load_config(CONFIGS, EXAMPLE, [
            "cluster.num_nodes=1", "cluster.num_gpus_per_node=1", 'cluster.component_placement={"actor,rollout": 0}',
            "algorithm.compute_ref_logprobs=false", f"actor.micro_batch_tokens={tokens}",
        ])
    assert shape is not None
    estimate = estimate_memory(cfg, plan_run(cfg), shape, int(80e9))["actor"]
    (result,) = spawn(1, _one_step, str(tmp_path / "run"), backend=backend(), model_path=str(folder), tokens=tokens,
                      recompute=cfg.actor.recompute)
    assert torch.isfinite(torch.tensor(result["loss"]))
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in estimate.per_gpu_bytes.items())
    used = result["reserved"] + result["context"]  # the process's peak on the GPU as the driver counts it
    print(f"\nmemory at the example shape ({tokens} tokens, recompute {cfg.actor.recompute}, DP 1): measured peak "
          f"{result['peak'] / GIB:.2f} GiB allocated (first step {result['first_peak'] / GIB:.2f}), "
          f"{result['reserved'] / GIB:.2f} GiB reserved, CUDA context "
          f"{result['context'] / GIB:.2f} GiB, state after the step {result['held'] / GIB:.2f} GiB; estimate "
          f"{estimate.total / GIB:.2f} GiB ({parts}), {estimate.total / max(used, 1):.3f}x the measured peak")
    if measures_memory():
        assert used <= estimate.total, "the estimate is below what a micro-batch really takes"
        assert estimate.total <= 1.15 * used, "the estimate is far above what a micro-batch takes: it refuses fits"
