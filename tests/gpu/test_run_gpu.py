"""Whole runs on GPUs through Ray (skipped where Ray is not installed): the tiny collocated config for three steps
on one GPU (offload, weight sync over CUDA IPC, the engine's sleep and wake every step, no OOM); the same with a
reference model, validation, a checkpoint every step and a resume; and the tiny pipeline (rollout: 0, actor: 1)
with an NCCL weight broadcast where two GPUs exist."""

from __future__ import annotations

import pytest
from support.gpu import dry_run, needs_gpus

pytestmark = pytest.mark.gpu
if dry_run():
    pytest.skip("runs on real GPUs only (the CPU suite runs these configs on virtual GPUs)", allow_module_level=True)
pytest.importorskip("ray")
pytest.importorskip("megatron.core")


def _run(tmp_path, config_name: str, *overrides: str):
    from rlinf_pipe.config import load_config
    from rlinf_pipe.runner import run
    from rlinf_pipe.utils.metrics import read_metrics

    cfg = load_config("examples/math/config", config_name, [
        f"runner.output_dir={tmp_path}", "cluster.ray_address=local", "runner.progress=false", "runner.max_steps=3",
        "runner.verify_weights=true", *overrides,
    ])
    run_dir = run(cfg)
    records = read_metrics(run_dir / "metrics.jsonl")
    for record in records:  # the figures the suite's record in docs/benchmarks.md quotes
        print(config_name, {key: round(record[key], 4) for key in SHOWN if key in record})
    return run_dir, records


SHOWN = ("step", "timing/step", "timing/rollout", "timing/train", "timing/weight_sync", "weight_sync/bytes",
         "reward/mean", "loss", "grad_norm", "kl", "val/pass@1")


def test_collocated_run_on_one_gpu(tmp_path):
    _, records = _run(tmp_path, "tiny-grpo-megatron", "cluster.num_gpus_per_node=1")
    assert [r["step"] for r in records] == [0, 1, 2] and all(r["weight_sync/bytes"] > 0 for r in records)


def test_collocated_run_with_a_reference_validation_and_a_resume_on_one_gpu(tmp_path):
    """Beside the actor's state, the reference model's weights on the GPU (`kl`); validation before the first step
    and after the last wakes the engine with no weight sync between (its weights kept on the host while it sleeps);
    a checkpoint every step saved from GPU tensors, and a resume (`auto`) that loads the last one back onto the GPU
    and continues in the same run folder."""
    extra = ("cluster.num_gpus_per_node=1", "algorithm.compute_ref_logprobs=true", "runner.val_interval=2",
             "runner.val_before_train=true", "runner.save_interval=1")
    run_dir, _ = _run(tmp_path, "tiny-grpo-megatron", *extra, "runner.max_steps=2")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    resumed, records = _run(tmp_path, "tiny-grpo-megatron", *extra, "runner.max_steps=3", "runner.resume_dir=auto")
    assert resumed == run_dir and (run_dir / "checkpoints" / "step_000003").is_dir()
    trained = [r for r in records if "loss" in r]
    assert [r["step"] for r in trained] == [0, 1, 2] and all(r["kl"] >= 0 for r in trained)
    assert [r["step"] for r in records if "val/pass@1" in r] == [0, 2, 3]


@needs_gpus(2)
def test_pipeline_run_with_an_nccl_weight_broadcast(tmp_path):
    _, records = _run(tmp_path, "tiny-grpo-megatron-pipeline", "cluster.num_gpus_per_node=2")
    assert len(records) == 3 and all(r["weight_sync/bytes"] > 0 for r in records)
