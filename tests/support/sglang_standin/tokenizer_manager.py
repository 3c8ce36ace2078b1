"""The stand-in's `TokenizerManager`: the coroutines an adapter awaits, with the names and parameters of sglang
0.5.23's (compared with the contract by tests/unit/test_sglang_contract.py).

Modelled because it bites: importing the module switches the process's asyncio policy (`host.py`); the manager
binds to the first event loop that calls it (its locks and its receive loop live there; a call from another loop
fails); a generate request holds the model-update lock as a reader from before it is sent until its generator is
resumed past its result or closed (a generator left suspended at its `yield`, as `Engine.async_generate` leaves
it, holds it until the garbage collector finalises it: a reference kept to it blocks every weight update for good),
and weight-update calls take it as a writer; a request's state (`ReqState`, with the real fields' names) exists
before it takes the lock and before it reaches the scheduler, which takes a turn of the loop (tokenising,
preparing the send; `dispatch_gate` lets a test hold requests there), so one held back behind a weight update, or
not yet sent, is known but not dispatched; `abort_request` is synchronous, looks the rid up exactly (an unknown rid
does nothing), sends one abort per request (a second does nothing) and the scheduler then aborts every request it
holds whose rid starts with it (one it does not hold yet is never aborted: the abort is lost); it sends on the manager's zmq socket, which only the thread of its loop may use (from another
thread: RuntimeError); a control call's answer goes to whichever call of its kind waits now (sglang's
`FanOutCommunicator`): a deferred `flush_cache` whose caller was cancelled answers the next caller, or nobody;
`skip_tokenizer_init` leaves `tokenizer` None and refuses text prompts; results carry no text.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from . import io_struct
from .contract import CONTRACT
from .host import switch_policy
from .scheduler import SchedulerDied, StandinScheduler

switch_policy("managers/tokenizer_manager.py")

SAMPLING_DEFAULTS = {"max_new_tokens": 128, "stop_token_ids": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                     "n": 1, "ignore_eos": False, "sampling_seed": None, "min_p": 0.0}


@dataclass
class ReqState:
    """The fields of sglang's `ReqState` the stand-in models (their names are the real ones: checked below)."""

    finished: bool = False
    dispatched: bool = False  # the request reached the scheduler
    abort_sent: bool = False


assert {"finished", "dispatched", "abort_sent"} <= set(CONTRACT["req_state_fields"])


class _ReadWriteLock:
    """sglang's `RWLock`: readers share it, a writer waits for them and holds new readers back."""

    def __init__(self) -> None:
        self.readers = 0
        self.writing = False
        self.writers_waiting = 0
        self.cond: asyncio.Condition | None = None  # bound to the manager's loop on first use

    def _cond(self) -> asyncio.Condition:
        if self.cond is None:
            self.cond = asyncio.Condition()
        return self.cond

    async def acquire_read(self) -> None:
        async with self._cond():
            await self._cond().wait_for(lambda: not self.writing and not self.writers_waiting)
            self.readers += 1

    async def release_read(self) -> None:
        async with self._cond():
            self.readers -= 1
            self._cond().notify_all()

    async def acquire_write(self) -> None:
        async with self._cond():
            self.writers_waiting += 1
            await self._cond().wait_for(lambda: not self.writing and not self.readers)
            self.writers_waiting -= 1
            self.writing = True

    async def release_write(self) -> None:
        async with self._cond():
            self.writing = False
            self._cond().notify_all()


class StandinTokenizerManager:
    """See the module docstring. `scheduler` is the engine's `StandinScheduler`."""

    def __init__(self, scheduler: StandinScheduler, server_args: dict[str, Any]):
        self.scheduler = scheduler
        self.server_args = server_args
        skip = bool(server_args.get("skip_tokenizer_init"))
        self.tokenizer = None if skip else AutoTokenizer.from_pretrained(server_args["model_path"])
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None  # the thread running `event_loop`
        self.rid_to_state: dict[str, dict[str, Any]] = {}
        self.model_update_lock = _ReadWriteLock()
        self.is_pause = False
        self.flush_lock: asyncio.Lock | None = None  # one flush_cache call at a time (bound on first use)
        self.flush_waiter: asyncio.Future | None = None  # the flush_cache call an answer goes to
        self.dispatch_gate: asyncio.Event | None = None  # a test's hold on requests before they are sent
        self.calls: list[tuple[str, Any]] = []  # every call, for the tests

    def auto_create_handle_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self.event_loop is None:
            self.event_loop, self.loop_thread = loop, threading.get_ident()
            self.scheduler.start(loop)
        elif loop is not self.event_loop:
            raise RuntimeError(f"{self.model_update_lock!r} is bound to a different event loop")
        self.scheduler.check_alive()

    async def _writing(self, call: Any) -> Any:
        """A weight-update call under the model-update lock (straight through while generation is paused), handled
        by the scheduler at the start of its next iteration: the lock is held while the manager awaits the answer."""
        if self.is_pause:
            return await self.scheduler.control(call)
        await self.model_update_lock.acquire_write()
        try:
            return await self.scheduler.control(call)
        finally:
            await self.model_update_lock.release_write()

    # --- generation -------------------------------------------------------------------------------------------
    async def generate_request(self, obj, request=None) -> AsyncIterator[dict[str, Any]]:
        self.auto_create_handle_loop()
        self.calls.append(("generate_request", obj))
        if obj.input_ids is None:
            if self.tokenizer is None:
                raise ValueError("The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
                                 "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False.")
            raise NotImplementedError("the stand-in takes input_ids only")
        if obj.input_ids and isinstance(obj.input_ids[0], list):
            raise NotImplementedError("the stand-in takes one prompt per request")
        unknown = set(obj.sampling_params or {}) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise NotImplementedError(f"the stand-in does not model sampling keys {sorted(unknown)}")
        params = {**SAMPLING_DEFAULTS, **(obj.sampling_params or {})}
        _check_sampling(params)
        if params["n"] != 1:
            raise NotImplementedError("the stand-in models n == 1 (sglang gives each of n samples a fresh rid)")
        rid = obj.rid if obj.rid is not None else uuid.uuid4().hex
        if rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID detected: {rid}")
        if self.is_pause:
            raise NotImplementedError("the stand-in does not hold requests back while generation is paused")
        state = self.rid_to_state[rid] = ReqState()
        try:
            await self.model_update_lock.acquire_read()
        except BaseException:
            self.rid_to_state.pop(rid, None)
            raise
        try:  # (the reader lock is held until the generator goes past its `yield` or is closed)
            try:
                await self._prepare_dispatch()
                done = self.scheduler.submit(rid, list(obj.input_ids), params)
                state.dispatched = True
                req = await done
                state.finished = True
            except BaseException:
                if state.dispatched and not state.finished:  # (sglang aborts what it sent, for the cleanup)
                    self.scheduler.abort(rid, False)
                raise
            finally:
                self.rid_to_state.pop(rid, None)
            yield self._result(obj, rid, req)
        finally:
            await self.model_update_lock.release_read()

    async def _prepare_dispatch(self) -> None:
        """sglang tokenises the request and prepares its send (awaits: the loop runs other work meanwhile) before it
        reaches the scheduler; a closed `dispatch_gate` holds requests here."""
        await asyncio.sleep(0)
        if self.dispatch_gate is not None:
            await self.dispatch_gate.wait()

    @staticmethod
    def _result(obj: Any, rid: str, req: Any) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": req.finish, "prompt_tokens": len(req.prompt), "weight_version": "default",
            "completion_tokens": len(req.tokens), "cached_tokens": 0,
        }
        if obj.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(req.logprobs, req.tokens, strict=True)]
            meta["output_token_logprobs_length"] = len(req.tokens)
        return {"output_ids": list(req.tokens), "meta_info": meta}

    def abort_request(self, rid="", abort_all=False):
        self.calls.append(("abort_request", {"rid": rid, "abort_all": abort_all}))
        if self.loop_thread is not None and threading.get_ident() != self.loop_thread:
            raise RuntimeError("abort_request called from a thread other than the tokenizer manager's loop: sglang "
                               "sends it on a zmq.asyncio socket, which is not thread-safe")
        if not abort_all and not rid:
            return
        state = None if abort_all else self.rid_to_state.get(rid)
        if not abort_all:
            if state is None:
                return  # an unknown rid: nothing is sent
            if state.abort_sent:
                return
            state.abort_sent = True
        self.scheduler.abort(rid, abort_all)

    async def pause_generation(self, obj):
        self.auto_create_handle_loop()
        self.is_pause = True
        self.abort_request(abort_all=True)

    async def continue_generation(self, obj):
        self.auto_create_handle_loop()
        self.is_pause = False

    async def flush_cache(self, timeout_s=None):
        self.auto_create_handle_loop()
        self.calls.append(("flush_cache", {"timeout_s": timeout_s}))
        if self.flush_lock is None:
            self.flush_lock = asyncio.Lock()
        async with self.flush_lock:  # (a cancelled caller leaves its waiter behind: the next call replaces it)
            self.flush_waiter = waiter = asyncio.get_running_loop().create_future()
            await self.scheduler.control(lambda: self.scheduler.flush(timeout_s, self._flush_answer))
            return await waiter

    def _flush_answer(self, flushed: bool, message: str) -> None:
        """An answer from the scheduler, to whichever flush_cache call waits now (dropped when none does)."""
        waiter = self.flush_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(io_struct.FlushCacheReqOutput(success=flushed, message=message))

    # --- weights ----------------------------------------------------------------------------------------------
    async def init_weights_update_group(self, obj, request=None):
        self.auto_create_handle_loop()
        self.calls.append(("init_weights_update_group", obj))
        return await asyncio.to_thread(self.scheduler.join_group, obj.master_address, obj.master_port,
                                       obj.rank_offset, obj.world_size, obj.group_name, obj.backend)

    async def destroy_weights_update_group(self, obj, request=None):
        self.auto_create_handle_loop()
        if self.scheduler.groups.pop(obj.group_name, None) is None:
            return False, "The group to be destroyed does not exist."
        return True, "Succeeded to destroy custom process group."

    async def begin_weight_update(self, obj, request=None):
        self.auto_create_handle_loop()
        self.calls.append(("begin_weight_update", obj))
        return await self._writing(lambda: self.scheduler.begin_weight_update(obj.selector))

    async def end_weight_update(self, obj, request=None):
        self.auto_create_handle_loop()
        self.calls.append(("end_weight_update", obj))
        return await self._writing(self.scheduler.end_weight_update)

    async def update_weights_from_tensor(self, obj, request=None):
        self.auto_create_handle_loop()
        self.calls.append(("update_weights_from_tensor", obj))
        payloads = obj.serialized_named_tensors
        if obj.load_format == "flattened_bucket" and len({id(p) for p in payloads}) < len(payloads):
            raise ValueError("every TP rank needs a payload of its own (sglang's deserialize_own_rank: ranks "
                             "sharing one break the sender's CUDA IPC use counts)")
        return await self._writing(lambda: self.scheduler.update_from_tensor(
            [bytes(p) for p in obj.serialized_named_tensors], obj.load_format))

    async def update_weights_from_distributed(self, obj, request=None):
        self.auto_create_handle_loop()
        self.calls.append(("update_weights_from_distributed", obj))
        await self.model_update_lock.acquire_write()
        try:  # the broadcast blocks the scheduler (another process in sglang): off this loop
            return await asyncio.to_thread(self.scheduler.update_from_distributed, obj.names, obj.dtypes, obj.shapes,
                                           obj.group_name, obj.load_format)
        finally:
            await self.model_update_lock.release_write()

    async def get_weights_by_name(self, obj, request=None):
        self.auto_create_handle_loop()
        return self.scheduler.weights_by_name(obj.name, obj.truncate_size)

    # --- memory -----------------------------------------------------------------------------------------------
    async def release_memory_occupation(self, obj, request=None):
        self.auto_create_handle_loop()
        self.calls.append(("release_memory_occupation", obj))
        await self.scheduler.control(lambda: self.scheduler.release(obj.tags))

    async def resume_memory_occupation(self, obj, request=None):
        self.auto_create_handle_loop()
        self.calls.append(("resume_memory_occupation", obj))
        await self.scheduler.control(lambda: self.scheduler.resume(obj.tags))

    def calls_of(self, name: str) -> list[Any]:
        return [obj for n, obj in self.calls if n == name]


def _check_sampling(sp: dict[str, Any]) -> None:
    """sglang's `SamplingParams.verify` for the fields the stand-in models."""
    if sp["top_k"] != -1 and sp["top_k"] < 1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {sp['top_k']}.")
    if not 0.0 < sp["top_p"] <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {sp['top_p']}.")
    if sp["temperature"] < 0:
        raise ValueError(f"temperature must be a non-negative finite number, got {sp['temperature']}.")
    seed = sp["sampling_seed"]
    if seed is not None and not (isinstance(seed, int) and -(2**63) <= seed <= 2**63 - 1):
        raise ValueError(f"sampling_seed must be an integer in [-2**63, 2**63 - 1], got {seed!r}.")


__all__ = ["SchedulerDied", "StandinTokenizerManager"]
