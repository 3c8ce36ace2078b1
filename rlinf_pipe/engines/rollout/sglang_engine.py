"""`SGLangEngine`: a `RolloutEngine` over SGLang's offline engine (`sglang.Engine`, GPU only), written against
sglang 0.5.23 (the contract `scripts/sglang_contract.py` extracts from its wheel; docs/backends.md).

It runs inside an async Ray actor, which shapes everything:

* the Engine's blocking methods drive the event loop it captured when built (`run_until_complete`), which cannot
  run inside the actor's running loop. So the Engine is built in a thread of its own (`EngineThread`: its captured
  loop is never used; the thread lives as long as the Engine, whose processes die with it) and this adapter calls
  only coroutines, from the actor's loop: the tokenizer manager's `generate_request` (its generator run to its end,
  which releases sglang's model-update lock: `sglang_requests`) and its control coroutines with sglang's request
  classes (`io_struct`), plus the synchronous `tokenizer_manager.abort_request` on the same loop, sent once the
  scheduler holds the request (an abort before that is lost);
* importing sglang and building its Engine change this process (the asyncio policy, the start method, NCCL's and
  CUDA's variables, an exit hook that kills every descendant): `sglang_host` puts them back;
* weight updates run inside a weight-update session (`begin_weight_update` ... `end_weight_update`), which sglang
  0.5.23 requires; the prefix cache is flushed once the version is in;
* memory is released only once the scheduler is idle (sglang asserts it and its scheduler dies otherwise, which
  an early-stopped generate leaves it not yet): `flush_cache(timeout_s)` waits for that. sglang holds one such
  deferred flush at a time and answers any other at once, unflushed, so a wait whose caller was cancelled is
  shielded and the next wait takes its answer first;
* samples asked for during a weight update wait in the adapter until it is done: sglang would hold them back
  itself, but an abort sent meanwhile never reaches its scheduler (which does not hold them yet), and sglang sends
  one abort per request, so they would run to `max_new_tokens`;
* sglang runs with `skip_tokenizer_init` (token ids in and out), so the adapter owns a tokenizer for decoding;
* every sample is its own request with a fixed-width random rid (sglang aborts by rid prefix: `3#0#1` would abort
  `3#0#12`); with `deterministic` each carries `sampling_seed = sample_seed(request seed, k)`, which sglang honours
  only under deterministic inference (without it sglang ignores seeds silently, so none are sent).

Weights reach the engine three ways (`sglang_weights`): its own ranks join the broadcast group
(`update_weights_from_distributed`, flattened buckets), IPC handles pass straight to its schedulers
(`update_weights_from_tensor`, flattened buckets), or buckets a standard receiver got (object store) are copied to
the GPU and passed as IPC handles.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import torch

from rlinf_pipe.engines.rollout.decode_timing import RequestTiming
from rlinf_pipe.engines.rollout.engine import (
    EngineAsleepError,
    GenerateRequest,
    GenerateResult,
    SampleOutput,
    sample_seed,
)
from rlinf_pipe.engines.rollout.sglang_errors import SESSION_OPEN, SGLangError, aborted_message
from rlinf_pipe.engines.rollout.sglang_launch import (
    ALLOC_CONF,
    EngineThread,
    import_sglang,
    nccl_port_for,
    no_core_dumps,
    server_args,
    without_expandable_segments,
)
from rlinf_pipe.engines.rollout.sglang_host import EngineProcesses, contained, forget_atexit
from rlinf_pipe.engines.rollout.sglang_leftovers import record_children, wait_for_leftovers
from rlinf_pipe.engines.rollout.sglang_node import use_node_jit_cache
from rlinf_pipe.engines.rollout.sglang_requests import Aborts, generate_one, to_sample
from rlinf_pipe.utils.device_memory import hand_back_cached_memory
from rlinf_pipe.utils.futures import mark_retrieved
from rlinf_pipe.weights import LoadBucket, WeightLayout, WeightReceiver, WeightVersion
from rlinf_pipe.weights.process_group import Rendezvous

log = logging.getLogger(__name__)

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # sglang/srt/constants.py
WEIGHTS_TAG = "weights"
IDLE_WAIT_S = 30.0  # one `flush_cache(timeout_s)` wait for the scheduler to go idle
IDLE_ATTEMPTS = 10


class SGLangEngine:
    """Generates with an `sglang.Engine` serving the HF model folder `model_path` on this process's GPUs.

    `tp_size` GPUs per engine; `mem_fraction_static` of each GPU for weights and KV cache; `max_running_requests`
    caps the sequences decoded at once (None: sglang's choice); `seed` is the engine's `random_seed` (give each
    engine its own); `deterministic` turns on sglang's deterministic inference and per-sample seeds; `cpu_backup`
    keeps a host copy of the weights through `sleep` (without it a weight update must follow `sleep` before the
    next `generate`, which is what the runner does). `first_gpu`: the index on its node of the engine's first GPU,
    which picks its torch.distributed port (`nccl_port_for`). `version` is the weight version of the folder's weights.
    `sglang` replaces the real package (an object with `Engine` and `io_struct`; the tests pass a CPU stand-in).
    """

    native_transports: tuple[str, ...] = ("broadcast", "ipc")

    def __init__(self, model_path: str | os.PathLike[str], *, tp_size: int = 1, mem_fraction_static: float = 0.85,
                 max_running_requests: int | None = None, seed: int = 0, deterministic: bool = False,
                 dtype: str = "auto", cpu_backup: bool = False, first_gpu: int | None = None, version: int = 0,
                 sglang: Any = None):
        from transformers import AutoTokenizer

        use_node_jit_cache()  # (read when flashinfer is imported: one cache folder for the node's engines)
        with contained():  # (sglang's import and build change this process: put back once it is built)
            api = sglang if sglang is not None else import_sglang()
            self._build(api, str(model_path), tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                        max_running_requests=max_running_requests, seed=seed, deterministic=deterministic,
                        dtype=dtype, cpu_backup=cpu_backup, first_gpu=first_gpu)
        self.engine = self._engine_thread.engine
        self.tm = self.engine.tokenizer_manager
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.tp_size, self.deterministic, self.cpu_backup = tp_size, deterministic, cpu_backup
        self._version = version
        self._seeds = random.Random(seed)
        self._released: set[str] = set()
        self._weights_lost = False  # released without a CPU backup and not loaded since
        self._abort_epoch = 0
        self._inflight: set[str] = set()
        self._aborts = Aborts(self.tm, self._inflight)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop generating (the tokenizer manager's)
        self._no_update = asyncio.Event()  # clear during a weight-update session: samples wait to be sent
        self._no_update.set()
        self._held_back = 0
        self._flush: asyncio.Future | None = None  # the last `flush_cache(timeout_s)` (shielded: it may outlive us)
        self.timing = RequestTiming()  # each sample's send and return, taken by the worker into its generate span

    def _build(self, api: Any, model_path: str, *, first_gpu: int | None, **args: Any) -> None:
        """Build the Engine in its thread (`EngineThread`), noting the processes it starts."""
        self.requests = api.io_struct
        self.server_args = server_args(model_path, nccl_port=nccl_port_for(first_gpu), **args)
        if ALLOC_CONF in os.environ:  # (this process runs the engine only: its schedulers inherit the setting)
            os.environ[ALLOC_CONF] = without_expandable_segments(os.environ[ALLOC_CONF])
        if first_gpu is not None:  # a killed engine's processes there may still hold GPU memory
            wait_for_leftovers(first_gpu)
        no_core_dumps()  # (sglang ends this process with SIGQUIT when its scheduler fails)
        self._processes = EngineProcesses()
        self._processes.before()
        self._engine_thread = EngineThread(api.Engine, self.server_args)
        self._processes.after()
        if first_gpu is not None:
            record_children(first_gpu)

    @property
    def version(self) -> int:
        """The weight version currently loaded."""
        return self._version

    @property
    def held_back(self) -> int:
        """Samples asked for that wait for a weight update to end before they are sent."""
        return self._held_back

    async def call(self, method: str, request: Any, check: bool = True) -> Any:
        """Await a tokenizer-manager control coroutine; with `check`, a `(success, message)` reply that failed
        raises."""
        result = await getattr(self.tm, method)(request, None)
        if check and isinstance(result, tuple) and len(result) >= 2 and not result[0]:
            raise SGLangError(f"sglang {method} failed: {result[1]}")
        return result

    # --- generation -------------------------------------------------------------------------------------------
    def _sampling_params(self, request: GenerateRequest, seed: int) -> dict[str, Any]:
        sp = request.sampling
        if sp.ignore_eos and sp.stop_token_ids:
            raise ValueError(f"request {request.request_id!r}: SGLang cannot stop on stop_token_ids under ignore_eos "
                             "(sglang 0.5.23 then checks no stop id at all, and without ignore_eos it stops on the "
                             "model's EOS ids too); drop one of them or use the torch engine")
        params: dict[str, Any] = {
            "temperature": sp.temperature,  # sglang turns 0 into greedy (top_k 1, log-probs at T = 1)
            "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            "max_new_tokens": sp.max_new_tokens,
            "stop_token_ids": self._stop_ids(sp.stop_token_ids, sp.ignore_eos),
            "ignore_eos": sp.ignore_eos,
            "n": 1,
        }
        if self.deterministic:
            params["sampling_seed"] = seed
        return params

    def _stop_ids(self, stop_token_ids: Sequence[int], ignore_eos: bool) -> list[int]:
        """The request's stop ids and, unless `ignore_eos`, the tokenizer's end-of-sequence id: with
        `skip_tokenizer_init` sglang's scheduler has no tokenizer and stops only on the model configs' ids (as
        `TorchEngine` does, both count)."""
        ids = list(stop_token_ids)
        eos = self.tokenizer.eos_token_id
        if not ignore_eos and eos is not None and eos not in ids:
            ids.append(eos)
        return ids

    async def generate(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[GenerateResult]:
        """Yield one `GenerateResult` per request, in the order requests finish."""
        if self._released:
            raise EngineAsleepError("SGLangEngine is asleep: call wake() before generating")
        if self._weights_lost:
            raise EngineAsleepError("SGLangEngine released its weights without a CPU backup: load a weight version "
                                    "(a weight sync) before generating")
        requests = list(requests)
        self._loop = asyncio.get_running_loop()
        epoch = self._abort_epoch
        seeds = [r.sampling.seed if r.sampling.seed is not None else self._seeds.getrandbits(63) for r in requests]
        done: list[list[SampleOutput | None]] = [[None] * r.sampling.n for r in requests]
        left = [r.sampling.n for r in requests]
        mine: set[str] = set()  # this call's rids still running in sglang
        stopped = False  # the consumer stopped early: samples still held back are not sent

        async def run_sample(i: int, k: int) -> tuple[int, int, SampleOutput]:
            if not self._no_update.is_set():
                self._held_back += 1
                try:
                    await self._no_update.wait()
                finally:
                    self._held_back -= 1
            version = self._version  # (sglang runs a request sent now on these weights to its end)
            if self._abort_epoch != epoch or stopped:
                return i, k, SampleOutput(response_ids=[], logprobs=[], finish_reason="abort", version=version)
            rid = uuid.uuid4().hex  # fixed width: no rid is a prefix of another
            params = self._sampling_params(requests[i], sample_seed(seeds[i], k))
            self._inflight.add(rid)
            mine.add(rid)
            sent = time.perf_counter()
            try:
                out = await generate_one(self.tm, self.requests.GenerateReqInput(
                    input_ids=list(requests[i].prompt_ids), sampling_params=params, return_logprob=True, stream=False,
                    rid=rid))
            except Exception as exc:  # (sglang's own aborts: ValueError for 400, fastapi's HTTPException above)
                if isinstance(exc, ValueError) or hasattr(exc, "status_code"):
                    raise SGLangError(aborted_message(exc)) from exc
                raise
            finally:
                self._inflight.discard(rid)
                mine.discard(rid)
            sample = self.to_sample(out, version)
            if sample.finish_reason != "abort":
                self.timing.add(sent, time.perf_counter(), len(requests[i].prompt_ids), len(sample.response_ids))
            return i, k, sample

        tasks = [asyncio.ensure_future(run_sample(i, k)) for i, r in enumerate(requests) for k in range(r.sampling.n)]
        try:
            for next_done in asyncio.as_completed(tasks):
                i, k, sample = await next_done
                done[i][k] = sample
                left[i] -= 1
                if not left[i]:
                    yield GenerateResult(request_id=requests[i].request_id, prompt_ids=list(requests[i].prompt_ids),
                                         samples=[s for s in done[i] if s is not None])
        finally:
            stopped = True
            pending = [t for t in tasks if not t.done()]
            for rid in list(mine):  # the consumer stopped early (or a sample failed): end this call's requests
                self._aborts.abort(rid)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    to_sample = staticmethod(to_sample)

    def abort(self) -> None:
        """End all requests of the `generate` calls now in flight with `abort` (tokens so far are kept). Safe from
        any thread (a worker's control thread abandons a step): sglang's `abort_request` sends on the tokenizer
        manager's zmq socket, which only the thread of the loop generating may use, so the aborts are handed to
        that loop."""
        self._abort_epoch += 1  # (samples not yet sent return `abort` at once)
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._abort_inflight()
            return
        try:
            loop.call_soon_threadsafe(self._abort_inflight)
        except RuntimeError:  # the loop is closed: nothing is generating
            pass

    def _abort_inflight(self) -> None:
        for rid in list(self._inflight):
            self._aborts.abort(rid)


    # --- memory -----------------------------------------------------------------------------------------------
    async def until_idle(self) -> None:
        """Wait until the scheduler is idle (and flush its cache): releasing memory before that kills it. A wait an
        earlier, cancelled call left pending in sglang is waited for first (sglang refuses a second meanwhile)."""
        for _ in range(IDLE_ATTEMPTS):
            if self._flush is not None and not self._flush.done():
                await asyncio.shield(self._flush)
            self._flush = flush = asyncio.ensure_future(self.tm.flush_cache(timeout_s=IDLE_WAIT_S))
            flush.add_done_callback(mark_retrieved)
            if (await asyncio.shield(flush)).success:
                return
        raise SGLangError(f"sglang's scheduler did not go idle within {IDLE_ATTEMPTS * IDLE_WAIT_S:.0f} s (requests "
                          "still running?)")

    async def _release(self, tags: list[str]) -> None:
        if tags:
            await self.until_idle()
            await self.call("release_memory_occupation", self.requests.ReleaseMemoryOccupationReqInput(tags=tags))
            self._released.update(tags)
            self._weights_lost |= WEIGHTS_TAG in tags and not self.cpu_backup

    async def _resume(self, tags: list[str]) -> None:
        if tags:
            await self.call("resume_memory_occupation", self.requests.ResumeMemoryOccupationReqInput(tags=tags))
            self._released.difference_update(tags)

    async def sleep(self) -> None:
        """Release the KV cache, the weights and the CUDA graphs once the scheduler is idle."""
        await self._release([t for t in MEMORY_TAGS if t not in self._released])

    async def wake(self) -> None:
        """Resume what `sleep` released (the weights hold what they held, or what a weight update loaded since)."""
        await self._resume([t for t in MEMORY_TAGS if t in self._released])

    def shutdown(self) -> None:
        """Stop sglang's scheduler and detokenizer processes (sglang kills every descendant of this process and
        waits up to `SHUTDOWN_WAIT_S` for them: the processes that are not the engine's are named first), and drop
        sglang's exit hook."""
        self._processes.warn_about_others()
        try:
            self.engine.shutdown()
        finally:
            self._engine_thread.close()
            forget_atexit(self.engine.shutdown)

    # --- weights ----------------------------------------------------------------------------------------------
    @asynccontextmanager
    async def weight_update(self, version: int) -> AsyncIterator[LoadBucket]:
        """A weight-update session: resumes released weights, opens sglang's session, yields `load(bucket)` (the
        bucket goes to the GPU and on as an IPC handle), closes the session and flushes the cache; on a clean exit
        sets `version`. A bucket sglang refuses raises `SGLangError`; the version is then unchanged. Samples asked
        for meanwhile are sent once it is done (see the module docstring)."""
        self._no_update.clear()
        try:
            async with self._session() as load:
                yield load
            await self.until_idle()  # flushes the prefix cache: its entries came from the old weights
            self._version, self._weights_lost = version, False
        finally:
            self._no_update.set()

    @asynccontextmanager
    async def _session(self) -> AsyncIterator[LoadBucket]:
        """sglang's weight-update session (released weights resumed first), yielding `load(bucket)`."""
        from rlinf_pipe.engines.rollout.sglang_weights import tensor_payloads

        if WEIGHTS_TAG in self._released:
            await self._resume([WEIGHTS_TAG])
        await self._begin_session()

        async def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            payloads, keep_alive = tensor_payloads(bucket, self.tp_size)
            await self.load_payload(payloads)
            del keep_alive  # sglang is done with the bucket's memory

        try:
            yield load
        finally:
            await self.call("end_weight_update", self.requests.EndWeightUpdateReqInput())
            hand_back_cached_memory()  # the buckets' device copies (this process shares the engine's first GPU)

    async def _begin_session(self) -> None:
        """sglang's `begin_weight_update`; a session found open was left by an update of ours cancelled while sglang
        opened or closed it (the request goes on after its caller is gone): closed first, or every later update
        would be refused."""
        begin = self.requests.BeginWeightUpdateReqInput(selector="all")
        ok, message = (await self.call("begin_weight_update", begin, check=False))[:2]
        if not ok and SESSION_OPEN in str(message):
            log.warning("sglang engine: closing the weight-update session an interrupted update left open")
            await self.call("end_weight_update", self.requests.EndWeightUpdateReqInput())
            ok, message = (await self.call("begin_weight_update", begin, check=False))[:2]
        if not ok:
            raise SGLangError(f"sglang begin_weight_update failed: {message}")

    async def load_payload(self, payloads: list[bytes]) -> None:
        """Load one flattened bucket given as pickled IPC payloads, one per TP rank."""
        await self.call("update_weights_from_tensor", self.requests.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format="flattened_bucket", flush_cache=False))

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors (one bucket) and set `version`."""
        async with self.weight_update(version) as load:
            await load(list(named_tensors))

    async def verify_weights(self, published: WeightVersion) -> str:
        """Read a few tensors back by name and compare them with `published`'s fingerprint (see `sglang_weights`)."""
        from rlinf_pipe.engines.rollout.sglang_weights import verify_by_name

        return await verify_by_name(self, published)

    def weight_group_ranks(self, transport: str) -> int:
        """sglang's TP ranks each join a `broadcast` group: `tp_size` ranks; in any other transport's group only
        this process (its receiver passes the handles on to the ranks)."""
        return self.tp_size if transport == "broadcast" else 1

    async def open_weight_receiver(self, transport: str, layout: WeightLayout, rendezvous: Rendezvous | None,
                                   rank: int) -> WeightReceiver | None:
        """sglang's own receivers for `broadcast` (its ranks join the group) and `ipc` (handles go straight to its
        schedulers); None for the object store."""
        from rlinf_pipe.engines.rollout.sglang_weights import open_native_receiver

        return await open_native_receiver(self, transport, layout, rendezvous, rank)
