"""`InferenceWorker`: the `inference:` placement's Megatron log-prob worker (old and reference log-probs).

Each step it takes scored groups from its input channel as they arrive, computes the old log-probs with the
weights of the step's version and the reference log-probs with the initial weights (a second, forward-only
model), and puts the packed `TrainBatch` into its output channel. Within a model-parallel replica the first
rank reads the channel and broadcasts each item to the others; the replica's output rank (last pipeline stage,
tensor rank 0) writes. The actor (`ActorWorker`) inherits this stage for collocated mode.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import torch

from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.packing import pack_train_batch
from rlinf_pipe.data.structs import ScoredGroup, TrainBatch
from rlinf_pipe.runner.weight_sync import WeightManifest, check_version, fetch_buckets, flatten
from rlinf_pipe.scheduler.channel import StepEnd
from rlinf_pipe.scheduler.worker import Worker
from rlinf_pipe.utils.tracing import Tracer


def init_model_parallel(tp: int, pp: int, seed: int) -> None:
    """Megatron's parallel state over this group's torch.distributed world (TP fastest, then DP, then PP)."""
    from megatron.core import parallel_state as ps

    from rlinf_pipe.models.megatron_cpu import enable_cpu_compat

    enable_cpu_compat()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def logprob_temperature(cfg: Config) -> float:
    """Log-probs use the sampling temperature (greedy sampling counts as temperature 1)."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


class InferenceWorker(Worker):
    """Old / reference log-probs of scored groups, streamed channel to channel."""

    role = "inference"

    def setup(self, model_path: str, cfg: Config, role: str, locks: Any = None) -> None:
        from megatron.core import parallel_state as ps

        from rlinf_pipe.workers.actor.trainer import MegatronPolicy

        section = cfg.actor if role == "actor" else cfg.inference
        init_model_parallel(section.tensor_parallel_size, section.pipeline_parallel_size, cfg.runner.seed)
        self.cfg, self.locks = cfg, locks
        self.temperature = logprob_temperature(cfg)
        common = dict(
            temperature=self.temperature, logprob_max_tokens=cfg.inference.max_tokens_per_batch, seed=cfg.runner.seed,
        )
        self.policy = self._build_policy(model_path, common)
        self.ref = MegatronPolicy(model_path, train=False, **common) if self._needs_ref(cfg) else None
        self.version = 0
        self.mp_group = ps.get_model_parallel_group()
        self.mp_size = ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
        self.is_input_rank = ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_first_stage()
        self.is_output_rank = ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage()
        self.mp_src = torch.distributed.get_global_rank(self.mp_group, 0) if self.mp_size > 1 else self.rank
        info = self.info
        self.devices = info.global_gpus
        self.owner = f"{role}/{info.rank}"
        self.tracer = Tracer(self.owner, self.devices)
        self.pad_token_id = self._pad_id(model_path)

    def _build_policy(self, model_path: str, common: dict[str, Any]) -> Any:
        from rlinf_pipe.workers.actor.trainer import MegatronPolicy

        return MegatronPolicy(model_path, train=False, **common)

    def _needs_ref(self, cfg: Config) -> bool:
        return cfg.algorithm.kl_coef > 0 or cfg.algorithm.compute_ref_logprobs

    @staticmethod
    def _pad_id(model_path: str) -> int:
        from transformers import AutoTokenizer

        pad = AutoTokenizer.from_pretrained(model_path).pad_token_id
        return int(pad if pad is not None else 0)

    # --- the log-prob stage ------------------------------------------------------------------------------------
    def _broadcast(self, item: Any) -> Any:
        """The input rank's item, on every rank of the model-parallel replica."""
        if self.mp_size == 1:
            return item
        box = [item]
        torch.distributed.broadcast_object_list(box, src=self.mp_src, group=self.mp_group)
        return box[0]

    def _logprobs(self, step: int, group: ScoredGroup, recompute_old: bool) -> TrainBatch | None:
        batch = pack_train_batch([group], self.pad_token_id)  # old log-probs: the sampling engine's
        version = self.version if recompute_old else batch.version
        with self.tracer.span("logprob", step=step, version=version, sequences=batch.num_sequences):
            old = self.policy.compute_logprobs(batch, self.temperature) if recompute_old else None
            ref = self.ref.compute_logprobs(batch, self.temperature) if self.ref is not None else None
        if not self.is_output_rank:
            return None
        mask = batch.response_mask
        return msgspec.structs.replace(
            batch,
            old_logprobs=batch.old_logprobs if old is None else old.masked_fill(~mask, 0.0),
            ref_logprobs=None if ref is None else ref.masked_fill(~mask, 0.0),
            version=version,
        )

    async def logprob_step(self, step: int, inp: Any, out: Any, recompute_old: bool = True) -> int:
        """Turn the step's scored groups from `inp` into log-prob'd `TrainBatch`es in `out`; returns the count.

        `recompute_old`: old log-probs from this worker's weights (the step's version: staleness 0). False keeps
        the log-probs the engine sampled with (max_staleness 1: the samples are one version behind the actor)."""
        count = 0
        while True:
            item = (await inp.aget()) if self.is_input_rank else None
            item = await asyncio.to_thread(self._broadcast, item)
            if isinstance(item, StepEnd):
                break
            batch = await asyncio.to_thread(self._logprobs, step, item, recompute_old)
            if batch is not None:
                await out.aput(batch, weight=batch.num_sequences)
                count += 1
        if self.is_output_rank:
            out.end_step()
        return count

    # --- weights -----------------------------------------------------------------------------------------------
    async def update_weights(self, manifest: WeightManifest, verify: bool = False) -> int:
        """Load the published HF-named weights of `manifest.version` into this rank's shard."""
        from rlinf_pipe.models.convert import load_hf_state_dict

        check_version(self.version, manifest.version, self.owner)
        with self.tracer.span("weight_sync", version=manifest.version, bytes=manifest.num_bytes):
            buckets = await fetch_buckets(manifest, verify)
            state = dict(flatten(buckets))
            await asyncio.to_thread(load_hf_state_dict, self.policy.module, state, self.policy.arch)
            self.version = manifest.version
        return self.version

    def join_weight_group(self, addr: str, port: int, rank: int, world: int) -> None:
        """Join the weight-broadcast group as a receiver (checks the sender's layout against this model)."""
        from rlinf_pipe.runner.weight_broadcast import join_as_receiver

        self.weight_group = join_as_receiver(addr, port, rank, world, self.policy.arch, self.owner)

    def receive_weights(self, version: int, verify: bool = False) -> int:
        """Receive `version` from the broadcast group and load it into this rank's shard, bucket by bucket."""
        from rlinf_pipe.models.convert import load_hf_state_dict

        check_version(self.version, version, self.owner)
        with self.tracer.span("weight_sync", version=version):
            for bucket in self.weight_group.receive(version, verify):
                load_hf_state_dict(self.policy.module, dict(bucket), self.policy.arch, partial=True)
            self.version = version
        return version

