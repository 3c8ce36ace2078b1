"""What building sglang's Engine does to the rollout worker's process (the contract's `host_process`, modelled by the
stand-in: tests/support/sglang_standin/host.py), and what the adapter keeps of it: nothing once the Engine is
built (the asyncio policy, the start method, the environment), no exit hook once it is shut down, and a warning
naming the processes sglang's shutdown kills that are not the engine's. Each runs in a process of its own, as a
worker does: the stand-in's import switches the policy of the process that imports it, and its shutdown kills every
descendant of the process that calls it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from support.sglang_standin import CONTRACT

from rlinf_pipe.engines.rollout import sglang_host
from rlinf_pipe.engines.rollout.sglang_launch import STANDIN_ENV
from rlinf_pipe.models.tiny import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]
HOST = CONTRACT["host_process"]

# Builds an engine the way a rollout worker does (the stand-in imported by the adapter, as sglang would be), with a
# process of its own started before (as a reward pool's would be), generates, shuts down; prints what it saw.
SCRIPT = """
import asyncio, gc, json, logging, multiprocessing, os, subprocess, sys, weakref
from rlinf_pipe.engines.rollout import GenerateRequest, SamplingParams
from rlinf_pipe.engines.rollout.sglang_engine import SGLangEngine
from rlinf_pipe.engines.rollout.sglang_host import ENGINE_ENVIRONMENT

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
def seen():
    return {"policy": type(asyncio.get_event_loop_policy()).__name__,
            "start_method": multiprocessing.get_start_method(allow_none=True),
            "environment": {k: os.environ.get(k) for k in ENGINE_ENVIRONMENT}}
other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
before = seen()
engine = SGLangEngine(sys.argv[1], dtype="float32")
built = seen()
async def generate():
    request = GenerateRequest(request_id="a", prompt_ids=[5, 17, 33],
                              sampling=SamplingParams(max_new_tokens=2, ignore_eos=True))
    results = [r async for r in engine.generate([request])]
    return type(asyncio.get_running_loop()).__name__, len(results[0].samples[0].response_ids)
loop, tokens = asyncio.run(generate())
standin = weakref.ref(engine.engine)
engine.shutdown()
del engine
gc.collect()
late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],  # (a reward pool, after the engine)
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(json.dumps({"before": before, "built": built, "after": seen(), "loop": loop, "tokens": tokens,
                  "engine_freed": standin() is None, "other": other.pid, "other_killed": other.poll() is not None,
                  "late": late.pid}), flush=True)
"""  # (then the interpreter exits: its atexit hooks run)


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = ensure_tiny_model(tmp_path_factory.mktemp("models"), arch="qwen2")
    env = {k: v for k, v in os.environ.items() if k not in sglang_host.ENGINE_ENVIRONMENT}
    env.update({STANDIN_ENV: "support.sglang_standin", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    try:  # (whether the process started after the shutdown outlived the interpreter's exit)
        late = psutil.Process(seen["late"])
        seen["late_survived_exit"] = late.status() != psutil.STATUS_ZOMBIE
        late.kill()
    except psutil.NoSuchProcess:
        seen["late_survived_exit"] = False
    return {**seen, "stderr": proc.stderr}


def test_the_adapter_restores_what_sglang_sets_by_the_contract() -> None:
    assert set(sglang_host.ENGINE_ENVIRONMENT) == set(HOST["environment_set"])
    assert sglang_host.SHUTDOWN_WAIT_S == HOST["shutdown_kill_wait_s"]
    assert HOST["start_method_forced"] == "spawn" and all(HOST["policy_switched_on_import"].values())
    assert HOST["atexit_shutdown"] and HOST["shutdown_kills_descendants_of_own_pid"]


def test_building_an_engine_leaves_the_policy_the_start_method_and_the_environment_as_they_were(seen: dict) -> None:
    """sglang switches the asyncio policy when imported, forces `spawn` and sets NCCL's and CUDA's variables when
    built: every loop made afterwards in the worker (asyncio.run, a Ray concurrency group's) would be uvloop's."""
    for key in ("policy", "start_method", "environment"):
        assert seen["built"][key] == seen["before"][key], key
    assert seen["loop"] != "StandinLoop" and seen["tokens"] == 2


def test_a_shut_down_engine_leaves_no_exit_hook_and_is_freed(seen: dict) -> None:
    """sglang registers its shutdown with atexit: it kept the Engine alive for the process's life, and at the
    process's exit it killed every descendant again, whatever was started after the engine was shut down."""
    assert seen["engine_freed"]
    assert seen["late_survived_exit"]


def test_the_shutdown_names_the_processes_it_kills_that_are_not_the_engines(seen: dict) -> None:
    """sglang's shutdown SIGKILLs every descendant of the process, so a process of ours started beside the engine
    dies with it: the adapter cannot stop that, and says which (nothing of ours runs beside a rollout worker's
    engine: tests/e2e/test_runner_sglang.py checks it)."""
    assert seen["other_killed"]
    assert f"{seen['other']} (" in seen["stderr"] and "not started by the engine" in seen["stderr"]


def test_rlinf_pipe_eval_shuts_its_engine_down_before_the_reward_pool_starts(tmp_path: Path) -> None:
    """`rlinf-pipe eval` runs an engine and a reward pool in one process: an engine shut down only at exit (sglang's
    exit hook) killed the pool's processes too (its forkserver outlives the pool in the process)."""
    from support.sglang_standin.engine import SHUTDOWN_RECORD_ENV

    model = ensure_tiny_model(tmp_path / "models", arch="qwen2")
    record = tmp_path / "shutdowns"
    env = {**os.environ, STANDIN_ENV: "support.sglang_standin", SHUTDOWN_RECORD_ENV: str(record),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    args = ["eval", "--model", str(model), "--dataset", "arithmetic", "--limit", "2", "--k", "1", "--out",
            str(tmp_path / "out"), "rollout.backend=sglang", "rollout.max_new_tokens=4"]
    proc = subprocess.run([sys.executable, "-c", f"import sys; from rlinf_pipe.cli import main; sys.exit(main({args!r}))"],
                          env=env, capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (shutdown,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert shutdown["killed_not_the_engines"] == []
    assert (tmp_path / "out" / "metrics.json").is_file()
