"""The disaggregated pipeline and the hybrid placement on a machine with one GPU: their two placement GPUs are the
one physical GPU (`RLINF_PIPE_NODE_VISIBLE_DEVICES=0,0`, Ray declaring two), so the actor and the engine (and the
log-prob worker) share it as separate processes, and weights move over CUDA IPC (`auto` takes ipc where placement
GPUs are one device: NCCL refuses two ranks on it). Three steps each with `verify_weights`, each step's figures
printed. The lent GPU machines have one GPU; `test_run_gpu.py` runs the pipeline with an NCCL broadcast where two
exist. In the dry run the same runs go on CPU (two virtual GPUs, shared memory for CUDA IPC)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")

SHOWN = ("step", "timing/step", "timing/rollout", "timing/train", "timing/weight_sync", "weight_sync/bytes",
         "reward/mean", "loss", "kl")


@pytest.fixture(scope="module", autouse=True)
def one_device_two_gpus():
    """A local Ray with two GPUs that are both device 0 (the workers inherit the variable and see device 0)."""
    from rlinf_pipe.planning.weight_routes import NODE_DEVICES_ENV

    assert not ray.is_initialized(), "another test left Ray running"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(NODE_DEVICES_ENV, "0,0")
        ray.init(address="local", num_gpus=2, include_dashboard=False, log_to_driver=True)
        try:
            yield
        finally:
            ray.shutdown()


def _run(tmp_path, config_name: str, *overrides: str) -> list[dict]:
    from rlinf_pipe.config import load_config
    from rlinf_pipe.runner import run
    from rlinf_pipe.planning.run_plan import plan_run
    from rlinf_pipe.utils.metrics import read_metrics

    cfg = load_config("examples/math/config", config_name, [
        f"runner.output_dir={tmp_path}", "cluster.ray_address=local", "runner.progress=false", "runner.max_steps=3",
        "runner.verify_weights=true", *overrides,
    ])
    assert plan_run(cfg).weight_transport == "ipc"  # (two placement GPUs, one device)
    records = read_metrics(run(cfg) / "metrics.jsonl")
    for record in records:  # the figures the suite's record in docs/benchmarks.md quotes
        print(config_name, {key: round(record[key], 4) for key in SHOWN if key in record})
    return records


def test_the_pipeline_on_one_gpu_streams_and_takes_its_weights_over_ipc(tmp_path):
    records = _run(tmp_path, "tiny-grpo-megatron-pipeline")
    assert [r["step"] for r in records] == [0, 1, 2] and all(r["weight_sync/bytes"] > 0 for r in records)


def test_the_hybrid_placement_on_one_gpu(tmp_path):
    """Engine and actor take turns on placement GPU 0, the log-prob worker (reference log-probs) streams on GPU 1:
    all three on the one device."""
    records = _run(tmp_path, "tiny-grpo-megatron-hybrid")
    trained = [r for r in records if "loss" in r]
    assert [r["step"] for r in trained] == [0, 1, 2] and all(r["kl"] >= 0 for r in trained)
