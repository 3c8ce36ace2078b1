"""The runner with `rollout.backend: sglang` end to end on CPU: the SGLang adapter inside real rollout workers,
against the stand-in of sglang 0.5.23 (tests/support/sglang_standin; sglang itself installs only with a GPU), in
both modes: weights over its own ranks' broadcast group (pipeline) and over shared memory with sleep and wake
(collocated), a lost member of the weight group (every worker relaunched, the run resumed from its
checkpoint). With `rollout.deterministic` the stand-in draws per-sample seeded tokens, so runs that differ only in how
they were scheduled train alike."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

import psutil
import pytest
import ray
from support.faults import Fault, Saboteur
from support.runs import assert_trains_like
from support.sglang_standin.engine import SHUTDOWN_RECORD_ENV
from support.sglang_standin.host import TEARDOWN_FILE_ENV

from rlinf_pipe.config import load_config
from rlinf_pipe.engines.rollout.sglang_launch import STANDIN_ENV
from rlinf_pipe.runner.components import EXIT_GRACE_S
from rlinf_pipe.runner import run as run_config
from rlinf_pipe.utils.metrics import read_metrics
from rlinf_pipe.utils.timeline import read_chrome_trace

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                                reason="sglang is installed: the GPU suite runs the real one")


@pytest.fixture(scope="module")
def shutdowns(tmp_path_factory) -> Path:
    """Where each stand-in engine that was shut down records its scheduler's pid."""
    return tmp_path_factory.mktemp("standin") / "shutdowns"


@pytest.fixture(scope="module")
def teardown(tmp_path_factory) -> Path:
    """Holds how long a stand-in engine's shutdown takes to see its processes gone (on a GPU: their CUDA contexts'
    teardown, which sglang waits up to 60 s for), while it exists."""
    return tmp_path_factory.mktemp("standin") / "teardown_s"


@pytest.fixture(scope="module", autouse=True)
def ray_session(shutdowns, teardown):
    """One local Ray (3 virtual GPUs) whose workers build the stand-in when the adapter imports sglang."""
    assert not ray.is_initialized(), "another test left Ray running"
    env = {STANDIN_ENV: "support.sglang_standin", SHUTDOWN_RECORD_ENV: str(shutdowns),
           TEARDOWN_FILE_ENV: str(teardown)}
    ray.init(address="local", num_cpus=2, num_gpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from rlinf_pipe.config.schema import DataConfig
    from rlinf_pipe.models.warmstart import ensure_warm_tiny_model

    return str(ensure_warm_tiny_model(None, DataConfig()))


def run(config_name: str, out: Path, model: str, *overrides: str) -> Path:
    common = [f"actor.model_path={model}", f"runner.output_dir={out}", "cluster.ray_address=local",
              "runner.progress=false", "data.rollout_batch_size=4", "algorithm.group_size=4",
              "actor.micro_batch_size=4", "runner.max_steps=2", "rollout.backend=sglang", "rollout.deterministic=true",
              "runner.save_interval=1", "actor.max_micro_batch_size=null"]
    # (fixed micro-batches: with the example's max_micro_batch_size where a step's groups split into passes depends
    # on when they arrive, and Adam's first steps turn that rounding into differences past assert_trains_like's
    # tolerances: CI, 2026-12-06, the pipeline run's grad norm off from all four runs compared with it)
    assert os.environ.get(STANDIN_ENV) is None  # (the workers' environment names the stand-in, not the driver's)
    return run_config(load_config("examples/math/config", config_name, [*common, *overrides]))


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, tiny_model, teardown) -> Path:
    """(Its engine's shutdown takes longer than the exit grace of the other workers.)"""
    teardown.write_text(str(EXIT_GRACE_S + 1))
    try:
        return run("tiny-grpo-megatron-pipeline", tmp_path_factory.mktemp("sglang-pipe"), tiny_model,
                   "runner.verify_weights=true")
    finally:
        teardown.unlink()


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, killed and not yet reaped by its parent, has freed everything)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def shut_down(shutdowns: Path) -> list[dict]:
    """The stand-in engines shut down so far: their scheduler's pid and what else their shutdown killed."""
    return [json.loads(line) for line in shutdowns.read_text().splitlines()] if shutdowns.exists() else []


def test_the_pipeline_generates_with_sglang_and_loads_each_version_through_its_ranks(pipeline_run, shutdowns):
    records = read_metrics(pipeline_run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["rollout/samples"] == 16 and r["weight_sync/bytes"] > 0 and 0 <= r["reward/accuracy"] <= 1
    spans = read_chrome_trace(pipeline_run / "timeline.json")
    assert {"generate", "weight_sync"} <= {s.name for s in spans if s.track == "rollout/0"}
    generated = sorted((s for s in spans if s.name == "generate"), key=lambda s: s.start)
    assert [s.args["version"] for s in generated] == [0, 1]  # step k generates with version k
    # every sample's send and return, within its generation, and its tokens: the planner's decode curve of SGLang
    for s in generated:
        timed = s.args["requests"]
        assert len(timed) == 16 and sum(r[3] for r in timed) == s.args["tokens"]
        assert all(0 <= sent <= returned <= s.duration for sent, returned, _, _ in timed)
    from rlinf_pipe.planning.profile import read_profile

    assert not any("decode steps" in m for m in read_profile(pipeline_run).missing)
    # at the end the engine was shut down before its worker was killed (its schedulers free their GPUs at once),
    # though the shutdown took longer than the other workers' exit grace (sglang waits up to 60 s for its processes)
    records = shut_down(shutdowns)
    assert len(records) >= 1 and not any(running(r["scheduler"]) for r in records)


def test_nothing_else_of_ours_runs_beside_a_rollout_workers_engine(pipeline_run, shutdowns):
    """sglang's shutdown kills every descendant of the rollout worker's process: the engine's processes must be all
    there is (the reward pool runs in the reward workers)."""
    records = shut_down(shutdowns)
    assert records and all(r["killed_not_the_engines"] == [] for r in records)


def test_collocated_sglang_sleeps_wakes_and_trains_like_the_pipeline(tmp_path, tiny_model, pipeline_run):
    """Validation first: the engine sleeps after it and wakes for step 0 with no weight sync between (the version
    is loaded), so it must have kept its weights through the sleep (sglang's CPU backup)."""
    out = run("tiny-grpo-megatron", tmp_path, tiny_model, "cluster.num_gpus_per_node=1", "actor.offload_on_cpu=true",
              "runner.val_before_train=true")
    assert_trains_like(pipeline_run, out)
    spans = read_chrome_trace(out / "timeline.json")
    rollout = sorted((s for s in spans if s.track == "rollout/0"), key=lambda s: s.start)
    names = [s.name for s in rollout]
    evaluated, generated = rollout[names.index("evaluate")], rollout[names.index("generate")]
    assert evaluated.end < generated.start and {"sleep", "wake"} <= set(names)
    assert not [s for s in rollout if s.name == "weight_sync" and evaluated.end < s.start < generated.start]


def test_collocated_sglang_over_two_gpus_takes_its_weights_over_ipc_and_trains_like_the_pipeline(
        tmp_path, tiny_model, pipeline_run):
    """An engine of two TP ranks beside actor DP 2 (`auto`: ipc). Only its worker joins the ipc group, and hands the
    buckets on to sglang's ranks: a group sized for those ranks waited at start-up for members that never came."""
    out = run("tiny-grpo-megatron", tmp_path, tiny_model, "cluster.num_gpus_per_node=2",
              "rollout.tensor_parallel_size=2")
    assert_trains_like(pipeline_run, out)
    spans = read_chrome_trace(out / "timeline.json")
    assert {s.track for s in spans if s.name == "weight_sync" and s.track != "driver"} == {"rollout/0"}  # one engine


@pytest.mark.parametrize("lost", ["actor", "rollout"])
def test_a_lost_member_of_the_weight_group_relaunches_every_worker_and_the_resumed_run_trains_alike(
        tmp_path, tiny_model, pipeline_run, lost):
    """SGLang's ranks are in the weight group with the actor and every engine: on GPUs a version in flight when a
    member dies never completes on their devices (an NCCL collective), and sglang cannot abort the group."""
    saboteur = Saboteur(tmp_path, [Fault("step_000001", f"rlinf_pipe:{lost}:0", signal.SIGKILL)])
    saboteur.start()
    try:
        out = run("tiny-grpo-megatron-pipeline", tmp_path, tiny_model, "runner.verify_weights=true",
                  "runner.max_restarts=1")
    finally:
        saboteur.stop()
    assert len(saboteur.pids) == 1
    (restart,) = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert (restart["worker"], restart["relaunched"], restart["resumed_at"]) == (f"rlinf_pipe:{lost}:0",
                                                                                  "every worker", 1)
    assert_trains_like(pipeline_run, out)
