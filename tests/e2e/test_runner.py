"""The runner end to end on CPU: real Ray (virtual GPUs), real channels, real Megatron on gloo, the tiny model.

Runs are small (4 prompts x 4 samples, 2-3 steps) but every stage runs on its placed workers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import ray
import torch

from rlinf_pipe.cli import main
from rlinf_pipe.config import load_config
from rlinf_pipe.errors import RunStopped
from rlinf_pipe.models.megatron_checkpoint import load_model_shard
from rlinf_pipe.runner import run as run_config
from rlinf_pipe.planning.run_plan import plan_run
from rlinf_pipe.runner.stop import StopSignals
from rlinf_pipe.runner.run_dir import complete_checkpoints
from rlinf_pipe.utils.metrics import read_metrics
from rlinf_pipe.utils.timeline import STEP_SPAN, overlaps, read_chrome_trace
from rlinf_pipe.utils.tracing import LAUNCH_SPAN
from support.faults import Fault, Saboteur, reward_pool_processes, wait_for
from support.runs import assert_trains_like, checkpoint_weights, final_weights

ROOT = Path(__file__).resolve().parents[2]
REQUIRED_METRICS = {
    "step", "reward/mean", "reward/accuracy", "response_length/mean", "loss", "grad_norm", "kl", "timing/step",
    "timing/rollout", "timing/inference", "timing/train", "timing/weight_sync", "throughput/tokens_per_s",
    "pipeline/bubble_fraction",
}


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    """One local Ray (9 virtual GPUs: the most a run of the module places) for the module's runs: each run's
    `Cluster` finds the connection and leaves it open, instead of starting and stopping a cluster per run (a run
    that uses fewer GPUs holds the others too, and logs that it does)."""
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(address="local", num_cpus=2, num_gpus=9, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model() -> str:
    """The warm-started tiny model in the default cache (shared with the example and benchmark runs, which build
    it there on first use: half a minute of training on 2 cores)."""
    from rlinf_pipe.config.schema import DataConfig
    from rlinf_pipe.models.warmstart import ensure_warm_tiny_model

    return str(ensure_warm_tiny_model(None, DataConfig()))


def common_overrides(out: Path, model: str) -> list[str]:
    return [f"actor.model_path={model}", f"runner.output_dir={out}", "cluster.ray_address=local",
            "runner.progress=false", "data.rollout_batch_size=4", "algorithm.group_size=4", "actor.micro_batch_size=4",
            "runner.max_steps=2"]


def run(config_name: str, out: Path, model: str, *overrides: str) -> Path:
    return run_config(load_config("examples/math/config", config_name, [*common_overrides(out, model), *overrides]))


# The runs compared with `pipeline_run` take two optimizer steps per step (the groups' slots fix which share
# one) and save after every step (the resume test starts from the first). Their micro-batches keep a fixed size:
# the examples' `actor.max_micro_batch_size` lets an actor that is behind train the groups already waiting in one
# pass, so where a mini-batch splits would depend on timing, and Adam's first steps turn the rounding of a sum
# over one micro-batch or two into differences past these tests' tolerances (seen once in six CI runs).
COMPARED = ("algorithm.n_minibatches=2", "algorithm.compute_ref_logprobs=true", "runner.save_interval=1",
            "actor.max_micro_batch_size=null")
# The three-stage pipeline: log-prob (inference) workers of their own, which COMPARED gives something to compute.
THREE_STAGES = ("cluster.num_gpus_per_node=3", "cluster.component_placement={rollout: 0, inference: 1, actor: 2}")


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, tiny_model) -> Path:
    # Step 1 runs under torch.profiler in every worker (which must change nothing of the training).
    return run("tiny-grpo-megatron-pipeline", tmp_path_factory.mktemp("pipe"), tiny_model, *COMPARED, *THREE_STAGES,
               "runner.profile_steps=[1]")


SHARED_MEMORY = Path("/dev/shm")
LEFT_IN_SHARED_MEMORY: dict[Path, set[str]] = {}  # per run folder: the blocks it left in /dev/shm
LEFT_IN_TMP: dict[Path, set[str]] = {}  # per run folder: the multiprocessing folders it left in the temp folder


def shared_memory_blocks() -> set[str]:
    """The names of Python's POSIX shared memory blocks (`multiprocessing.shared_memory`) in /dev/shm."""
    return {p.name for p in SHARED_MEMORY.glob("psm_*")}


def multiprocessing_folders() -> set[str]:
    """multiprocessing's per-process temporary folders (a forkserver's socket lives in one)."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("pymp-*")}


@pytest.fixture(scope="module")
def collocated_run(tmp_path_factory, tiny_model) -> Path:
    # One device, so rollout batches and actor replicas match the pipeline's exactly (DP=2 exactness is covered by
    # tests/integration/test_actor_trainer.py); what differs is the mode: time-sharing, locks, offload, channels.
    # It also validates before each step and after the last (which must change nothing of the training). Its actor
    # really offloads its state between phases, as on a GPU: whatever touches the state outside a phase (the final
    # checkpoint did, on the first GPU run) fails here too.
    before, folders_before = shared_memory_blocks(), multiprocessing_folders()
    run_dir = run("tiny-grpo-megatron", tmp_path_factory.mktemp("coll"), tiny_model, "cluster.num_gpus_per_node=1",
                  "actor.offload_on_cpu=true", *COMPARED, *VALIDATED)
    LEFT_IN_SHARED_MEMORY[run_dir] = shared_memory_blocks() - before
    LEFT_IN_TMP[run_dir] = multiprocessing_folders() - folders_before
    return run_dir


VALIDATED = ("runner.val_interval=1", "runner.val_before_train=true", "runner.val_k=2", "data.val_size=4")


@pytest.mark.slow
def test_pipeline_run_outputs_and_versions(pipeline_run):
    records = read_metrics(pipeline_run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert REQUIRED_METRICS <= set(r), REQUIRED_METRICS - set(r)
        assert r["rollout/samples"] == 16 and r["optimizer_steps"] == 2
        assert 0 <= r["reward/accuracy"] <= 1 and 0 <= r["pipeline/bubble_fraction"] < 1
        assert r["weight_sync/bytes"] > 0 and r["timing/step"] > 0
    spans = read_chrome_trace(pipeline_run / "timeline.json")
    tracks = {s.track for s in spans}
    assert {"driver", "rollout/0", "reward/0", "inference/0", "actor/0"} <= tracks
    names_by_track = {t: {s.name for s in spans if s.track == t} for t in tracks}
    assert {"generate", "weight_sync"} <= names_by_track["rollout/0"]
    assert {"logprob", "weight_sync"} <= names_by_track["inference/0"]
    assert {"train", "optimizer_step", "publish_weights"} <= names_by_track["actor/0"]
    assert "reward" in names_by_track["reward/0"]
    # each stage ran on its placed GPU (rollout: 0, inference: 1, actor: 2)
    assert {s.devices for s in spans if s.track == "rollout/0"} == {(0,)}
    assert {s.devices for s in spans if s.track == "inference/0"} == {(1,)}
    assert {s.devices for s in spans if s.track == "actor/0"} == {(2,)}
    # versions: step k generates, scores and trains with weight version k
    steps = sorted((s for s in spans if s.name == STEP_SPAN), key=lambda s: s.start)
    for k, step in enumerate(steps):
        inside = [s for s in spans if step.start <= s.start and s.end <= step.end]
        assert {s.args["version"] for s in inside if s.name in ("generate", "logprob", "train")} == {k}
        # the step's own version (synced in it at step 0, collected from the push before) and the next (pushed as
        # soon as the step trained it)
        assert {s.args["version"] for s in inside if s.name in ("weight_sync", "publish_weights")} <= {k, k + 1}
    assert (pipeline_run / "timeline.png").stat().st_size > 0 and (pipeline_run / "reward.png").is_file()
    assert list((pipeline_run / "tensorboard").glob("events.out.tfevents.*"))
    # the launch on the timeline: the driver's phases, then each worker from its process's start until built, all
    # before the first step; summary.json says where its time went
    launch = [s for s in spans if s.name == LAUNCH_SPAN]
    (job,) = [s for s in launch if s.args.get("phase") == "job"]
    phases = {s.args["phase"]: s for s in launch if s.track.startswith("driver") and s is not job}
    assert set(phases) == {"preflight", "ray_start", "import", "prepare", "start_workers"}
    built = {s.track: s for s in launch if not s.track.startswith("driver")}
    assert set(built) == {"rollout/0", "reward/0", "inference/0", "actor/0"} and len(launch) == 10
    for span in [*phases.values(), *built.values()]:
        assert job.start - 0.05 <= span.start <= span.end <= job.end <= steps[0].start
    for span in built.values():
        # (a process's start is known to the scheduler's tick, 10 ms)
        assert phases["start_workers"].start - 0.05 <= span.start and 0 < span.args["build_s"] <= span.duration
    summary = json.loads((pipeline_run / "summary.json").read_text())["launch"]
    assert summary["to_first_step_s"] == pytest.approx(steps[0].start - job.start, abs=1e-3)
    assert summary["workers_s"] == {t.split("/")[0]: pytest.approx(s.duration, abs=1e-3) for t, s in built.items()}
    assert "launch" not in json.loads((pipeline_run / "summary.json").read_text())["timeline"]["stage_busy"]
    ckpt = pipeline_run / "checkpoints" / "step_000002"
    assert (ckpt / "COMPLETE").is_file() and json.loads((ckpt / "runner.json").read_text())["next_step"] == 2
    # one marker name for every folder written; the actor's part has no doubled names
    assert {p.name for p in (ckpt / "actor").iterdir()} == {"COMPLETE", "megatron.json", "model", "hf", "trainer"}
    assert json.loads((ckpt / "actor" / "trainer" / "state.json").read_text())["step"] == 4  # optimizer steps
    for r in records:  # the driver sends control only: no training data passes through it
        assert r["driver/data_bytes"] == 0 and r["actor/train_data_bytes"] > 0


@pytest.mark.slow
def test_collocated_matches_pipeline(pipeline_run, collocated_run):
    assert_trains_like(pipeline_run, collocated_run)


@pytest.mark.slow
def test_engines_taking_turns_with_the_actor_and_inference_apart_train_like_the_pipeline(tmp_path, tiny_model,
                                                                                         pipeline_run):
    """A hybrid placement: the engine and the actor take turns on GPU 0 (locks, sleep / wake, offload / onload)
    while the inference worker on GPU 1 computes the log-probs outside those turns. The engine is killed in step 1
    (it may hold GPU 0's lock then): only it is relaunched, the others abandon the step and retry it, and the run
    still trains exactly like the pipeline."""
    saboteur = Saboteur(tmp_path, [Fault("step_000001", "rlinf_pipe:rollout:0", signal.SIGKILL)])
    saboteur.start()
    try:
        out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, *COMPARED, "cluster.num_gpus_per_node=2",
                  'cluster.component_placement={"actor,rollout": 0, inference: 1}', "runner.max_restarts=1",
                  "actor.offload_on_cpu=true")  # the rollback point is taken and restored as on a GPU
    finally:
        saboteur.stop()
    assert len(saboteur.pids) == 1
    (restart,) = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert (restart["worker"], restart["relaunched"], restart["step"], restart["resumed_at"]) == (
        "rlinf_pipe:rollout:0", "rollout rank 0", 1, 1)
    assert_trains_like(pipeline_run, out)
    spans = read_chrome_trace(out / "timeline.json")
    assert {s.track for s in spans if s.name == "logprob"} == {"inference/0"}
    assert {"wake", "sleep", "onload", "offload"} <= {s.name for s in spans}
    # The log-probs run on GPU 1 without GPU 0's turns (whether they overlap the generation in time depends on
    # when the single batch's groups finish: not asserted).
    assert {s.devices for s in spans if s.track == "inference/0"} == {(1,)}
    assert {s.name for s in spans if s.track == "inference/0"} <= {"launch", "logprob", "weight_sync"}
    found = [(a, b) for a, b in overlaps(spans) if {a.name, b.name} != {"publish_weights", "weight_sync"}]
    assert found == []  # engine and actor never on GPU 0 at once (but a weight transfer's two ends)


@pytest.mark.slow
def test_collocated_timeline_never_overlaps_on_a_device(collocated_run):
    spans = read_chrome_trace(collocated_run / "timeline.json")
    on_gpu0 = {s.track.split("/")[0] for s in spans if 0 in s.devices}
    assert {"rollout", "actor"} <= on_gpu0  # both components really used the device
    assert {"wake", "sleep", "onload", "offload"} <= {s.name for s in spans}
    # The one thing that shares the device: a weight transfer's two ends (the actor sends version v over IPC at the
    # end of its phase while the engines, with only their weights resumed, load it).
    found = overlaps(spans)
    transfers = [(a, b) for a, b in found if {a.name, b.name} == {"publish_weights", "weight_sync"}
                 and a.args.get("version") == b.args.get("version")]
    assert transfers and [pair for pair in found if pair not in transfers] == []


@pytest.mark.skipif(not SHARED_MEMORY.is_dir(), reason="POSIX shared memory shows in /dev/shm on Linux only")
def test_a_collocated_run_leaves_no_shared_memory_behind(collocated_run):
    """Its weights went over `ipc` (shared memory on CPU); its workers were killed at the end, their blocks' names
    were removed once mapped."""
    cfg = load_config("examples/math/config", "tiny-grpo-megatron", ["cluster.num_gpus_per_node=1"])
    assert plan_run(cfg).weight_transport == "ipc"
    assert read_metrics(collocated_run / "metrics.jsonl")[0]["weight_sync/bytes"] > 0
    assert LEFT_IN_SHARED_MEMORY[collocated_run] == set()



@pytest.mark.slow
def test_a_collocated_run_resumed_from_its_first_checkpoint_ends_with_the_same_weights(collocated_run, tmp_path,
                                                                                        tiny_model):
    """Its actor loads the checkpoint in a device phase of its own and trains on with its state offloaded between
    phases, as on a GPU (where no collocated resume has run yet): exactly the uninterrupted run's final weights."""
    copy = tmp_path / "coll" / collocated_run.name
    shutil.copytree(collocated_run, copy)
    resumed = run("tiny-grpo-megatron", tmp_path / "coll", tiny_model, "cluster.num_gpus_per_node=1",
                  "actor.offload_on_cpu=true", *COMPARED, *VALIDATED,
                  f"runner.resume_dir={copy / 'checkpoints' / 'step_000001'}")
    assert resumed == copy
    expected, got = final_weights(collocated_run), final_weights(copy)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

def test_a_run_leaves_no_multiprocessing_folders_behind(collocated_run):
    """The reward worker's pool forks from a forkserver whose socket sits in a pymp-* folder of the temp folder;
    the workers are killed at the end, and a killed process removes nothing: the reward worker removes it first
    (`before_stop`)."""
    assert LEFT_IN_TMP[collocated_run] == set()


@pytest.mark.slow
def test_validation_between_steps_and_rlinf_pipe_eval_of_the_checkpoint_agree(collocated_run, tmp_path, capsys):
    """Validation (before training, after each step) takes its own rows' keys and its own file; evaluating the
    final checkpoint offline with the run's config gives exactly the final validation's responses. (That it
    changes nothing of the training is `test_collocated_matches_pipeline`: the pipeline run has no validation.)"""
    rows = read_metrics(collocated_run / "metrics.jsonl")
    assert [r["step"] for r in rows if "val/pass@1" in r] == [0, 1, 2]
    assert [r["step"] for r in rows if "reward/mean" in r] == [0, 1]
    assert all(0 <= r["val/pass@1"] <= 1 and r["val/problems"] == 4 and r["val/k"] == 2 for r in rows
               if "val/pass@1" in r)
    summary = json.loads((collocated_run / "summary.json").read_text())
    assert summary["steps"] == 2 and [v["step"] for v in summary["validation"]] == [0, 1, 2]
    spans = read_chrome_trace(collocated_run / "timeline.json")
    assert [s.args["version"] for s in spans if s.name == "evaluate"] == [0, 1, 2]
    problems = [json.loads(line) for line in (collocated_run / "validation.jsonl").read_text().splitlines()]
    final = [{k: v for k, v in p.items() if k != "step"} for p in problems if p["step"] == 2]
    assert len(final) == 4 and all(p["id"].startswith("arithmetic-val-") for p in final)
    ckpt = sorted((collocated_run / "checkpoints").glob("step_*"))[-1]
    out = tmp_path / "eval"
    assert main(["eval", str(collocated_run / "config.yaml"), "--model", str(ckpt), "--heldout", "--out",
                 str(out)]) == 0  # k, the problem count and the set: the run's config
    assert "pass@2" in capsys.readouterr().out
    assert [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()] == final
    assert json.loads((out / "metrics.json").read_text())["val/pass@1"] == rows[-1]["val/pass@1"]


@pytest.mark.slow
def test_a_profiled_step_has_a_trace_per_worker_on_the_timelines_clock(pipeline_run):
    folder = pipeline_run / "profile"
    assert sorted(p.name for p in folder.glob("*.step*.json")) == [
        "actor-0.step1.json", "inference-0.step1.json", "reward-0.step1.json", "rollout-0.step1.json"]
    timeline = json.loads((pipeline_run / "timeline.json").read_text())
    step = next(e for e in timeline["traceEvents"] if e.get("name") == STEP_SPAN and e["args"]["step"] == 1)
    for worker in ("actor-0", "inference-0", "rollout-0"):  # (the reward worker's torch work is nil)
        trace = json.loads((folder / f"{worker}.step1.json").read_text())
        ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("aten::")]
        assert ops, worker  # the engine and the trainer compute off the thread that started the profiler
        assert all(step["ts"] - 5e5 <= e["ts"] <= step["ts"] + step["dur"] for e in ops), worker
    combined = json.loads((folder / "with_timeline.json").read_text())["traceEvents"]
    assert {e["name"] for e in combined} >= {STEP_SPAN, "train", "aten::mm"}


@pytest.mark.slow
def test_tiny_default_learns(tmp_path, tiny_model):
    """The tiny pipeline default, shortened: accuracy over the last steps is clearly above the first steps."""
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, "data.rollout_batch_size=16",
              "algorithm.group_size=8", "actor.micro_batch_size=16", "runner.max_steps=24", "runner.tensorboard=false")
    acc = [r["reward/accuracy"] for r in read_metrics(out / "metrics.jsonl")]
    first, last = sum(acc[:8]) / 8, sum(acc[-8:]) / 8
    assert last > first + 0.05, (first, last, acc)
    # no log-prob pass is needed: the reward worker feeds the actor, which trains every sample of every step
    spans = read_chrome_trace(out / "timeline.json")
    assert {s.track for s in spans if s.name != LAUNCH_SPAN} == {"driver", "rollout/0", "reward/0", "actor/0"}
    assert not [s for s in spans if s.name == "logprob"]
    for step in range(24):
        assert sum(s.args["sequences"] for s in spans if s.name == "train" and s.args["version"] == step) == 128
    # Each later version is pushed as soon as the step before trained it: the actor sends it after its last optimizer
    # step of that step, the engine loads it before generating the next step, which the driver asked for during
    # the step before (started early, waiting for that version) and whose own sync only collects the push.
    syncs = {s.args["version"]: s for s in spans if s.name == "weight_sync" and s.track == "driver"}
    steps = {s.args["step"]: s for s in spans if s.name == STEP_SPAN}
    generate = {s.args["step"]: s for s in spans if s.name == "generate"}
    for k in range(1, 24):
        assert syncs[k].args.get("pushed") and steps[k].args["generation_started_ahead"]
        (sent,) = [s for s in spans if s.name == "publish_weights" and s.args["version"] == k]
        (loaded,) = [s for s in spans if s.name == "weight_sync" and s.track == "rollout/0" and s.args["version"] == k]
        last_update = max(s.end for s in spans if s.name == "optimizer_step" and s.args["step"] == k - 1)
        assert last_update <= sent.start and loaded.end <= generate[k].start and generate[k].args["version"] == k
    assert not syncs[0].args.get("pushed") and not steps[0].args["generation_started_ahead"]


@pytest.mark.slow
def test_a_validated_step_starts_its_own_generation_and_the_run_finishes(tmp_path, tiny_model):
    """Validation waits until the engines are idle before a step: a generation started early for that step would
    fill the bounded channels (here a batch of 192 samples against 64 + 64 they hold) with nothing training it, and
    never end. So a validated step starts its generation at its own start; the steps between start theirs early."""
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, "runner.max_steps=4", "runner.val_interval=2",
              "data.val_size=4", "data.rollout_batch_size=48", "actor.micro_batch_size=16")
    spans = read_chrome_trace(out / "timeline.json")
    early = {s.args["step"]: s.args["generation_started_ahead"] for s in spans if s.name == STEP_SPAN}
    assert early == {0: False, 1: True, 2: False, 3: True}
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "val/pass@1" in r] == [2, 4]


def verl_parquet(path: Path, count: int) -> Path:
    """`count` arithmetic problems in verl's record layout (chat-message prompt, reward_model.ground_truth,
    data_source, extra_info), the system message the tiny model was warm-started with in each."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlinf_pipe.data.arithmetic import ArithmeticSpec, generate_problem
    from rlinf_pipe.data.templates import DEFAULT_SYSTEM_PROMPT

    problems = [generate_problem(ArithmeticSpec(max_value=10), random.Random(f"verl:{i}")) for i in range(count)]
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "arithmetic", "ability": "math",
        "prompt": [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                   {"role": "user", "content": f"What is {p.expression}?"}],
        "reward_model": {"style": "rule", "ground_truth": str(p.answer)}, "extra_info": {"split": "train", "index": i},
    } for i, p in enumerate(problems)]), path)
    return path


@pytest.mark.slow
def test_a_verl_parquet_file_trains_with_a_verl_reward_function(tmp_path, tiny_model, capsys):
    """Bring your own data and reward: a verl-format parquet file, with only data.dataset set (its schema is
    detected and said at launch), scored by the example's verl-style `compute_score` file, whose extra keys are the
    steps' `reward/<key>` means; validation scores with it too."""
    data = verl_parquet(tmp_path / "gsm8k-like.parquet", 40)
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, f"data.dataset={data}",
              f"reward.function={ROOT / 'examples/math/reward/verl_reward.py'}", "runner.val_interval=2",
              "data.val_size=4", "runner.val_k=2")
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[rlinf_pipe] data.dataset:")]
    assert said == [f"[rlinf_pipe] data.dataset: {data}: verl schema (prompt `prompt`, answer "
                    "`reward_model.ground_truth`, data_source, extra_info) with 40 chat-message prompts; 40 prompts "
                    "from 40 records (0 malformed skipped, 0 over the prompt-length limit dropped)"]
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and [r["step"] for r in rows if "val/pass@1" in r] == [2]
    for row in steps:
        assert row["reward/errors"] == 0 and row["reward/timeouts"] == 0 and row["rollout/samples"] == 16
        assert row["reward/acc"] == row["reward/accuracy"] == row["reward/mean"]  # (score 1 exactly when acc)
        assert 0 < row["reward/answered"] <= 1  # the warm-started model boxes its answers
    assert sum(r["reward/acc"] for r in steps) > 0


@pytest.mark.slow
def test_placed_inference_with_nothing_to_compute_is_not_started(tmp_path, tiny_model, caplog):
    """Inference placed, but the algorithm needs no log-prob pass: a warning says so and how to change it, no
    inference worker starts or receives weights, and the scored groups reach the actor straight from the reward
    worker."""
    with caplog.at_level("WARNING", logger="rlinf_pipe.runner.prepare"):
        out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, *THREE_STAGES)
    assert any("inference (GPU(s) 1) has nothing to compute" in r.getMessage() for r in caplog.records)
    spans = read_chrome_trace(out / "timeline.json")
    assert not any(s.track.startswith("inference") for s in spans)
    assert {s.devices for s in spans if s.track == "actor/0"} == {(2,)}
    assert [r["rollout/samples"] for r in read_metrics(out / "metrics.jsonl")] == [16, 16]
    assert sum(s.args["sequences"] for s in spans if s.name == "train") == 32


@pytest.mark.slow
def test_staleness_two_runs_rollout_two_steps_ahead_and_never_lags_more(tmp_path, tiny_model):
    """max_staleness 2: the next two steps' generations start before step k's weights reach the engines, each with
    the weights the engines hold when it starts; no step trains samples more than two versions behind its actor, with the sampling
    log-probs as old log-probs."""
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, "runner.max_staleness=2", "runner.max_steps=4")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and all(r["rollout/samples"] == 16 for r in records)
    spans = read_chrome_trace(out / "timeline.json")
    generate = {s.args["step"]: s for s in spans if s.name == "generate"}
    assert {k: s.args["version"] for k, s in generate.items()} == {0: 0, 1: 0, 2: 0, 3: 1}
    steps = [s for s in spans if s.name == STEP_SPAN]
    lags = {next(st.args["step"] for st in steps if st.start <= s.start <= st.end) - s.args["version"]
            for s in spans if s.name == "train"}
    assert max(lags) == 2 and min(lags) == 0  # step 0 trains its own version; steps 2 and 3 two versions behind
    # step 2's rollout started before the weights step 0 trained (version 1) reached the engine; the timeline agrees
    # with the version stamps (which of the two starts first otherwise depends on how the OS schedules the workers)
    engine_has_v1 = next(s.end for s in spans if s.name == "weight_sync" and s.track == "rollout/0"
                         and s.args["version"] == 1)
    assert generate[2].start < engine_has_v1 < generate[3].start


@pytest.mark.slow
def test_a_loss_with_rollout_running_ahead_relaunches_every_worker_from_the_checkpoint(tmp_path, tiny_model):
    """With `runner.max_staleness: 1` the engines generate the next step with weights that no worker holds once the
    actor has trained on: a lost reward worker relaunches every worker, and the run goes on from the checkpoint."""
    saboteur = Saboteur(tmp_path, [Fault("step_000001", "rlinf_pipe:reward:0", signal.SIGKILL)])
    saboteur.start()
    try:
        out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, "runner.max_staleness=1",
                  "runner.save_interval=1", "runner.max_restarts=1", "runner.max_steps=3", "runner.keep_checkpoints=2")
    finally:
        saboteur.stop()
    (restart,) = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert (restart["worker"], restart["relaunched"]) == ("rlinf_pipe:reward:0", "every worker")
    assert restart["resumed_at"] in (1, 2)  # the checkpoint before the step that found the loss
    assert restart["resumed_from"] == str(out / "checkpoints" / f"step_{restart['resumed_at']:06d}")
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    # runner.keep_checkpoints: 2 (the final save's and the one before it; the one resumed from may be gone)
    assert [p.name for p in complete_checkpoints(out)] == ["step_000002", "step_000003"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


@pytest.mark.slow
def test_mini_batches_in_arrival_order_train_every_group_once(tmp_path, tiny_model):
    """algorithm.minibatch_order: arrival: the reward worker gives each scored group the next free slot (reset at
    each step), which the actor replicas' routing and mini-batches follow: a slot given twice or beyond the batch
    fails the step (`train_feed`), a missing one leaves a mini-batch waiting."""
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, "algorithm.minibatch_order=arrival",
              "algorithm.n_minibatches=2", "cluster.num_gpus_per_node=3",
              "cluster.component_placement={rollout: 0, actor: 1-2}")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["optimizer_steps"] == 2 and r["rollout/samples"] == 16 for r in records)
    spans = read_chrome_trace(out / "timeline.json")
    for step in (0, 1):
        scored = sorted((s for s in spans if s.name == "reward" and s.args["step"] == step), key=lambda s: s.start)
        assert [s.args["slot"] for s in scored] == [0, 1, 2, 3]  # in the order scored, from 0 again each step
        trained = [s for s in spans if s.name == "train" and s.args["version"] == step]
        assert sum(s.args["sequences"] for s in trained) == 16  # every group once, over both replicas


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "split"), [("pipeline", "tp2-sp"), ("pipeline", "cp2"), ("pipeline", "tp2-cp2-sp"),
                                             ("collocated", "tp2-cp2-sp")])
def test_sequence_and_context_parallel_actors_train_like_the_pipeline(tmp_path, tiny_model, pipeline_run, mode,
                                                                       split):
    """Long-response splits of the actor train like the TP 1 pipeline (same rollouts, losses and final weights):
    sequence parallelism (TP 2: each rank's norms and residuals hold half of every packed stream), context
    parallelism (CP 2: each rank holds a load-balanced half of every packed sequence, attention gathers the keys and
    values of both) and both at once (TP 2 x CP 2 with SP: a quarter of every stream's norms per rank). In the
    pipeline the actor takes GPUs of its own, and with TP 2 x CP 2 so do the log-prob workers (one replica of the
    same split on GPUs 1-4: its old and reference log-probs are what the actor trains on); collocated, the actor
    takes turns with one engine spanning all its GPUs (so the rollouts are one engine's, as in the pipeline) and
    computes the log-probs itself. (Collocated runs only the combined split: its SP and CP are the pipeline's
    code, and each split alone is checked there; what collocated adds, offload and turns, does not depend on it.)"""
    gpus = 4 if split == "tp2-cp2-sp" else 2  # the actor's (one replica)
    placement = {
        ("pipeline", 2): ("cluster.num_gpus_per_node=4",
                          "cluster.component_placement={rollout: 0, inference: 1, actor: 2-3}"),
        ("pipeline", 4): ("cluster.num_gpus_per_node=9",
                          "cluster.component_placement={rollout: 0, inference: 1-4, actor: 5-8}"),
    }.get((mode, gpus)) or (f"cluster.num_gpus_per_node={gpus}", 'cluster.component_placement={"actor,rollout": all}',
                            f"rollout.tensor_parallel_size={gpus}", "actor.offload_on_cpu=true")
    sizes = {"tp2-sp": ("actor.tensor_parallel_size=2", "actor.sequence_parallel=true"),
             "cp2": ("actor.context_parallel_size=2",),
             "tp2-cp2-sp": ("actor.tensor_parallel_size=2", "actor.context_parallel_size=2",
                            "actor.sequence_parallel=true")}[split]
    if mode == "pipeline" and split == "tp2-cp2-sp":
        sizes += tuple(key.replace("actor.", "inference.") for key in sizes)
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, *COMPARED, *placement, *sizes)
    assert_trains_like(pipeline_run, out, summed_otherwise=True)


@pytest.mark.slow
def test_two_ray_nodes_train_like_one(tmp_path, tiny_model, pipeline_run):
    """The three-stage pipeline on two Ray nodes (`rlinf-pipe rehearse`: a local cluster of the config's nodes, in
    a process of its own): the engine on node 0, the log-prob worker and the actor on node 1, so the rollouts'
    channel and the weights cross nodes over TCP. It trains like the one-node pipeline: same rollouts, losses and
    final weights; every process ran on the node the placement gave it (workers.json)."""
    from rlinf_pipe.runner.workers_record import read_workers

    overrides = [*common_overrides(tmp_path, tiny_model), *COMPARED, "cluster.num_nodes=2",
                 "cluster.num_gpus_per_node=[1,2]", "cluster.component_placement={rollout: 0, inference: 1, actor: 2}"]
    proc = subprocess.run([sys.executable, "-m", "rlinf_pipe.cli", "rehearse", "--config-name",
                           "tiny-grpo-megatron-pipeline", "--model", tiny_model, "--output", str(tmp_path / "out"),
                           *overrides], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "placement: every process started on the node and GPUs the placement gave it" in proc.stdout
    assert "channel rollout (node 0) -> inference (node 1): crosses nodes (TCP)" in proc.stdout
    assert "weights actor rank 0 (node 1) -> rollout over broadcast: to node 0 across nodes" in proc.stdout
    (run_dir,) = (tmp_path / "out").glob("rehearse-*/*")
    assert {(r.group, r.node_rank) for r in read_workers(run_dir)} == {
        ("rollout", 0), ("reward", 0), ("inference", 1), ("actor", 1)}
    assert_trains_like(pipeline_run, run_dir)


@pytest.mark.slow
def test_dynamic_sampling_trains_only_varied_groups(tmp_path, tiny_model):
    """algorithm.dynamic_sampling: groups whose rewards are all equal never reach the log-prob stage or the actor;
    extra rounds draw more prompts; every generated group counts in the reward metrics. The inference worker takes
    turns with the engine on GPU 0 (a hybrid placement): it takes the device group by group between the rounds'
    generations, and the two never compute on it at once."""
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, "algorithm.dynamic_sampling=true",
              "algorithm.max_extra_rounds=2", "cluster.num_gpus_per_node=2", "algorithm.compute_ref_logprobs=true",
              'cluster.component_placement={"rollout,inference": 0, actor: 1}')
    records = read_metrics(out / "metrics.jsonl")
    spans = read_chrome_trace(out / "timeline.json")
    for r in records:
        kept, seen, rounds = (int(r[f"dynamic_sampling/{k}"]) for k in ("groups_kept", "groups_seen", "rounds"))
        assert 1 <= rounds <= 3 and kept <= 4 and r["dynamic_sampling/filled"] == float(kept == 4)
        assert r["rollout/samples"] == seen * 4  # every round's groups are scored and counted
        assert seen >= 4 and (rounds == 1) == (seen == 4)
        step = int(r["step"])
        assert len([s for s in spans if s.name == "generate" and s.args["step"] == step]) == rounds
        logprob = [s for s in spans if s.name == "logprob" and s.args["step"] == step]
        trained = [s for s in spans if s.name == "train" and s.args["version"] == step]
        assert sum(s.args["sequences"] for s in logprob) == sum(s.args["sequences"] for s in trained) == kept * 4
        assert r["optimizer_steps"] == float(kept > 0)
    assert {"wake", "sleep"} <= {s.name for s in spans}
    assert {s.devices for s in spans if s.name == "logprob"} == {(0,)}
    found = [(a, b) for a, b in overlaps(spans) if not {a.name, b.name} <= {"weight_sync", "publish_weights"}]
    assert found == []  # (both receive each version at once, before the step's generation)


@pytest.mark.slow
def test_a_tensor_parallel_log_prob_replica_takes_turns_with_the_engines(tmp_path, tiny_model):
    """`rollout,inference: 0-1` with inference TP 2: each rank locks its own GPU for each group, the replica's two
    ranks as one gang (they meet in collectives while holding their GPUs), while the rollout runs a step ahead
    (`max_staleness` 1), so the engines ask for their GPUs while the replica computes. Every group is computed by
    both ranks, and no two components compute on a GPU at once."""
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, "runner.max_staleness=1", "runner.max_steps=3",
              "cluster.num_gpus_per_node=3", "algorithm.compute_ref_logprobs=true", "inference.tensor_parallel_size=2",
              'cluster.component_placement={"rollout,inference": 0-1, actor: 2}')
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    spans = read_chrome_trace(out / "timeline.json")
    logprob = {rank: [s for s in spans if s.name == "logprob" and s.track == f"inference/{rank}"] for rank in (0, 1)}
    assert [s.devices for s in logprob[0]] == [(0,)] * 12 and [s.devices for s in logprob[1]] == [(1,)] * 12
    assert {s.name for s in spans if s.track.startswith("rollout/")} >= {"wake", "generate", "sleep"}
    replica = [msgspec.structs.replace(s, devices=(0, 1)) if s.name == "logprob" else s for s in spans]  # it takes both GPUs
    found = [(a, b) for a, b in overlaps(replica) if not {a.name, b.name} <= {"weight_sync", "publish_weights"}]
    assert found == []


@pytest.mark.slow
def test_dynamic_sampling_with_only_uniform_groups_spends_its_rounds_and_skips_training(tmp_path, tiny_model):
    """Greedy decoding makes both samples of every group identical: no group is ever kept, every extra round is
    spent, and the step trains nothing (no optimizer step) instead of failing."""
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, "algorithm.dynamic_sampling=true",
              "algorithm.max_extra_rounds=1", "algorithm.group_size=2", "rollout.temperature=0", "runner.max_steps=1")
    (r,) = read_metrics(out / "metrics.jsonl")
    assert r["dynamic_sampling/rounds"] == 2 and r["dynamic_sampling/groups_kept"] == 0
    assert r["dynamic_sampling/uniform_group_frac"] == 1.0 and r["dynamic_sampling/filled"] == 0
    assert r["dynamic_sampling/groups_seen"] == 4 + 16  # round 2 draws 4 missing groups x 4 (nothing varied)
    assert r["optimizer_steps"] == 0
    assert not [s for s in read_chrome_trace(out / "timeline.json") if s.name in ("logprob", "train")]


@pytest.mark.slow
def test_timeline_command_reports_busy_fractions(pipeline_run, capsys):
    from rlinf_pipe.cli import main

    (pipeline_run / "timeline.png").unlink()
    assert main(["timeline", str(pipeline_run)]) == 0
    out = capsys.readouterr().out
    assert "2 steps" in out and "generate" in out and "device bubble" in out and "scheduler overhead" in out
    assert (pipeline_run / "timeline.png").is_file()


def test_timeline_command_on_a_folder_without_a_run(tmp_path, capsys):
    from rlinf_pipe.cli import main

    assert main(["timeline", str(tmp_path)]) == 2
    assert "timeline.json does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_two_replicas_computing_log_probs_over_the_object_store_train_like_the_pipeline(tmp_path, tiny_model,
                                                                                       pipeline_run):
    """One run checks three equivalences against `pipeline_run` (inference workers, actor DP=1, `runner.weight_sync:
    auto` = the direct gloo group): no inference entry, so the actor computes the log-probs itself (while the engine
    on its own GPU goes on generating); actor DP=2, each replica reading the groups routed to it by slot from its own
    train channel; and the object store with CRC checks as the weight transport. Same rollouts, losses and final
    parameters: the same groups form each mini-batch whatever the replica count or the arrival order, the actor's
    log-probs are the inference worker's, and both transports deliver the same weights."""
    dp2 = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, *COMPARED, "cluster.num_gpus_per_node=3",
              "cluster.component_placement={rollout: 0, actor: 1-2}", "runner.weight_sync=object_store",
              "runner.verify_weights=true")
    spans = read_chrome_trace(dp2 / "timeline.json")
    assert {s.track for s in spans if s.name == "train"} == {"actor/0", "actor/1"}  # both replicas trained
    assert {s.track for s in spans if s.name == "logprob"} <= {"actor/0", "actor/1"}  # (whichever takes a group)
    # The actor has its GPUs to itself: no turns with the engine (whether its log-probs overlap the generation in
    # time depends on when the single batch's groups finish: not asserted).
    assert {s.devices for s in spans if s.name == "logprob"} <= {(1,), (2,)}
    assert not {"onload", "offload", "wake", "sleep"} & {s.name for s in spans}
    for run_dir in (pipeline_run, dp2):
        spans = read_chrome_trace(run_dir / "timeline.json")
        assert {s.args["version"] for s in spans if s.name == "publish_weights"} == {0, 1}
        assert {s.args["version"] for s in spans if s.name == "weight_sync" and s.track == "rollout/0"} == {0, 1}
    for a, b in zip(read_metrics(pipeline_run / "metrics.jsonl"), read_metrics(dp2 / "metrics.jsonl"), strict=True):
        assert a["optimizer_steps"] == b["optimizer_steps"] == 2 and b["driver/data_bytes"] == 0
        assert b["weight_sync/bytes"] == a["weight_sync/bytes"]
    assert_trains_like(pipeline_run, dp2)


@pytest.mark.slow
def test_replicas_fed_by_tokens_train_like_the_pipeline(tmp_path, tiny_model, pipeline_run):
    """`algorithm.replica_routing: tokens` with actor DP=2 fed by a log-prob worker: each group goes to the replica
    the job's balancer picks as it arrives; each mini-batch is the same, so the run trains like the pipeline (within
    float rounding), and each step reports how even the replicas' tokens were."""
    out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, *COMPARED, "cluster.num_gpus_per_node=4",
              "cluster.component_placement={rollout: 0, inference: 1, actor: 2-3}", "algorithm.replica_routing=tokens")
    cfg = load_config("examples/math/config", "tiny-grpo-megatron-pipeline", [
        "cluster.num_gpus_per_node=4", "cluster.component_placement={rollout: 0, inference: 1, actor: 2-3}",
        "algorithm.replica_routing=tokens"])
    assert plan_run(cfg).token_balance and not plan_run(load_config("examples/math/config",
                                                                    "tiny-grpo-megatron-pipeline", [
        "algorithm.replica_routing=tokens"])).token_balance  # (one replica: nothing to balance)
    spans = read_chrome_trace(out / "timeline.json")
    assert {s.track for s in spans if s.name == "train"} == {"actor/0", "actor/1"}
    records = read_metrics(out / "metrics.jsonl")
    assert all(r["actor/replica_tokens_max_over_mean"] >= 1.0 for r in records)
    assert_trains_like(pipeline_run, out)


KINDS = ("rollout", "inference", "reward", "actor")


@pytest.mark.slow
def test_lost_workers_of_every_kind_a_stop_signal_and_a_resume(tmp_path, tiny_model, pipeline_run):
    """A rollout engine killed in step 1: it is relaunched on its GPU, the other workers abandon the step, and the
    actor retries it from its state before the step; then, in each retry, the log-prob worker and the reward worker
    are killed (each relaunched alone, the actor staying), and the actor (relaunched, from the checkpoint before
    the step). Step 1 is trained once, on the same data: the weights after it equal the uninterrupted run's. Then SIGTERM to the driver in step 2 (`stop_grace_s=0`: the step is abandoned, so nothing
    is saved for it): `RunStopped` (exit 143) with one line naming the checkpoint and how to resume, no worker and
    no reward-pool process left. `resume_dir=auto` continues in the same run folder and finishes."""
    kills = [Fault("step_000001", f"rlinf_pipe:{kind}:0", signal.SIGKILL, restarts=i) for i, kind in enumerate(KINDS)]
    actor_at_start = Fault("step_000001", "rlinf_pipe:actor:0", 0)  # (signal 0: only its pid is recorded)
    saboteur = Saboteur(tmp_path, [actor_at_start, *kills,
                                   Fault("step_000002", os.getpid(), signal.SIGTERM, restarts=len(KINDS))])
    saboteur.start()
    try:
        with pytest.raises(RunStopped) as stopped:
            run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, *COMPARED, *THREE_STAGES, "runner.max_steps=3",
                f"runner.max_restarts={len(KINDS)}", "runner.stop_grace_s=0", "runner.save_on_signal=true")
    finally:
        saboteur.stop()
    assert len(saboteur.pids) == 1 + len(KINDS)
    assert saboteur.pids[0] == saboteur.pids[-1]  # the actor outlived the other three losses: only they relaunched
    run_dir = next(tmp_path.glob("*/*/config.yaml")).parent
    ckpt = run_dir / "checkpoints" / "step_000002"
    message = str(stopped.value)
    assert stopped.value.exit_code == 143 and "\n" not in message
    assert message.startswith("stopped by SIGTERM before step 2 of 3")
    assert f"resume with the same command and runner.resume_dir={ckpt}" in message
    assert not (run_dir / "checkpoints" / "step_000003").exists()  # the abandoned step is no step's end
    for kind in KINDS:  # every worker was stopped
        with pytest.raises(ValueError):
            ray.get_actor(f"rlinf_pipe:{kind}:0")
    assert wait_for(lambda: not reward_pool_processes(), timeout_s=30), reward_pool_processes()
    assert not isinstance(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), StopSignals)  # restored
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and [r["runner/restarts"] for r in records] == [0, len(KINDS)]
    for a, b in zip(read_metrics(pipeline_run / "metrics.jsonl"), records, strict=True):
        for key in ("reward/mean", "response_length/mean", "loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    wa, wb = final_weights(pipeline_run), checkpoint_weights(ckpt / "actor")
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=1e-6, rtol=1e-5, msg=name)
    restarts = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()[:len(KINDS)]]
    assert [(r["event"], r["worker"], r["how"], r["step"], r["resumed_at"], r["relaunched"]) for r in restarts] == [
        ("restart", f"rlinf_pipe:{kind}:0", "died", 1, 1, f"{kind} rank 0") for kind in KINDS]
    assert "rollout rank 0 (node 0, GPUs 0)" in restarts[0]["where"] and restarts[0]["seconds"] > 0
    assert "actor rank 0 (node 0, GPUs 2)" in restarts[3]["where"]
    assert restarts[3]["resumed_from"] == str(run_dir / "checkpoints" / "step_000001")  # the lost actor's state
    assert all(r["resumed_from"].startswith("the actor's state") for r in restarts[:3])  # the others: in memory

    resumed = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, *COMPARED, *THREE_STAGES,
                  "runner.max_steps=3", "runner.resume_dir=auto")
    assert resumed == run_dir
    assert [e["event"] for e in json.loads((run_dir / "summary.json").read_text())["events"]] == [
        *["restart"] * len(KINDS), "stop", "resume"]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    spans = read_chrome_trace(run_dir / "timeline.json")  # the timeline continues across the resume
    assert [s.args["worker"] for s in spans if s.name == "restart"] == [f"rlinf_pipe:{kind}:0" for kind in KINDS]
    assert sorted(s.args["step"] for s in spans if s.name == STEP_SPAN) == [0, 1, 2]


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (its Ray actor classes shipped to workers by value)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module


@pytest.mark.slow
def test_the_pipeline_vs_collocated_benchmark_reports_finite_figures(pipeline_run, collocated_run):
    """benchmarks/pipeline_vs_collocated.py's figures and summary, computed from this module's runs of the two
    modes (the script's own runs train the default pipeline and collocated mode on 2 GPUs) and a small raw gloo
    baseline."""
    bench = load_benchmark("pipeline_vs_collocated")
    runs = {"pipeline": [bench.mode_figures(pipeline_run, 2, 1.0, 0, 2)],
            "collocated": [bench.mode_figures(collocated_run, 1, 1.0, 0, 2)]}
    for mode_runs in runs.values():  # the ideal step: here bound by the longest stage (no CPU time given) ...
        mode_runs[0] |= bench.ideal_step(mode_runs[0], 0.0, 2)
    figures = runs["pipeline"][0]
    assert bench.ideal_step(figures, 10 * figures["step_s"], 2)["fraction_of_ideal"] == pytest.approx(5)  # ... or CPU
    assert bench.job_cpu_s([], os.getpid()) > 0
    sync_bytes = int(runs["pipeline"][0]["weight_sync_bytes"])
    gloo, gloo_one = [bench.gloo_bytes_per_s(sync_bytes, 2, 2)], [bench.gloo_bytes_per_s(sync_bytes, 2, 1)]
    args = argparse.Namespace(steps=2, warmup=0, repeats=1, gloo_iters=2, rollout_batch_size=4, staleness=0, gpus=2,
                              cpus=2)
    summary = json.loads(json.dumps(bench.summarise_runs(runs, gloo, gloo_one, args, time.perf_counter())))
    for key in ("pipeline_over_collocated_step_time", "scheduler_overhead_fraction", "weight_sync_bw_ratio_vs_gloo",
                "weight_sync_bw_ratio_vs_gloo_one_receiver", "bubble_fraction"):
        value = summary[key]
        assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
    assert summary["pipeline_over_collocated_step_time"] > 0 and summary["weight_sync_bw_ratio_vs_gloo"] > 0
    assert 0 <= summary["bubble_fraction"] < 1 and 0 <= summary["scheduler_overhead_fraction"] < 1
    assert summary["weight_sync_bytes"] > 0
    assert summary["fraction_of_ideal"] == pytest.approx(max(figures["stage_busy"].values()), abs=1e-4)
    assert 0 < summary["fraction_of_ideal"] <= 1
    assert summary["modes"]["pipeline"]["weight_sync_receivers"] == 2
    assert summary["modes"]["collocated"]["weight_sync_receivers"] == 1
    for mode in ("pipeline", "collocated"):  # training data streams worker to worker, never through the driver
        figures = summary["modes"][mode]
        assert figures["driver_data_bytes_per_step"] == 0 and figures["train_data_bytes_per_step"] > 0, figures
