"""`TorchEngine`: a `RolloutEngine` over a causal LM in a local folder, on any torch device.

Samples (n per request) are queued in request order and run in static batches of up to `max_batch_size`
rows (`DecodeBatch`): one prefill, then one KV-cached token per step, rows leaving as they finish. With
`first_batch_size` the first batch of a `generate` call is that small, so that its requests finish early and the
stages downstream (reward, the actor's first micro-batch) start while the rest generate. The forward
passes run in the process's compute thread under a lock, so the event loop stays free: one thread hop for
the prefill, then one per finishing row (the decode steps in between run in the same hop, an abort checked before
each), and a request's result is yielded as soon as its last sample finishes. There is no continuous batching: a
batch's freed slots are refilled only when the whole batch is done.
"""

from __future__ import annotations

import difflib
import gc
import os
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import AutoTokenizer

from rlinf_pipe.engines.rollout.batch import DecodeBatch, SampleState
from rlinf_pipe.engines.rollout.decode_timing import DecodeTiming
from rlinf_pipe.engines.rollout.lean_model import load_lean_model
from rlinf_pipe.engines.rollout.llama_forward import LlamaForward
from rlinf_pipe.engines.rollout.engine import (
    EngineAsleepError,
    GenerateRequest,
    GenerateResult,
    SampleOutput,
    sample_seed,
)
from rlinf_pipe.models.hf_config import read_json
from rlinf_pipe.utils.compute_thread import compute_thread
from rlinf_pipe.utils.device_memory import hand_back_cached_memory
from rlinf_pipe.weights import LoadBucket, WeightLayout, WeightReceiver, WeightVersion
from rlinf_pipe.weights.process_group import Rendezvous

T = TypeVar("T")


def _as_id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def load_causal_lm(model_path: str | os.PathLike[str], dtype: torch.dtype) -> Any:
    """The folder's model for generation: a Llama-family model as a `LeanCausalLM` (transformers' weights and
    names without importing its model classes, seconds of CPU at launch), any other through transformers."""
    model = load_lean_model(model_path, dtype)
    if model is not None:
        return model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()


def generation_eos_ids(model_path: str | os.PathLike[str]) -> set[int]:
    """The end-of-sequence ids in the folder's `generation_config.json` (none without one)."""
    file = Path(model_path) / "generation_config.json"
    return _as_id_set(read_json(file).get("eos_token_id")) if file.is_file() else set()


class TorchEngine:
    """Generates with the causal LM in the local folder `model_path` (`load_causal_lm`).

    `dtype` is a torch dtype or its name ("float32", "bfloat16", ...). `version` is the weight version of the
    folder's weights. `seed` seeds the source of request seeds for requests that give none. The forward passes
    run in the process's compute thread (`rlinf_pipe.utils.compute_thread`), so the event loop stays free and
    torch's intra-op threads form one OpenMP team; `cpu_threads` sets its thread count (default: what the worker
    set, else 1). `max_batch_size` rows decode at once; `first_batch_size` (default: the same) rows make the first
    batch of each `generate` call (see the module docstring).
    """

    native_transports: tuple[str, ...] = ()

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_batch_size: int = 64,
        first_batch_size: int | None = None,
        version: int = 0,
        seed: int = 0,
        cpu_threads: int | None = None,
    ):
        if max_batch_size < 1 or (first_batch_size is not None and first_batch_size < 1):
            raise ValueError(f"max_batch_size and first_batch_size must be >= 1, got {max_batch_size}, "
                             f"{first_batch_size}")
        self.device = torch.device(device)
        self.compute = compute_thread(cpu_threads)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = load_causal_lm(model_path, dtype).to(self.device)
        self.lean = LlamaForward.build(self.model)  # None: transformers' forward (not a Llama-family model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.max_batch_size = max_batch_size
        self.first_batch_size = min(first_batch_size or max_batch_size, max_batch_size)
        self.eos_ids = frozenset(self._find_eos_ids(str(model_path)))
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids, default=0)
        self._version = version
        self._lock = threading.Lock()
        self._abort_epoch = 0
        self._asleep = False
        self._seeds = random.Random(seed)
        self.timing = DecodeTiming()  # decode steps and prefills, taken by the worker into its generate span

    def _find_eos_ids(self, model_path: str) -> set[int]:
        return (_as_id_set(self.tokenizer.eos_token_id) | _as_id_set(self.model.config.eos_token_id)
                | generation_eos_ids(model_path))

    @property
    def cpu_threads(self) -> int:
        """Torch intra-op threads of the forward passes (CPU)."""
        return self.compute.threads

    @property
    def version(self) -> int:
        """The weight version currently loaded."""
        return self._version

    # --- generation -------------------------------------------------------------------------------------

    async def generate(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[GenerateResult]:
        """Yield one `GenerateResult` per request, in the order requests finish."""
        requests = list(requests)
        epoch = self._abort_epoch
        seeds = [r.sampling.seed if r.sampling.seed is not None else self._seeds.getrandbits(63) for r in requests]
        done: list[list[SampleOutput | None]] = [[None] * r.sampling.n for r in requests]
        left = [r.sampling.n for r in requests]
        queue = deque((i, k) for i, r in enumerate(requests) for k in range(r.sampling.n))

        def aborted() -> bool:
            return self._abort_epoch != epoch

        def finish(row: SampleState) -> GenerateResult | None:
            i = row.request_index
            assert row.finish_reason is not None
            done[i][row.sample_index] = SampleOutput(
                response_ids=row.tokens, logprobs=row.logprobs, finish_reason=row.finish_reason, version=row.version
            )
            left[i] -= 1
            if left[i]:
                return None
            return GenerateResult(
                request_id=requests[i].request_id, prompt_ids=list(requests[i].prompt_ids),
                samples=[s for s in done[i] if s is not None],
            )

        size = self.first_batch_size
        while queue:
            if aborted():
                rows = [self._new_row(requests[i], i, k, seeds[i]) for i, k in queue]
                queue.clear()
                for row in rows:
                    row.finish_reason = "abort"
                    if (result := finish(row)) is not None:
                        yield result
                break
            chunk = [queue.popleft() for _ in range(min(size, len(queue)))]
            size = self.max_batch_size
            batch = DecodeBatch(
                self.model, [self._new_row(requests[i], i, k, seeds[i]) for i, k in chunk], self.pad_id, self.device,
                self.lean,
            )
            prompts = sum(map(len, {tuple(r.prompt_ids) for r in batch.rows}))  # (a prompt is prefilled once)
            self.timing.add_prefill(prompts, await self._run(self._timed(batch.prefill)))
            while batch.active:
                finished = batch.abort_all() if aborted() else await self._run(self._decode_steps(batch, aborted))
                for row in finished:
                    if (result := finish(row)) is not None:
                        yield result

    @staticmethod
    def _timed(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started

        return run

    def _decode_steps(self, batch: DecodeBatch, aborted: Callable[[], bool]) -> Callable[[], list[SampleState]]:
        """`batch.step_until_a_row_finishes`, its steps and seconds recorded by the rows it started with."""
        def run() -> list[SampleState]:
            rows, steps, started = len(batch.rows), batch.steps, time.perf_counter()
            finished = batch.step_until_a_row_finishes(aborted)
            self.timing.add_steps(rows, batch.steps - steps, time.perf_counter() - started)
            return finished

        return run

    def _new_row(self, request: GenerateRequest, index: int, sample: int, seed: int) -> SampleState:
        sp = request.sampling
        generator = torch.Generator(device="cpu")
        generator.manual_seed(sample_seed(seed, sample))
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_ids))
        return SampleState(
            request_index=index, sample_index=sample, prompt_ids=list(request.prompt_ids), generator=generator,
            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, max_new_tokens=sp.max_new_tokens,
            stop_ids=frozenset(stop), version=self._version,
        )

    async def _run(self, fn: Callable[[], T]) -> T:
        """Run `fn` in a worker thread holding the model lock; refuse while asleep."""

        def locked() -> T:
            with self._lock:
                if self._asleep:
                    raise EngineAsleepError("TorchEngine is asleep: call wake() before generating")
                return fn()

        return await self.compute.run(locked)

    def abort(self) -> None:
        """End all requests of the `generate` calls now in flight with `abort` (tokens so far are kept)."""
        self._abort_epoch += 1

    # --- weights and memory -----------------------------------------------------------------------------

    @asynccontextmanager
    async def weight_update(self, version: int) -> AsyncIterator[LoadBucket]:
        """A weight-update session (see `RolloutEngine.weight_update`): `load(bucket)` copies HF-named tensors into
        the model (cast to its dtype/device); an unknown name or a shape mismatch raises `ValueError` naming it."""
        state = self.model.state_dict(keep_vars=True)

        @torch.no_grad()
        def copy(named_tensors: list[tuple[str, torch.Tensor]]) -> None:
            loaded: list[torch.Tensor] = []
            with self._lock:
                try:
                    for name, tensor in named_tensors:
                        target = state.get(name)
                        if target is None:
                            close = difflib.get_close_matches(name, state.keys(), n=3)
                            hint = f"; did you mean {close}?" if close else ""
                            raise ValueError(f"update_weights: unknown parameter name {name!r}{hint}")
                        if tuple(target.shape) != tuple(tensor.shape):
                            raise ValueError(
                                f"update_weights: shape mismatch for {name!r}: got {tuple(tensor.shape)}, "
                                f"model has {tuple(target.shape)}"
                            )
                        target.data.copy_(tensor)
                        loaded.append(target)
                finally:  # the lean forward's oneDNN copies of large weights follow what was loaded, even in part
                    if self.lean is not None and loaded:
                        self.lean.refresh(loaded)

        async def load(named_tensors: list[tuple[str, torch.Tensor]]) -> None:
            await self.compute.run(copy, named_tensors)

        yield load
        self._version = version

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named tensors (any subset of the state dict) and set `version`; tensors before a bad one are
        already loaded and the version is left unchanged."""
        async with self.weight_update(version) as load:
            await load(list(named_tensors))

    async def verify_weights(self, published: WeightVersion) -> str:
        """Nothing more to check: the standard receivers see the bytes and verify them by CRC32 ("")."""
        return ""

    def weight_group_ranks(self, transport: str) -> int:
        """One rank in a weight group: this process."""
        return 1

    async def open_weight_receiver(self, transport: str, layout: WeightLayout, rendezvous: Rendezvous | None,
                                   rank: int) -> WeightReceiver | None:
        """None: the standard receivers load through `weight_update`."""
        return None

    async def sleep(self) -> None:
        """Release device memory: off CPU, move the weights to CPU, collect garbage and empty the CUDA allocator
        cache; on CPU there is nothing to release (no KV cache outlives a batch), so only `generate` is refused
        until `wake`."""
        await self.compute.run(self._sleep)

    def _sleep(self) -> None:
        with self._lock:
            if self.device.type != "cpu":
                self.model.to("cpu")
                gc.collect()  # frees the device tensors the KV caches left behind (costly: only when it frees memory)
                if self.device.type == "cuda":
                    hand_back_cached_memory()
            self._asleep = True

    async def wake(self) -> None:
        """Undo `sleep`: move the weights back to the device (CUDA) and accept `generate` again."""
        await self.compute.run(self._wake)

    def _wake(self) -> None:
        with self._lock:
            if self.device.type != "cpu":
                self.model.to(self.device)
            self._asleep = False
