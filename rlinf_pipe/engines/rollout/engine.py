"""The rollout engine interface every generation backend implements, and its request / result types.

An engine turns `GenerateRequest`s into `GenerateResult`s, streaming each result as soon as all of its samples
are done (not in input order). Semantics shared by all backends (see docs/rollout.md):

* log-probs: `logprobs[t]` is `log_softmax(logits_t / temperature)[token_t]`, taken BEFORE top-k / top-p
  truncation (temperature 0 means greedy and uses temperature 1 for the log-prob);
* a stop token (EOS or a request stop id) that ends a sample IS included in `response_ids`, with its log-prob;
* each sample draws its random numbers from its own generator seeded by `sample_seed(request seed, index)`,
  so its tokens do not depend on what it was batched with;
* `version` on a sample is the weight version when the sample started (the oldest, if a sync happened mid-way).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import msgspec

from rlinf_pipe.data.structs import RolloutSample
from rlinf_pipe.weights import LoadBucket, WeightLayout, WeightReceiver, WeightVersion
from rlinf_pipe.weights.process_group import Rendezvous

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request.

    `temperature` 0 is greedy. `top_k` <= 0 and `top_p` 1.0 disable those filters. `stop_token_ids` end a
    sample in addition to the model's EOS ids (unless `ignore_eos`). `n` samples are drawn per request; `seed`
    None lets the engine pick one (from its own seeded source).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt (already tokenized) and how to sample it."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_ids is empty")


class SampleOutput(msgspec.Struct, kw_only=True):
    """One generated sample: tokens without the prompt, their log-probs, why it ended, and the weight version."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: int


class GenerateResult(msgspec.Struct, kw_only=True):
    """All `n` samples of one request, in sample-index order."""

    request_id: str
    prompt_ids: list[int]
    samples: list[SampleOutput]


def sample_seed(request_seed: int, sample_index: int) -> int:
    """The generator seed of sample `sample_index` of a request seeded `request_seed` (a stable 63-bit hash)."""
    digest = hashlib.blake2b(f"{request_seed}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def request_seed(run_seed: int, prompt_id: str, epoch: int) -> int:
    """The seed of a prompt's request: a stable hash of the run seed, the prompt id and the epoch that drew it, so
    a prompt's samples do not depend on which worker or batch drew it."""
    digest = hashlib.blake2b(f"{run_seed}/{prompt_id}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def to_rollout_samples(result: GenerateResult, tokenizer: Any | None = None) -> list[RolloutSample]:
    """The result's samples as `RolloutSample`s; `text` is decoded (special tokens skipped) if a tokenizer is given."""
    out = []
    for s in result.samples:
        text = tokenizer.decode(s.response_ids, skip_special_tokens=True) if tokenizer is not None else ""
        out.append(
            RolloutSample(
                response_ids=s.response_ids, logprobs=s.logprobs, finish_reason=s.finish_reason,
                version=s.version, text=text,
            )
        )
    return out


class EngineAsleepError(RuntimeError):
    """`generate` was called between `sleep()` and `wake()`."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What a generation backend provides. Everything that waits on the engine is async: engines such as SGLang's
    are driven from the worker's event loop and must never block it."""

    tokenizer: Any
    """The HF tokenizer of the model (responses are decoded with it for the reward)."""

    native_transports: tuple[str, ...]
    """The weight transports the engine receives with receivers of its own (`open_weight_receiver`)."""

    @property
    def version(self) -> int:
        """The weight version currently loaded (set by a weight update; the constructor's value before)."""
        ...

    def generate(self, requests: Sequence[GenerateRequest]) -> AsyncIterator[GenerateResult]:
        """Yield one result per request, each as soon as all its samples finish (completion order)."""
        ...

    def weight_update(self, version: int) -> AbstractAsyncContextManager[LoadBucket]:
        """A weight-update session: the context yields `await load(bucket)`, which loads HF-named tensors (any subset,
        one bucket per call; the tensors may be views that are reused once the call returns). `version` is set
        when the block exits without an exception; an exception leaves the version unchanged. Unknown names /
        wrong shapes raise. Works while asleep."""
        ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A whole session in one call: load `named_tensors` and set `version`."""
        ...

    def weight_group_ranks(self, transport: str) -> int:
        """How many ranks this engine takes in `transport`'s process group (SGLang's `broadcast`: one per
        tensor-parallel rank, which join it themselves)."""
        ...

    async def open_weight_receiver(self, transport: str, layout: WeightLayout, rendezvous: Rendezvous | None,
                                   rank: int) -> WeightReceiver | None:
        """A receiver of the engine's own for `transport` (joining its group at `rank`), or None: the worker then
        opens the transport's standard receiver and loads through `weight_update`."""
        ...

    async def verify_weights(self, published: WeightVersion) -> str:
        """Check the loaded weights against `published` by other means than the receiver's CRC32 (SGLang: by name);
        how ("name"), or "" if it cannot."""
        ...

    async def sleep(self) -> None:
        """Release device memory (what exactly is backend-specific, see docs/rollout.md)."""
        ...

    async def wake(self) -> None:
        """Reclaim what `sleep` released."""
        ...

    def abort(self) -> None:
        """End every pending and running request of in-flight `generate` calls with finish reason `abort`."""
        ...
