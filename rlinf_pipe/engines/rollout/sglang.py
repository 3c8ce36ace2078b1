"""`SGLangEngine`: a `RolloutEngine` over SGLang's offline engine (`sglang.Engine`, GPU only).

Written against sglang 0.5.23 (`sglang/srt/entrypoints/engine.py`); see docs/backends.md for the exact
Engine members used. sglang is imported only when an engine is built without an injected factory, so this
module imports on any machine; the unit tests drive it with a CPU stand-in of the Engine
(`tests/support/sglang_standin.py`).

Mapping onto our interface:

* every sample is its own sglang request (`async_generate(input_ids=..., sampling_params=...,
  return_logprob=True, rid=...)`) with `sampling_seed = sample_seed(request seed, k)`. sglang's own `n`
  would give all n copies one seed (so, with the seeded sampler, identical tokens), hence the fan-out.
  Seeded sampling needs `sampling_backend="pytorch"` (the flashinfer sampler rejects `sampling_seed`), which
  is the default this adapter passes;
* sample tasks run concurrently on the event loop and a request's result is yielded when its last sample
  finishes (`asyncio.as_completed`);
* `meta_info["output_token_logprobs"]` ((logprob, token_id, text) tuples) gives the log-probs; sglang computes
  them as log(softmax(logits / T)) before top-k / top-p (T = 1 for greedy), as our semantics require;
* `meta_info["finish_reason"]["type"]` (`stop` / `length` / `abort`) is the finish reason;
* `update_weights` sends bounded buckets through `update_weights_from_tensor` (cache flushed with the last
  one); `update_weights_from_distributed` is the NCCL-group path;
* `sleep` / `wake` are `release_memory_occupation` / `resume_memory_occupation` (needs
  `enable_memory_saver=True`, on by default here, with a CPU backup of the weights so `wake` restores them);
* `abort` calls `tokenizer_manager.abort_request(rid)` for each in-flight sample (the Engine has no abort
  method of its own in 0.5.23).

Caveat: the Engine's blocking methods (weights, memory, flush) drive its own event loop with
`run_until_complete`, so call `update_weights` / `sleep` / `wake` from a thread where no event loop is running
(e.g. `await asyncio.to_thread(engine.update_weights, ...)`), as the Engine requires.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from rlinf_pipe.engines.rollout.engine import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SampleOutput,
    sample_seed,
)
from rlinf_pipe.engines.rollout.torch_engine import EngineAsleepError

SGLANG_VERSION = "0.5.23"
"""The sglang release this adapter was written and contract-tested against."""

INSTALL_HINT = "pip install 'rlinf_pipe[sglang]'"

# memory tags of sglang's memory saver (sglang/srt/constants.py)
WEIGHTS_TAG = "weights"
ALL_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")

EngineFactory = Callable[..., Any]


class SGLangNotInstalledError(ImportError):
    """sglang is missing (it installs and runs only on a machine with a CUDA GPU)."""


def import_sglang_engine() -> EngineFactory:
    """`sglang.Engine`, or `SGLangNotInstalledError` saying how to install it."""
    try:
        import sglang
    except ImportError as e:
        raise SGLangNotInstalledError(
            f"rollout.backend 'sglang' needs the sglang package (>= {SGLANG_VERSION}), which needs a CUDA GPU: "
            f"{INSTALL_HINT}. On a CPU-only machine use rollout.backend 'torch'."
        ) from e
    return sglang.Engine


def _finish_reason(meta_info: dict[str, Any]) -> FinishReason:
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length", "abort"):
        return kind
    raise RuntimeError(f"sglang returned an unexpected finish_reason {reason!r} for request {meta_info.get('id')!r}")


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most `bucket_bytes` (a larger single tensor is a bucket of its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights: expected (str, torch.Tensor) pairs, got ({type(name)}, {type(tensor)})")
        n = _tensor_bytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


class SGLangEngine:
    """Generates with an `sglang.Engine` serving the HF model folder `model_path`.

    `version` is the weight version of the folder's weights; `seed` seeds the source of request seeds for
    requests that give none. `bucket_bytes` bounds one `update_weights_from_tensor` call. `max_batch_size` caps
    the samples decoded at once (sglang's `max_running_requests`; sglang's own default if None). Extra keyword
    arguments go to the Engine unchanged (they are sglang `ServerArgs` fields). `engine_factory` replaces
    `sglang.Engine` (tests pass a stand-in); it is called with the server arguments as keywords.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        tp_size: int = 1,
        mem_fraction_static: float = 0.8,
        dtype: str = "auto",
        version: int = 0,
        seed: int = 0,
        bucket_bytes: int = 512 * 2**20,
        max_batch_size: int | None = None,
        engine_factory: EngineFactory | None = None,
        **server_args: Any,
    ):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        factory = engine_factory if engine_factory is not None else import_sglang_engine()
        args: dict[str, Any] = {
            "model_path": str(model_path),
            "tp_size": tp_size,
            "mem_fraction_static": mem_fraction_static,
            "dtype": dtype,
            "random_seed": seed,
            "skip_tokenizer_init": True,  # token ids in, token ids out
            "enable_memory_saver": True,  # release/resume_memory_occupation
            "enable_weights_cpu_backup": True,  # wake() restores the weights sleep() released
            "sampling_backend": "pytorch",  # the only sampler that honours per-request sampling_seed
        }
        if max_batch_size is not None:
            if max_batch_size < 1:
                raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
            args["max_running_requests"] = max_batch_size
        args.update(server_args)
        self.server_args = args
        self.engine = factory(**args)
        self.bucket_bytes = bucket_bytes
        self._version = version
        self._seeds = random.Random(seed)
        self._abort_epoch = 0
        self._inflight: set[str] = set()
        self._released: set[str] = set()
        self._rid_counter = itertools.count()

    @property
    def version(self) -> int:
        """The weight version currently loaded."""
        return self._version

    # --- generation -------------------------------------------------------------------------------------

    def _sampling_params(self, request: GenerateRequest, seed: int) -> dict[str, Any]:
        sp = request.sampling
        return {
            "temperature": sp.temperature,  # sglang turns 0 into greedy (top_k 1, log-probs at T = 1)
            "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            "max_new_tokens": sp.max_new_tokens,
            "stop_token_ids": list(sp.stop_token_ids),
            "ignore_eos": sp.ignore_eos,
            "n": 1,
            "sampling_seed": seed,
        }

    async def generate(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[GenerateResult]:
        """Yield one `GenerateResult` per request, in the order requests finish."""
        if self._released:
            raise EngineAsleepError("SGLangEngine is asleep: call wake() before generating")
        requests = list(requests)
        epoch = self._abort_epoch
        version = self._version
        seeds = [r.sampling.seed if r.sampling.seed is not None else self._seeds.getrandbits(63) for r in requests]
        done: list[list[SampleOutput | None]] = [[None] * r.sampling.n for r in requests]
        left = [r.sampling.n for r in requests]
        mine: set[str] = set()  # this call's rids still running in sglang

        async def run_sample(i: int, k: int) -> tuple[int, int, SampleOutput]:
            request = requests[i]
            if self._abort_epoch != epoch:
                return i, k, SampleOutput(response_ids=[], logprobs=[], finish_reason="abort", version=version)
            rid = f"{request.request_id}#{k}#{next(self._rid_counter)}"
            self._inflight.add(rid)
            mine.add(rid)
            try:
                out = await self.engine.async_generate(
                    input_ids=list(request.prompt_ids),
                    sampling_params=self._sampling_params(request, sample_seed(seeds[i], k)),
                    return_logprob=True,
                    stream=False,
                    rid=rid,
                )
            finally:
                self._inflight.discard(rid)
                mine.discard(rid)
            return i, k, self._to_sample(out, version)

        tasks = [asyncio.ensure_future(run_sample(i, k)) for i, r in enumerate(requests) for k in range(r.sampling.n)]
        try:
            for next_done in asyncio.as_completed(tasks):
                i, k, sample = await next_done
                done[i][k] = sample
                left[i] -= 1
                if not left[i]:
                    yield GenerateResult(
                        request_id=requests[i].request_id, prompt_ids=list(requests[i].prompt_ids),
                        samples=[s for s in done[i] if s is not None],
                    )
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:  # the consumer stopped early (or a sample failed): do not leave work behind
                t.cancel()
            for rid in list(mine):
                self.engine.tokenizer_manager.abort_request(rid=rid)
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    @staticmethod
    def _to_sample(out: dict[str, Any], version: int) -> SampleOutput:
        meta = out["meta_info"]
        reason = _finish_reason(meta)
        output_ids = [int(t) for t in out.get("output_ids", [])]
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise RuntimeError(f"sglang returned no output_token_logprobs for request {meta.get('id')!r}")
        logprobs = [float(lp) for lp, _, _ in triples]
        lp_ids = [int(t) for _, t, _ in triples]
        if lp_ids != output_ids:
            # keep the stop token even if a version trims it from output_ids: the log-prob list has every token
            if not (reason == "stop" and output_ids == lp_ids[:-1]):
                raise RuntimeError(
                    f"sglang request {meta.get('id')!r}: output_ids ({len(output_ids)}) and the token ids of "
                    f"output_token_logprobs ({len(lp_ids)}) disagree"
                )
        return SampleOutput(response_ids=lp_ids, logprobs=logprobs, finish_reason=reason, version=version)

    def abort(self) -> None:
        """End all requests of the `generate` calls now in flight with `abort` (tokens so far are kept)."""
        self._abort_epoch += 1
        for rid in list(self._inflight):
            self.engine.tokenizer_manager.abort_request(rid=rid)

    # --- weights ----------------------------------------------------------------------------------------

    def _ensure_weights_resident(self) -> None:
        if WEIGHTS_TAG in self._released:  # asleep: bring back only the weights to write into them
            self.engine.resume_memory_occupation(tags=[WEIGHTS_TAG])
            self._released.discard(WEIGHTS_TAG)

    @contextmanager
    def weight_update(self, version: int) -> Iterator[Callable[[list[tuple[str, torch.Tensor]]], None]]:
        """A weight-update session: `load(bucket)` sends one bucket through `update_weights_from_tensor`; on a clean
        exit the prefix cache is flushed and `version` set. If sglang rejects a bucket (unknown name, wrong shape)
        `ValueError` carries its message; earlier buckets are already loaded and the version is unchanged. Works
        while asleep (the weights are resumed first; `wake` resumes the rest)."""
        self._ensure_weights_resident()

        def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            result = self.engine.update_weights_from_tensor(list(bucket), load_format=None, flush_cache=False)
            self._check(result, "update_weights_from_tensor", [n for n, _ in bucket])

        yield load
        self.engine.flush_cache()
        self._version = version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send HF-named tensors in buckets of at most `bucket_bytes` and set `version`."""
        with self.weight_update(version) as load:
            for bucket in _buckets(named_tensors, self.bucket_bytes):
                load(bucket)

    def init_weight_sync_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Join the process group that `update_weights_from_distributed` receives broadcasts on."""
        result = self.engine.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend=backend
        )
        self._check(result, "init_weights_update_group", [group_name])

    def update_weights_from_distributed(
        self,
        specs: Sequence[tuple[str, torch.dtype | str, Sequence[int]]],
        version: int,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
    ) -> None:
        """Receive `(name, dtype, shape)` tensors broadcast by the trainer over the group and set `version`.

        Blocks until sglang has received them all; the trainer must broadcast the same tensors in the same
        order meanwhile (from another process or thread). Call once per bucket, `flush_cache` on the last.
        """
        self._ensure_weights_resident()
        names = [name for name, _, _ in specs]
        dtypes = [str(d).removeprefix("torch.") for _, d, _ in specs]
        shapes = [[int(s) for s in shape] for _, _, shape in specs]
        result = self.engine.update_weights_from_distributed(
            names, dtypes, shapes, group_name=group_name, flush_cache=flush_cache
        )
        self._check(result, "update_weights_from_distributed", names)
        self._version = version

    @staticmethod
    def _check(result: Any, what: str, names: list[str]) -> None:
        """sglang's weight calls return (success, message)."""
        if isinstance(result, tuple) and len(result) >= 2 and not result[0]:
            shown = names if len(names) <= 4 else [*names[:4], f"... ({len(names)} in all)"]
            raise ValueError(f"update_weights: sglang {what} failed for {shown}: {result[1]}")

    # --- memory -----------------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Release the KV cache, weights and CUDA graphs (`release_memory_occupation`); `generate` then raises."""
        to_release = [t for t in ALL_MEMORY_TAGS if t not in self._released]
        if to_release:
            self.engine.release_memory_occupation(tags=to_release)
            self._released.update(to_release)

    def wake(self) -> None:
        """Resume what `sleep` released (`resume_memory_occupation`)."""
        to_resume = [t for t in ALL_MEMORY_TAGS if t in self._released]
        if to_resume:
            self.engine.resume_memory_occupation(tags=to_resume)
            self._released.clear()

    def shutdown(self) -> None:
        """Stop sglang's scheduler and detokenizer processes."""
        self.engine.shutdown()
