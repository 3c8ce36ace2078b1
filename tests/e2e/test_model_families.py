"""Qwen3 and Llama 3.x end to end on CPU: a tiny model of each family (warm-started on the arithmetic data, so that
groups differ in reward and the policy gradient is not zero) trains in the disaggregated pipeline and in the
collocated mode, the two runs train alike (same rollouts, losses and final weights), and the run's checkpoint
converts back to an HF folder that transformers loads with the weights the actor trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from rlinf_pipe.cli import main
from rlinf_pipe.config import load_config
from rlinf_pipe.config.schema import DataConfig
from rlinf_pipe.models.megatron_checkpoint import load_safetensors
from rlinf_pipe.models.warmstart import TINY_KNOBS, ensure_warm_tiny_model
from rlinf_pipe.runner import run as run_config
from rlinf_pipe.utils.metrics import read_metrics
from support.runs import assert_trains_like

pytestmark = pytest.mark.slow

COMMON = ("cluster.ray_address=local", "runner.progress=false", "data.rollout_batch_size=4", "algorithm.group_size=8",
          "actor.micro_batch_size=8", "runner.max_steps=2", "algorithm.n_minibatches=2",
          "algorithm.compute_ref_logprobs=true", "actor.max_micro_batch_size=null")


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run(config_name: str, out: Path, model: Path, *overrides: str) -> Path:
    return run_config(load_config("examples/math/config", config_name,
                                  [f"actor.model_path={model}", f"runner.output_dir={out}", *COMMON, *overrides]))


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_a_family_trains_alike_in_both_modes_and_exports_to_hf(tmp_path, arch, capsys):
    model = ensure_warm_tiny_model(None, DataConfig(), tiny_knobs={**TINY_KNOBS, "arch": arch})
    pipeline = run("tiny-grpo-megatron-pipeline", tmp_path / "pipe", model)
    collocated = run("tiny-grpo-megatron", tmp_path / "coll", model, "cluster.num_gpus_per_node=1")
    rows = read_metrics(pipeline / "metrics.jsonl")
    varied = [r["actor/advantages/max"] > 0 for r in rows]  # (a group whose answers differ in reward)
    assert len(rows) == 2 and any(varied) and [r["grad_norm"] > 0 for r in rows] == varied, rows
    assert_trains_like(pipeline, collocated)

    checkpoint = sorted((pipeline / "checkpoints").glob("step_*"))[-1] / "actor"
    assert main(["convert", "--to", "hf", str(checkpoint), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert exported.config.model_type == ("qwen3" if arch == "qwen3" else "llama")
    before, after = load_safetensors(model / "model.safetensors"), exported.state_dict()
    changed = {name for name, tensor in before.items() if not torch.equal(after[name], tensor)}
    trained = "model.layers.0.self_attn.q_norm.weight" if arch == "qwen3" else "model.layers.0.self_attn.q_proj.weight"
    assert trained in changed and len(changed) > len(before) // 2
