"""The log-prob stage shared by the inference workers and an actor that computes the log-probs: old and reference
log-probs of the step's scored groups, streamed from the scored channel into the actor replicas' train channels.

Within a model-parallel replica the input rank reads the channel and shares each group with the other ranks; the
output rank (last pipeline stage, tensor rank 0) packs the `TrainBatch` and routes it by its slot to the train
channel of the actor replica that trains it (`rlinf_pipe.data.routing`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import msgspec
import torch

from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.packing import pack_train_batch
from rlinf_pipe.data.routing import TrainRouting
from rlinf_pipe.data.structs import ScoredGroup
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.engines.policy import MegatronPolicy, ReplicaRanks
from rlinf_pipe.channels import Channel, StepEnd
from rlinf_pipe.utils.compute_thread import compute_thread
from rlinf_pipe.utils.tracing import Tracer
from rlinf_pipe.weights import LoadBucket
from rlinf_pipe.workers.replica_balance import TrainRoute
from rlinf_pipe.workers.replica_input import leave_shared, read_shared


def logprob_temperature(cfg: Config) -> float:
    """Log-probs use the sampling temperature (greedy sampling counts as temperature 1)."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def policy_options(cfg: Config, component: str) -> dict[str, Any]:
    """`MegatronPolicy` keywords of a policy of `component` (`actor`: its model and reference model; `inference`):
    those every policy of a run shares, and the component's own parallelism."""
    dtype = None if cfg.actor.params_dtype == "auto" else cfg.actor.params_dtype
    parallel = cfg.actor if component == "actor" else cfg.inference
    return {"temperature": logprob_temperature(cfg), "logprob_max_tokens": cfg.inference.max_tokens_per_batch,
            "seed": cfg.runner.seed, "params_dtype": dtype, "pack_sequences": cfg.actor.pack_sequences,
            "share_prompts": cfg.actor.share_prompts, "offload_on_cpu": cfg.actor.offload_on_cpu,
            "sequence_parallel": parallel.sequence_parallel}


def train_routing(cfg: Config, actor_dp: int) -> TrainRouting:
    return TrainRouting(cfg.data.rollout_batch_size, cfg.algorithm.n_minibatches, actor_dp)


def pad_id_of(tokenizer: Any) -> int:
    """The id batches are padded with: the tokenizer's pad token, else 0."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else 0)


def pad_token_id(model_path: str, given: int | None = None) -> int:
    """`given`, else the pad id of the folder's tokenizer (`pad_id_of`). The runner gives the workers the one its
    driver read (loading a tokenizer imports transformers, about 1.5 s of CPU at a worker's launch)."""
    if given is not None:
        return given
    from transformers import AutoTokenizer

    return pad_id_of(AutoTokenizer.from_pretrained(model_path))


class LogprobStage:
    """Turns scored groups into log-prob'd `TrainBatch`es (see the module docstring). `ref` computes the reference
    log-probs (None: none needed); `recompute_old` False keeps the sampling engine's log-probs as the old ones
    (`runner.max_staleness` 1: the samples are a version behind the actor)."""

    def __init__(
        self, policy: MegatronPolicy, ref: MegatronPolicy | None, route: TrainRoute, pad_token_id: int,
        recompute_old: bool, tracer: Tracer,
        on_devices: Callable[[str], AbstractAsyncContextManager[None]] = lambda turn: contextlib.nullcontext(),
    ):
        self.policy, self.ref = policy, ref
        self.on_devices = on_devices  # held around each group's log-probs (the device lock of a shared set), given
        # the group's turn: "<step>.<index>", the same on every rank of the replica (they read the same groups)
        self.route, self.pad_token_id, self.recompute_old, self.tracer = route, pad_token_id, recompute_old, tracer
        self.ranks = ReplicaRanks.current()
        self.version = 0  # the weight version `policy` holds

    @asynccontextmanager
    async def weight_update(self, version: int) -> AsyncIterator[LoadBucket]:
        """The policy's weight-update session for `WeightInbox`: buckets load into this rank's shard."""

        async def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            await compute_thread().run(self.policy.load_hf_weights, bucket)

        yield load
        self.version = version

    def _logprobs(self, step: int, group: ScoredGroup) -> TrainBatch | None:
        batch = pack_train_batch([group], self.pad_token_id)  # old log-probs: the sampling engine's
        version = self.version if self.recompute_old else batch.version
        with self.tracer.span("logprob", step=step, version=version, sequences=batch.num_sequences,
                              tokens=int(batch.attention_mask.sum())):
            old = self.policy.compute_logprobs(batch, self.policy.temperature) if self.recompute_old else None
            ref = self.ref.compute_logprobs(batch, self.ref.temperature) if self.ref is not None else None
        if not self.ranks.is_output:
            return None
        mask = batch.response_mask
        return msgspec.structs.replace(
            batch,
            old_logprobs=batch.old_logprobs if old is None else old.masked_fill(~mask, 0.0),
            ref_logprobs=None if ref is None else ref.masked_fill(~mask, 0.0),
            version=version,
        )

    async def run(self, step: int, src: Channel[ScoredGroup], dst: Sequence[Channel[TrainBatch]]) -> int:
        """Take the step's scored groups from `src` until its end and put their `TrainBatch`es into the actor
        replicas' train channels `dst` (the output rank ends the step on every one of them); returns the batches
        this rank put."""
        count = 0
        for index in itertools.count():
            item = await read_shared(self.ranks, src.aget)
            if isinstance(item, StepEnd):
                break
            async with self.on_devices(f"{step}.{index}"):
                batch = await compute_thread().run(self._logprobs, step, item)
            if batch is not None:
                try:
                    replica = await self.route.replica(step, batch)
                    await dst[replica].aput(batch, weight=batch.num_sequences)
                except Exception as exc:  # (the replica's other ranks already wait in the next read)
                    await leave_shared(self.ranks, src.aget, f"its output rank failed to put: {exc}")
                    raise
                count += 1
        if self.ranks.is_output:
            for channel in dst:
                channel.end_step()
        return count
