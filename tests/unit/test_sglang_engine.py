"""SGLangEngine (the sglang adapter) inside a running event loop, as in an async Ray actor, against the CPU
stand-in of sglang 0.5.23 (tests/support/sglang_standin): generation, seeds, unambiguous aborts, memory released
only when the scheduler is idle, weight updates in sessions, and weights arriving over a real process group (its
TP ranks joining as sglang's do) and over IPC, verified by name where sglang can read them back."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import logging
import os
import pickle
import re
import resource
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Awaitable, Callable

import psutil
import pytest
import torch
from support import sglang_standin
from support.sglang_standin import SchedulerDied
from support.weights import random_weights
from transformers import AutoModelForCausalLM

from rlinf_pipe.engines.rollout import EngineAsleepError, GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from rlinf_pipe.engines.rollout import sglang_leftovers
from rlinf_pipe.engines.rollout.engine import sample_seed
from rlinf_pipe.engines.rollout.sglang_engine import SGLangEngine, SGLangError
from rlinf_pipe.engines.rollout import sglang_launch
from rlinf_pipe.engines.rollout.sglang_launch import (
    CORE_DUMPS_ENV,
    INSTALL_HINT,
    NCCL_PORT_BASE,
    SGLangNotInstalledError,
    import_sglang,
    nccl_port_for,
)
from rlinf_pipe.engines.rollout.sglang_weights import SGLangGroupError, tensor_payloads, verify_by_name
from rlinf_pipe.models.weight_map import read_hf_arch
from rlinf_pipe.models.tiny import ensure_tiny_model
from rlinf_pipe.utils.logs import logging_kept
from rlinf_pipe.utils.net import free_port
from rlinf_pipe.weights import WeightSyncError, WeightVersion, plan_weight_layout
from rlinf_pipe.weights.process_group import Rendezvous
from rlinf_pipe.weights.transports import open_sender

PROMPTS = [[5, 17, 33], [40, 41, 42, 43, 44, 45, 46], [99, 7, 250, 13, 8]]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model's single-token forwards are far faster on one thread on a small, shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models"), arch="qwen2")


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models"), arch="llama")


@pytest.fixture(autouse=True)
def engine_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the engines record their processes (`sglang_leftovers`): the test's own folder; an engine waits at most
    a second for an earlier one's (tests run engines side by side on one GPU index)."""
    monkeypatch.setattr(sglang_leftovers, "RECORD_DIR", tmp_path / "records")
    monkeypatch.setattr(sglang_leftovers, "LEFTOVER_WAIT_S", 1.0)
    return tmp_path / "records"


def make_engine(path: Path, **kwargs: Any) -> SGLangEngine:
    """Built inside the test's running loop, as a worker builds it."""
    return SGLangEngine(path, dtype="float32", sglang=sglang_standin, **kwargs)


def standin(engine: SGLangEngine) -> Any:
    return engine.engine


def req(rid: str, prompt: list[int], **sampling: Any) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=SamplingParams(**sampling))


async def run(engine: SGLangEngine, requests: list[GenerateRequest]) -> dict[str, GenerateResult]:
    return {r.request_id: r async for r in engine.generate(requests)}


def tokens(results: dict[str, GenerateResult]) -> dict[str, list[list[int]]]:
    return {k: [s.response_ids for s in r.samples] for k, r in results.items()}


def generate_calls(engine: SGLangEngine) -> list[Any]:
    return standin(engine).tokenizer_manager.calls_of("generate_request")


# --- construction -------------------------------------------------------------------------------------------


async def test_built_inside_a_running_loop_it_works_and_owns_a_tokenizer(model_path: Path) -> None:
    engine = make_engine(model_path, tp_size=2, mem_fraction_static=0.5, max_running_requests=8, seed=7)
    assert isinstance(engine, RolloutEngine)
    assert standin(engine).loop is not asyncio.get_running_loop()  # built off the loop: its own is never driven
    args = standin(engine).server_args
    assert (args["tp_size"], args["mem_fraction_static"], args["max_running_requests"], args["random_seed"]) == (
        2, 0.5, 8, 7)
    assert args["skip_tokenizer_init"] and args["enable_memory_saver"] and not args["enable_deterministic_inference"]
    assert engine.weight_group_ranks("broadcast") == 2 and engine.weight_group_ranks("ipc") == 1
    result = (await run(engine, [req("t", PROMPTS[0], max_new_tokens=4, ignore_eos=True)]))["t"]
    text = engine.tokenizer.decode(result.samples[0].response_ids)
    assert isinstance(text, str) and standin(engine).tokenizer_manager.tokenizer is None


def test_a_process_running_an_engine_writes_no_core_file_when_sglang_sigquits_it(tmp_path: Path) -> None:
    """sglang installs its SIGQUIT handler only in the main thread; ours builds the engine in a thread, so the
    signal's default action (a core dump) applies: the adapter turns core dumps off, unless asked to keep them."""
    script = ("import resource, sys\n"
              "from rlinf_pipe.engines.rollout.sglang_launch import no_core_dumps\n"
              "resource.setrlimit(resource.RLIMIT_CORE, (1 << 20, resource.getrlimit(resource.RLIMIT_CORE)[1]))\n"
              "changed = no_core_dumps()\n"
              "print(changed, resource.getrlimit(resource.RLIMIT_CORE)[0], no_core_dumps())\n")
    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1 << 20:
        pytest.skip(f"this machine's hard core-file limit ({hard}) is below the test's soft one")
    env = {k: v for k, v in os.environ.items() if k != CORE_DUMPS_ENV}
    off = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert off.stdout.split() == ["True", "0", "False"]  # (the second call finds them off already)
    kept = subprocess.run([sys.executable, "-c", script], env={**env, CORE_DUMPS_ENV: "1"}, capture_output=True,
                          text=True, check=True)
    assert kept.stdout.split() == ["False", str(1 << 20), "False"]


async def test_the_adapter_turns_core_dumps_off_before_it_builds_the_engine(model_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from rlinf_pipe.engines.rollout import sglang_engine

    calls = []
    monkeypatch.setattr(sglang_engine, "no_core_dumps", lambda: calls.append("off"))
    monkeypatch.setattr(sglang_engine, "EngineThread",
                        lambda factory, args: (calls.append("build"), sglang_launch.EngineThread(factory, args))[1])
    engine = make_engine(model_path)
    assert calls == ["off", "build"]
    engine.shutdown()


async def test_building_an_engine_keeps_this_processs_logging(model_path: Path) -> None:
    """sglang's Engine calls `logging.basicConfig(level=ERROR, force=True)` in the process that builds it (with our
    log_level): the worker's handlers and its warnings would be gone for the rest of its life."""
    root = logging.getLogger()
    written = io.StringIO()
    handler = logging.StreamHandler(written)
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        engine = make_engine(model_path)
        assert standin(engine).server_args["log_level"] == "error"
        assert handler in root.handlers and root.level == logging.INFO
        logging.getLogger("rlinf_pipe.channels").warning("still heard")
        assert "still heard" in written.getvalue()  # (basicConfig(force=True) closes the handlers it removes)
        engine.shutdown()
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_the_standins_scheduler_process_dies_with_the_thread_that_built_the_engine(model_path: Path) -> None:
    """What the stand-in models, checked against the kernel: sglang's processes set PR_SET_PDEATHSIG, whose parent
    is the thread that started them."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the thread ends when the block does
        with logging_kept():  # (as sglang, the stand-in reconfigures logging)
            built = pool.submit(sglang_standin.Engine, model_path=str(model_path), skip_tokenizer_init=True).result()
    assert built.scheduler.process.wait(timeout=60) == -signal.SIGKILL
    with pytest.raises(SchedulerDied, match="PR_SET_PDEATHSIG"):
        built.scheduler.check_alive()
    built.shutdown()


def _free_pair_of_store_ports() -> int:
    """A GPU index g whose store port and the next (NCCL_PORT_BASE + g, + g + 1) are free here now."""
    for gpu in range(0, 400, 2):
        if nccl_port_for(gpu) is not None and nccl_port_for(gpu + 1) is not None:
            return gpu
    raise AssertionError("no two free ports above NCCL_PORT_BASE")


def test_a_store_port_left_in_time_wait_by_a_killed_engine_is_taken_again() -> None:
    """A relaunched engine's port still has the killed one's connections in TIME_WAIT (a minute on Linux): it is free
    for the store (which binds with SO_REUSEADDR), so the engine takes it rather than drawing at random."""
    gpu = _free_pair_of_store_ports()
    port = NCCL_PORT_BASE + gpu
    listener = socket.create_server(("0.0.0.0", port), reuse_port=False)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the listening side closes first: its end of the connection stays in TIME_WAIT on `port`
    client.close()
    assert nccl_port_for(gpu) is None  # (a listener there: taken)
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError):  # what the probe without SO_REUSEADDR ran into
        plain.bind(("0.0.0.0", port))
    assert nccl_port_for(gpu) == port


def test_an_engine_waits_for_the_processes_of_the_last_engine_on_its_gpu(model_path: Path, caplog) -> None:
    """A relaunched engine starts while the killed one's processes may still be dying (holding GPU memory): it
    waits for the processes the last engine on its first GPU recorded, then warns and starts anyway."""
    gpu = _free_pair_of_store_ports()
    first = make_engine(model_path, first_gpu=gpu)
    scheduler = standin(first).scheduler.process.pid
    assert scheduler in [pid for pid, _ in sglang_leftovers.recorded(gpu)]
    with caplog.at_level(logging.WARNING, logger=sglang_leftovers.__name__):
        second = make_engine(model_path, first_gpu=gpu)  # the first still runs: waited for, in vain
    waited = re.search(rf"the processes \[([\d, ]+)\] of an earlier SGLang engine on GPU {gpu} are still running",
                       caplog.text)
    assert waited and scheduler in [int(pid) for pid in waited.group(1).split(", ")]  # (with this process's others)
    first.shutdown()
    second_scheduler = standin(second).scheduler.process.pid
    second.shutdown()  # its processes end: the next engine there has nothing of theirs to wait for
    ours = [(pid, started) for pid, started in sglang_leftovers.recorded(gpu) if pid in (scheduler, second_scheduler)]
    assert second_scheduler in [pid for pid, _ in ours]  # (the first's too: this process is the parent of both)
    assert sglang_leftovers.wait_for_exit(ours, timeout_s=30) == []


def test_a_recorded_pid_now_held_by_another_process_is_not_waited_for() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(sleeper.pid).create_time()
        assert sglang_leftovers.wait_for_exit([(sleeper.pid, started)], timeout_s=0.2) == [sleeper.pid]
        assert sglang_leftovers.wait_for_exit([(sleeper.pid, started - 5.0)], timeout_s=30) == []  # another process
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sglang_leftovers.wait_for_exit([(sleeper.pid, started)], timeout_s=30) == []


async def test_engines_on_one_node_take_the_store_port_of_their_first_gpu(model_path: Path) -> None:
    """sglang draws each engine's torch.distributed store port at random (22000-29999): engines started at once on a
    node can draw the same, and the second fails to listen (the stand-in's scheduler process binds it as sglang's
    TP rank 0 does). Each engine takes NCCL_PORT_BASE + its first GPU instead, or lets sglang draw when another
    process holds that port."""
    gpu = _free_pair_of_store_ports()
    engines = [make_engine(model_path, first_gpu=g) for g in (gpu, gpu + 1)]
    try:
        assert [standin(e).server_args["nccl_port"] for e in engines] == [NCCL_PORT_BASE + gpu, NCCL_PORT_BASE + gpu + 1]
        with pytest.raises(RuntimeError, match="EADDRINUSE"), logging_kept():  # what a clash does to the second one
            sglang_standin.Engine(model_path=str(model_path), skip_tokenizer_init=True, nccl_port=NCCL_PORT_BASE + gpu)
        held = make_engine(model_path, first_gpu=gpu)  # its port is taken: sglang's own draw
        assert "nccl_port" not in standin(held).server_args and standin(held).nccl_port != NCCL_PORT_BASE + gpu
        held.shutdown()
    finally:
        for engine in engines:
            engine.shutdown()


async def test_the_engine_outlives_the_thread_that_built_it_until_shutdown(model_path: Path) -> None:
    engine = make_engine(model_path)
    process = standin(engine).scheduler.process
    result = (await run(engine, [req("t", PROMPTS[0], max_new_tokens=3, ignore_eos=True)]))["t"]
    assert len(result.samples[0].response_ids) == 3 and process.poll() is None
    engine.shutdown()
    assert process.poll() == -signal.SIGKILL  # killed by the shutdown (sglang's kill_process_tree), not by its thread
    assert not engine._engine_thread._thread.is_alive()


def test_missing_sglang_error_names_the_extra_and_the_gpu(monkeypatch: pytest.MonkeyPatch, model_path: Path) -> None:
    assert "sglang" not in sys.modules  # importing the adapter did not import sglang
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` raise ImportError
    with pytest.raises(SGLangNotInstalledError) as info:
        SGLangEngine(model_path)
    assert INSTALL_HINT in str(info.value) and "GPU" in str(info.value) and isinstance(info.value, ImportError)
    with pytest.raises(ImportError, match="rollout.backend 'torch'"):
        import_sglang()


async def test_an_allocator_setting_sglangs_memory_saver_refuses_is_left_out(model_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`expandable_segments:True`, common for Megatron, makes torch_memory_saver refuse to start in sglang's
    scheduler processes (which inherit the worker's environment); the rest of the setting is kept."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:128")
    engine = make_engine(model_path)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert (await run(engine, [req("a", PROMPTS[0], max_new_tokens=2)]))["a"].samples


# --- generation ---------------------------------------------------------------------------------------------


async def test_results_stream_as_each_finishes(model_path: Path) -> None:
    engine = make_engine(model_path)
    order = []
    async for result in engine.generate([req("long", PROMPTS[0], max_new_tokens=40, ignore_eos=True),
                                         req("short", PROMPTS[1], max_new_tokens=2, ignore_eos=True)]):
        order.append((result.request_id, len(result.samples[0].response_ids)))
        if result.request_id == "short":
            assert standin(engine).scheduler.running  # the long one is still decoding
    assert order == [("short", 2), ("long", 40)]
    # each sample's send and return and its tokens, for the planner (the short one returned first, both sent at once)
    timed = engine.timing.take()["requests"]
    assert sorted((r[3], r[2]) for r in timed) == sorted([(2, len(PROMPTS[1])), (40, len(PROMPTS[0]))])
    (short, long_) = sorted(timed, key=lambda r: r[3])
    assert 0 <= short[0] <= short[1] <= long_[1] and long_[0] <= short[1]
    assert engine.timing.take() == {"requests": []}  # (taken: the next span starts empty)


async def test_samples_fan_out_with_unambiguous_rids_and_seeds_only_when_deterministic(model_path: Path) -> None:
    request = req("n", PROMPTS[0], temperature=1.0, top_k=50, top_p=0.95, max_new_tokens=10, n=4, seed=123,
                  ignore_eos=True)
    plain = make_engine(model_path, seed=1)
    await run(plain, [request])
    calls = generate_calls(plain)
    assert len(calls) == 4 and all("sampling_seed" not in c.sampling_params for c in calls)  # sglang would ignore it
    rids = [c.rid for c in calls]
    assert len(set(rids)) == 4 and all(len(r) == 32 for r in rids)  # fixed width: none is a prefix of another
    for c in calls:
        sp = c.sampling_params
        assert c.input_ids == PROMPTS[0] and c.return_logprob is True
        assert (sp["n"], sp["top_k"], sp["top_p"], sp["max_new_tokens"], sp["stop_token_ids"]) == (
            1, 50, 0.95, 10, [])
    # without ignore_eos the tokenizer's end-of-sequence id is a stop id too: sglang's scheduler has no tokenizer
    # (skip_tokenizer_init) and stops only on the model configs' ids, which need not hold it
    await run(plain, [req("eos", PROMPTS[0], max_new_tokens=3, stop_token_ids=[7])])
    eos = plain.tokenizer.eos_token_id
    assert eos is not None and generate_calls(plain)[-1].sampling_params["stop_token_ids"] == [7, eos]

    exact = make_engine(model_path, seed=1, deterministic=True)
    assert standin(exact).server_args["enable_deterministic_inference"]
    first = await run(exact, [request])
    seeds = sorted(c.sampling_params["sampling_seed"] for c in generate_calls(exact))
    assert seeds == sorted(sample_seed(123, k) for k in range(4))
    assert len({tuple(s) for s in tokens(first)["n"]}) == 4
    other_engine = make_engine(model_path, seed=2, deterministic=True)
    assert tokens(await run(other_engine, [request])) == tokens(first)  # reproducible across engines and runs
    assert tokens(await run(exact, [request])) == tokens(first)


async def test_logprobs_align_with_tokens(model_path: Path) -> None:
    engine = make_engine(model_path)
    hf_model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    temp = 0.7
    results = await run(engine, [req(str(i), p, temperature=temp, top_k=20, max_new_tokens=12, seed=i)
                                 for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        sample = results[str(i)].samples[0]
        assert len(sample.logprobs) == len(sample.response_ids) > 0
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + sample.response_ids])).logits[0].float()
        expected = torch.log_softmax(logits / temp, -1)[len(prompt) - 1 : -1].gather(
            -1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
        assert sample.version == engine.version


async def test_greedy_and_finish_reasons(model_path: Path) -> None:
    engine = make_engine(model_path, deterministic=True)
    greedy = (await run(engine, [req("g", PROMPTS[2], temperature=0.0, max_new_tokens=12, ignore_eos=True)]))[
        "g"].samples[0]
    assert (greedy.finish_reason, len(greedy.response_ids)) == ("length", 12)
    sample = (await run(engine, [req("s", PROMPTS[2], max_new_tokens=12, ignore_eos=True, seed=5)]))["s"].samples[0]
    ids = sample.response_ids
    cut = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    # (sglang 0.5.23 checks no stop id under ignore_eos, schedule_batch.py `_check_token_based_finish`: refused)
    with pytest.raises(ValueError, match="ignore_eos"):
        await run(engine, [req("s", PROMPTS[2], max_new_tokens=12, ignore_eos=True, stop_token_ids=[ids[cut]])])
    stopped = (await run(engine, [req("s", PROMPTS[2], max_new_tokens=12, seed=5, stop_token_ids=[ids[cut]])]))[
        "s"].samples[0]
    end = next(i for i, t in enumerate(ids) if t == ids[cut] or t == engine.tokenizer.eos_token_id)
    assert stopped.finish_reason == "stop" and stopped.response_ids == ids[: end + 1]
    assert stopped.logprobs == sample.logprobs[: end + 1]


def test_output_mapping_checks_alignment_and_reasons() -> None:
    def out(ids: list[int], lp_ids: list[int], reason: object) -> dict[str, object]:
        return {"output_ids": ids, "meta_info": {"id": "x", "finish_reason": reason,
                                                 "output_token_logprobs": [(-0.5, t, None) for t in lp_ids]}}

    s = SGLangEngine.to_sample(out([1, 2], [1, 2], {"type": "length", "length": 2}), 3)
    assert (s.response_ids, s.logprobs, s.finish_reason, s.version) == ([1, 2], [-0.5, -0.5], "length", 3)
    assert SGLangEngine.to_sample(out([1], [1, 9], {"type": "stop", "matched": 9}), 0).response_ids == [1, 9]
    assert SGLangEngine.to_sample(out([], [], {"type": "abort", "message": "x"}), 0).finish_reason == "abort"
    with pytest.raises(SGLangError, match="disagree"):
        SGLangEngine.to_sample(out([1, 2], [1, 3], {"type": "length", "length": 2}), 0)
    with pytest.raises(SGLangError, match="finish_reason"):
        SGLangEngine.to_sample(out([1], [1], None), 0)
    # an id outside the vocabulary (NaN logits): sglang puts an EOS id in output_ids and keeps the bad id's log-prob
    with pytest.raises(SGLangError, match="outside the vocabulary after 2 tokens: the logits held NaN"):
        SGLangEngine.to_sample(out([1, 2, 0], [1, 2, 10**9], {"type": "stop", "matched": "NaN happened"}), 0)


async def generate_then_abort(engine: SGLangEngine, abort: Callable[[], Awaitable[Any]]) -> dict[str, GenerateResult]:
    """A short request and a long one of two samples, with `abort` awaited once the short one is done: the long
    one's samples end aborted, with the tokens (and log-probs) they had."""
    results = {}
    async for result in engine.generate([req("short", PROMPTS[0], max_new_tokens=3, ignore_eos=True),
                                         req("running", PROMPTS[1], max_new_tokens=400, ignore_eos=True, n=2)]):
        results[result.request_id] = result
        if result.request_id == "short":
            await abort()
    assert results["short"].samples[0].finish_reason == "length"
    for s in results["running"].samples:
        assert s.finish_reason == "abort" and 0 < len(s.response_ids) < 400 and len(s.logprobs) == len(s.response_ids)
    return results


async def test_abort_and_an_early_exit_end_only_their_own_requests(model_path: Path) -> None:
    engine = make_engine(model_path)

    async def abort_here() -> None:
        engine.abort()

    await generate_then_abort(engine, abort_here)

    # two calls at once: stopping one early aborts its requests, never the other's
    other = asyncio.ensure_future(run(engine, [req(str(i), PROMPTS[2], max_new_tokens=30, ignore_eos=True)
                                               for i in range(12)]))
    gen = engine.generate([req("a", PROMPTS[0], max_new_tokens=2, ignore_eos=True),
                           req("b", PROMPTS[1], max_new_tokens=300, ignore_eos=True)])
    assert (await gen.__anext__()).request_id == "a"
    await gen.aclose()
    assert all(r.samples[0].finish_reason == "length" for r in (await other).values())


async def test_an_abort_from_another_thread_reaches_sglang_from_the_generating_loop(model_path: Path) -> None:
    """A worker abandons a step from its control thread; sglang's `abort_request` may only run on the thread of
    the tokenizer manager's loop (its zmq socket is not thread-safe: the stand-in raises)."""
    engine = make_engine(model_path)
    await generate_then_abort(engine, lambda: asyncio.to_thread(engine.abort))
    assert len(standin(engine).tokenizer_manager.calls_of("abort_request")) == 2


async def test_sleep_right_after_an_early_exit_waits_until_the_scheduler_is_idle(model_path: Path) -> None:
    engine = make_engine(model_path)
    gen = engine.generate([req("a", PROMPTS[0], max_new_tokens=2, ignore_eos=True),
                           req("b", PROMPTS[1], max_new_tokens=300, ignore_eos=True)])
    await gen.__anext__()
    await gen.aclose()
    await engine.sleep()  # a release now, before the scheduler's next iteration, would kill it
    assert standin(engine).scheduler.released == {"kv_cache", "weights", "cuda_graph"}
    assert standin(engine).scheduler.died is None

    raw = make_engine(model_path)  # what happens without waiting: sglang's idle assertion ends the scheduler
    gen = raw.generate([req("a", PROMPTS[0], max_new_tokens=2, ignore_eos=True)])
    await gen.__anext__()
    await gen.aclose()
    with pytest.raises(SchedulerDied, match="only when server is idle"):
        await raw.tm.release_memory_occupation(raw.requests.ReleaseMemoryOccupationReqInput(), None)


async def test_a_wait_for_idle_cancelled_midway_does_not_fail_the_next(model_path: Path) -> None:
    """A worker's `sleep` cancelled while sglang waits for idle (an abandoned step) leaves sglang's deferred flush
    pending: sglang answers any flush asked for meanwhile at once, unflushed ("Another flush_cache is already in
    progress"). The next wait takes the pending one's answer first instead of failing."""
    engine = make_engine(model_path)
    scheduler = standin(engine).scheduler
    gen = engine.generate([req("long", PROMPTS[1], max_new_tokens=120, ignore_eos=True)])
    running = asyncio.ensure_future(gen.__anext__())
    while not scheduler.running:  # (until the request reached the scheduler: sending it takes a turn of the loop)
        await asyncio.sleep(0)
    waiting = asyncio.ensure_future(engine.until_idle())
    while scheduler.pending_flush is None:  # (the stand-in's scheduler took the deferred flush)
        await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await engine.until_idle()  # returns once the generation ended and the scheduler went idle
    assert (await running).samples[0].finish_reason == "length" and scheduler.is_fully_idle()
    await gen.aclose()


async def test_an_abort_reaches_samples_asked_for_during_a_weight_update(model_path: Path) -> None:
    """sglang holds a request that arrives while a weight update runs back until the update is done, and an abort
    in between never reaches its scheduler (which does not hold it yet; sglang sends one abort per request), so
    the sample would run to `max_new_tokens`. Samples asked for during a weight-update session wait in the adapter
    instead, where an abort ends them at once, and are sent on the new weights once it is done."""
    engine = make_engine(model_path)
    tm = standin(engine).tokenizer_manager
    bucket = [(k, v.detach().clone()) for k, v in standin(engine).scheduler.model.state_dict().items()]
    async with engine.weight_update(version=1) as load:
        generating = asyncio.ensure_future(run(engine, [req("held", PROMPTS[1], max_new_tokens=300,
                                                              ignore_eos=True)]))
        loading = asyncio.ensure_future(load(bucket))
        while not (engine.held_back or tm.rid_to_state):  # (until the sample was asked for)
            await asyncio.sleep(0)
        engine.abort()
        await loading
    sample = (await generating)["held"].samples[0]
    assert sample.finish_reason == "abort" and sample.response_ids == []
    assert not tm.calls_of("generate_request")  # it never reached sglang
    after = await run(engine, [req("after", PROMPTS[0], max_new_tokens=5, ignore_eos=True)])
    assert after["after"].samples[0].finish_reason == "length" and after["after"].samples[0].version == 1


async def test_samples_held_back_by_a_weight_update_are_not_sent_once_the_consumer_stopped(model_path: Path) -> None:
    """A consumer that stops early while samples wait for a weight update to end: once it ends they are dropped,
    not sent to run to `max_new_tokens` while the generator's cleanup waits for them (found by a review)."""
    engine = make_engine(model_path)
    tm = standin(engine).tokenizer_manager
    bucket = [(k, v.detach().clone()) for k, v in standin(engine).scheduler.model.state_dict().items()]
    async with engine.weight_update(version=1) as load:
        gen = engine.generate([req("held", PROMPTS[1], max_new_tokens=300, ignore_eos=True)])
        first = asyncio.ensure_future(gen.__anext__())
        while not engine.held_back:  # (until the sample was asked for)
            await asyncio.sleep(0)
        first.cancel()  # the consumer stops; the generator's cleanup waits for the held-back sample
        await load(bucket)
    with pytest.raises(asyncio.CancelledError):
        await first
    assert not tm.calls_of("generate_request")


# --- weights and memory -------------------------------------------------------------------------------------


async def test_each_tp_rank_gets_a_payload_of_its_own(model_path: Path) -> None:
    """sglang's ranks each deserialize their own payload: torch counts a CUDA IPC handle's users per pickling."""
    bucket = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    payloads, _ = tensor_payloads(bucket, 3)
    assert len({id(p) for p in payloads}) == 3
    for payload in payloads:
        loaded = pickle.loads(payload)  # (as sglang's ranks do, through its allow-list)
        flat, metadata = loaded["flattened_tensor"], loaded["metadata"]
        for (name, tensor), meta in zip(bucket, metadata, strict=True):
            got = flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
            assert meta.name == name and torch.equal(got, tensor)
    engine = make_engine(model_path, tp_size=2)
    async with engine.weight_update(version=1):
        with pytest.raises(ValueError, match="payload of its own"):  # (the stand-in says what sglang does not)
            await engine.load_payload([payloads[0]] * 2)


async def test_weight_updates_run_in_sessions_and_survive_sleep(model_path: Path) -> None:
    engine = make_engine(model_path)
    tm = standin(engine).tokenizer_manager
    ok, message = await tm.update_weights_from_tensor(engine.requests.UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[b""], load_format="flattened_bucket"), None)
    assert not ok and "must run between begin_weight_update() and end_weight_update()" in message
    request = [req("w", PROMPTS[0], temperature=0.0, max_new_tokens=10, ignore_eos=True)]
    before = tokens(await run(engine, request))
    original = {k: v.detach().clone() for k, v in standin(engine).scheduler.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    await engine.update_weights([(k, v + 0.5 * torch.randn(v.shape, generator=gen)) for k, v in original.items()],
                                version=3)
    assert len(tm.calls_of("begin_weight_update")) == len(tm.calls_of("end_weight_update")) == 1
    assert all(c.load_format == "flattened_bucket" and not c.flush_cache
               for c in tm.calls_of("update_weights_from_tensor")[1:])
    after = await run(engine, request)
    assert engine.version == 3 and after["w"].samples[0].version == 3 and tokens(after) != before

    await engine.sleep()  # no CPU backup: the weights are gone until a version is loaded
    with pytest.raises(EngineAsleepError, match="wake"):
        await run(engine, request)
    await engine.wake()
    with pytest.raises(EngineAsleepError, match="without a CPU backup"):
        await run(engine, request)
    await engine.sleep()
    await engine.update_weights(list(original.items()), version=4)  # while asleep: the weights come back first
    assert tm.calls_of("resume_memory_occupation")[-1].tags == ["weights"]
    await engine.wake()
    assert tm.calls_of("resume_memory_occupation")[-1].tags == ["kv_cache", "cuda_graph"]
    assert tokens(await run(engine, request)) == before and engine.version == 4


async def test_a_refused_update_raises_and_keeps_the_version(model_path: Path) -> None:
    engine = make_engine(model_path)
    with pytest.raises(SGLangError, match="session is already open"):
        async with engine.weight_update(5):
            await engine.call("begin_weight_update", engine.requests.BeginWeightUpdateReqInput())
    assert engine.version == 0 and standin(engine).scheduler.session is None


async def test_an_update_cancelled_while_sglang_opens_its_session_does_not_block_the_next(model_path: Path) -> None:
    """sglang opens the session whether or not the caller still waits (its scheduler runs the request): the next
    update closes the session left open and goes on, rather than failing "already open" for the rest of the run."""
    engine = make_engine(model_path)
    scheduler = standin(engine).scheduler
    original = {k: v.detach().clone() for k, v in scheduler.model.state_dict().items()}

    async def update() -> None:
        async with engine.weight_update(1) as load:
            await load(list(original.items()))

    interrupted = asyncio.ensure_future(update())
    while not standin(engine).tokenizer_manager.calls_of("begin_weight_update"):
        await asyncio.sleep(0)  # (until the begin request is on its way)
    interrupted.cancel()
    with pytest.raises(asyncio.CancelledError):
        await interrupted
    await scheduler.control(lambda: None)  # (one scheduler iteration: the begin request has run)
    assert scheduler.session == "all" and engine.version == 0
    await engine.update_weights(list(original.items()), version=2)
    assert engine.version == 2 and scheduler.session is None


async def _broadcast_version(engine: SGLangEngine, path: Path, version: int, verify: bool,
                             timeout_s: float = 300.0) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """A real gloo broadcast group: our sender at rank 0, the engine's TP ranks after it (joining as sglang's do)."""
    arch = read_hf_arch(path)
    layout = plan_weight_layout(arch, torch.float32, 40_000, trailer=False)
    rendezvous = Rendezvous("127.0.0.1", free_port(), 1 + engine.weight_group_ranks("broadcast"), "gloo",
                            f"test-broadcast-{free_port()}", timeout_s)
    sender, receiver = await asyncio.gather(asyncio.to_thread(open_sender, "broadcast", layout, rendezvous),
                                            engine.open_weight_receiver("broadcast", layout, rendezvous, 1))
    weights = random_weights(arch, seed=version)
    stream = [(n, t) for n, t in weights]

    async def receive() -> Any:
        async with engine.weight_update(version) as load:
            return await receiver.receive(WeightVersion(version), load, verify)

    published, loaded = await asyncio.gather(asyncio.to_thread(sender.publish, version, stream, True), receive())
    return published, loaded, dict(weights)


async def test_a_broadcast_reaches_every_tp_rank_of_the_engine(model_path: Path) -> None:
    engine = make_engine(model_path, tp_size=2)
    published, loaded, sent = await _broadcast_version(engine, model_path, 1, verify=True)
    state = standin(engine).scheduler.model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in sent.items() if n in state)
    assert (loaded.version, loaded.num_bytes, loaded.num_tensors) == (1, published.num_bytes, published.num_tensors)
    assert loaded.verified_by == ""  # sglang's ranks took the bytes: the driver asks the engine to verify by name
    assert await engine.verify_weights(published) == ""  # Qwen2's sglang model cannot read weights back by name
    calls = standin(engine).tokenizer_manager.calls_of("update_weights_from_distributed")
    assert all(c.load_format == "flattened_bucket" and c.dtypes[0] == "float32" for c in calls) and len(calls) > 1
    assert engine.version == 1


async def test_a_bucket_sglang_cannot_load_fails_the_version_once_every_bucket_was_taken_in(model_path: Path) -> None:
    """sglang reports a bucket it received but could not load and stays in the group; the sender broadcasts every
    bucket, so the receiver takes in the rest before it raises (stopping at the failure left the sender waiting
    for a collective nobody joined)."""
    engine = make_engine(model_path)
    scheduler = standin(engine).scheduler
    load, loads = scheduler.load_weights, []

    def first_fails(named: list[tuple[str, torch.Tensor]]) -> None:
        loads.append(len(named))
        if len(loads) == 1:
            raise AssertionError("Attempted to load weight (the test's) into parameter")
        load(named)

    scheduler.load_weights = first_fails
    with pytest.raises(WeightSyncError, match="bucket 0: Failed to update parameter online"):
        await _broadcast_version(engine, model_path, 1, verify=False, timeout_s=20)
    buckets = len(standin(engine).tokenizer_manager.calls_of("update_weights_from_distributed"))
    assert len(loads) == buckets > 1 and engine.version == 0
    scheduler.load_weights = load
    await _broadcast_version(engine, model_path, 2, verify=False)  # the group is still whole: the next one loads
    assert engine.version == 2


async def test_a_bucket_refused_before_its_broadcast_fails_the_version_at_once(model_path: Path) -> None:
    """A refusal that may come before sglang joined the broadcast (here: outside a weight-update session) leaves its
    ranks out of step with the group: nothing more is asked of them."""
    engine = make_engine(model_path)
    arch = read_hf_arch(model_path)
    layout = plan_weight_layout(arch, torch.float32, 40_000, trailer=False)
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2, "gloo", f"test-refused-{free_port()}", 20)
    sender, receiver = await asyncio.gather(asyncio.to_thread(open_sender, "broadcast", layout, rendezvous),
                                            engine.open_weight_receiver("broadcast", layout, rendezvous, 1))
    with pytest.raises(SGLangGroupError, match="refused bucket 0 .*begin_weight_update"):
        await receiver.receive(WeightVersion(1), lambda bucket: None)  # (no session opened; nothing sent)
    assert len(standin(engine).tokenizer_manager.calls_of("update_weights_from_distributed")) == 1


async def test_verification_by_name_catches_weights_that_differ(llama_path: Path) -> None:
    engine = make_engine(llama_path)
    published, _, _ = await _broadcast_version(engine, llama_path, 2, verify=True)
    assert await engine.verify_weights(published) == "name"
    with torch.no_grad():  # what verification must catch: the engine holds other values than the actor sent
        standin(engine).scheduler.model.model.embed_tokens.weight[0, 0] += 1
    with pytest.raises(WeightSyncError, match="model.embed_tokens.weight"):
        await verify_by_name(engine, published)


async def test_ipc_handles_reach_the_engine(model_path: Path) -> None:
    arch = read_hf_arch(model_path)
    layout = plan_weight_layout(arch, torch.float32, 40_000)
    engine = make_engine(model_path)
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2)
    sender, receiver = await asyncio.gather(asyncio.to_thread(open_sender, "ipc", layout, rendezvous),
                                            engine.open_weight_receiver("ipc", layout, rendezvous, 1))
    try:
        weights = random_weights(arch, seed=4)

        async def receive() -> Any:
            async with engine.weight_update(6) as load:
                return await receiver.receive(WeightVersion(6), load, True)

        published, loaded = await asyncio.gather(asyncio.to_thread(sender.publish, 6, weights, True), receive())
        assert loaded.checksums == published.checksums and loaded.verified_by == "crc32"
        state = standin(engine).scheduler.model.state_dict()
        assert all(torch.equal(state[n], t) for n, t in weights if n in state) and engine.version == 6
    finally:
        sender.close()


async def test_an_actor_slot_goes_to_sglang_unopened_only_for_one_tp_rank(monkeypatch):
    """sglang answers a bucket after a barrier of its ranks, but a rank frees its mapping (waiting for its copies)
    after it: a second rank, copying across GPUs, may still read the actor's slot when the actor rewrites it two
    buckets later. So with TP > 1 the worker maps the slot and passes
    copies on (torch keeps those until every rank freed them); either way sglang's ranks hold what was loaded, so
    the driver verifies it by name. The CUDA handle is what cannot exist here."""
    from rlinf_pipe.engines.rollout.sglang_weights import SGLangIpcReceiver
    from rlinf_pipe.weights.ipc import Handle, IpcReceiver

    mapped: list[int] = []

    async def map_here(self, index, bucket, handle, load_bucket, verify):
        mapped.append(index)
        return None, None

    monkeypatch.setattr(IpcReceiver, "load_handle", map_here)
    for tp, passed, opened in ((1, [[b"slot"]], []), (2, [], [0])):
        payloads: list[list[bytes]] = []

        async def load_payload(p: list[bytes]) -> None:
            payloads.append(p)

        receiver = SGLangIpcReceiver.__new__(SGLangIpcReceiver)
        receiver.engine, receiver.cuda_handles = types.SimpleNamespace(tp_size=tp, load_payload=load_payload), False
        mapped.clear()
        await receiver.load_handle(0, None, Handle(1, True, b"slot"), None, False)
        assert (payloads, mapped) == (passed, opened) and receiver.cuda_handles  # (verified by name after)


class _HTTPException(Exception):
    """What sglang 0.5.23 raises out of `async_generate` for a request it aborted with a status above 400
    (fastapi's HTTPException: `status_code`, `detail`; tokenizer_manager `_handle_abort_finish_reason`)."""

    def __init__(self, status_code: int, detail: str):
        super().__init__(detail)
        self.status_code, self.detail = status_code, detail


@pytest.mark.parametrize(("raised", "expected"), [
    (_HTTPException(500, "Out of memory even after retracting all other requests in the decode batch. Aborting the "
                         "last request."), "lower rollout.max_running_requests"),
    (ValueError("The input (9300 tokens) is longer than the model's context length (9216 tokens)."),
     "check data.max_prompt_length + rollout.max_new_tokens"),
])
async def test_a_request_sglang_aborts_itself_is_an_error_that_names_the_keys(model_path: Path, monkeypatch, raised,
                                                                             expected) -> None:
    engine = make_engine(model_path)
    try:
        async def aborted(obj: Any, request: Any = None) -> Any:  # (sglang raises it from its generator)
            raise raised
            yield  # noqa: unreachable (an async generator, as sglang's)

        monkeypatch.setattr(standin(engine).tokenizer_manager, "generate_request", aborted)
        with pytest.raises(SGLangError, match=f"sglang aborted a request .*{re.escape(expected)}"):
            async for _ in engine.generate([req("a", PROMPTS[0], max_new_tokens=4)]):
                pass
    finally:
        engine.shutdown()


def test_records_name_the_physical_gpu_where_the_process_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Ray clusters on one host number their GPUs from 0: the record follows the device the worker was given."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1c,GPU-77aa")
    assert sglang_leftovers.record_path(0).name == "sglang-gpuGPU-5f1c.pids"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert sglang_leftovers.record_path(3).name == "sglang-gpu3.pids"
