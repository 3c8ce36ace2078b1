"""`ActorWorker`: the `actor:` placement's Megatron trainer, driven by the runner.

The runner calls `train_micro_batch` on one data-parallel replica at a time as batches arrive and
`optimizer_step` on every rank at each mini-batch boundary; the loss is `rlinf_pipe.algorithms.policy_loss`
configured from `algorithm.*` (the trainer itself knows nothing about it). `export_weights` publishes the
weights for the engines. In collocated mode the actor also computes the log-probs (inherited from
`InferenceWorker`) and each of its phases holds the device lock: `begin_phase` (lock + onload) ...
`end_phase` (offload + unlock).
"""

from __future__ import annotations

import functools
from typing import Any

from rlinf_pipe.algorithms.losses import policy_loss
from rlinf_pipe.algorithms.terms import LossTerms
from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.structs import TrainBatch
from rlinf_pipe.runner.weight_sync import WeightManifest, publish_buckets
from rlinf_pipe.workers.inference.worker import InferenceWorker


def make_loss_fn(cfg: Config) -> Any:
    """`loss_fn(logprobs, entropy, batch) -> LossTerms` for the trainer, from `algorithm.*`."""
    a = cfg.algorithm
    loss = functools.partial(
        policy_loss, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, dual_clip_c=a.dual_clip_c,
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, loss_agg=a.loss_agg,
    )

    def loss_fn(logprobs: Any, entropy: Any, batch: TrainBatch) -> LossTerms:
        return loss(logprobs, batch.old_logprobs, batch.ref_logprobs, batch.advantages, batch.response_mask,
                    entropy=entropy)

    return loss_fn


class ActorWorker(InferenceWorker):
    """Trains the policy; see the module docstring."""

    role = "actor"

    def setup(self, model_path: str, cfg: Config, role: str = "actor", locks: Any = None) -> None:
        self.collocated = locks is not None
        super().setup(model_path, cfg, role, locks)
        self.loss_fn = make_loss_fn(cfg)
        if self.collocated:
            self._offload()

    def _build_policy(self, model_path: str, common: dict[str, Any]) -> Any:
        from rlinf_pipe.workers.actor.trainer import MegatronPolicy

        a = self.cfg.actor
        return MegatronPolicy(
            model_path, train=True, lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad,
            lr_warmup_steps=a.lr_warmup_steps, train_entropy=self.cfg.algorithm.entropy_coef != 0, **common,
        )

    def _needs_ref(self, cfg: Config) -> bool:
        # The actor needs the reference model only when it computes the log-probs itself (collocated).
        return super()._needs_ref(cfg) and self.collocated

    # --- device phases (collocated) ------------------------------------------------------------------------------
    def _offload(self) -> int:
        moved = self.policy.offload()
        if self.ref is not None:
            moved += self.ref.offload()
        return moved

    def _onload(self) -> int:
        moved = self.policy.onload()
        if self.ref is not None:
            moved += self.ref.onload()
        return moved

    async def begin_phase(self, step: int) -> int:
        """Take this rank's devices (collocated) and bring the state back onto them; returns bytes moved."""
        if not self.collocated:
            return 0
        await self.locks.acquire.remote(list(self.devices), self.owner)
        with self.tracer.span("onload", step=step) as args:
            args["bytes"] = moved = self._onload()
        return moved

    async def end_phase(self, step: int) -> int:
        """Move the state off the devices and give them back (collocated); returns bytes moved."""
        if not self.collocated:
            return 0
        try:
            with self.tracer.span("offload", step=step) as args:
                args["bytes"] = moved = self._offload()
        finally:
            await self.locks.release.remote(list(self.devices), self.owner)
        return moved

    # --- training ----------------------------------------------------------------------------------------------
    def train_micro_batch(self, batch: TrainBatch) -> None:
        with self.tracer.span("train", version=batch.version, sequences=batch.num_sequences,
                              tokens=batch.num_tokens):
            self.policy.train_micro_batch(batch, self.loss_fn)

    def optimizer_step(self, step: int, micro_batches: list[int] | None = None) -> dict[str, float] | None:
        """Collective: one optimizer step; metrics on the replica-0 output rank, None elsewhere. `micro_batches`:
        per data-parallel replica, how many micro-batches the driver sent since the last step (checked)."""
        expected = None if micro_batches is None else micro_batches[self.policy.dp_rank]
        with self.tracer.span("optimizer_step", step=step):
            metrics = self.policy.optimizer_step(expected)
        self.version = step + 1
        return metrics if (self.is_output_rank and self.policy.dp_rank == 0) else None

    # --- weights and checkpoints -------------------------------------------------------------------------------
    def export_weights(self, version: int, bucket_bytes: int, checksum: bool = False) -> WeightManifest | None:
        """Publish this replica-0 rank's gathered weights as `version` (collective over replica 0's ranks)."""
        if self.policy.dp_rank != 0:
            return None
        with self.tracer.span("export_weights", version=version) as args:
            manifest = publish_buckets(self.policy.weight_buckets(bucket_bytes), version, checksum)
            args["bytes"] = manifest.num_bytes
        return manifest if manifest.refs else None

    def join_weight_group(self, addr: str, port: int, world: int, bucket_bytes: int) -> None:
        """Gathering rank only: become rank 0 (the sender) of the weight-broadcast group and publish the layout."""
        from rlinf_pipe.runner.weight_broadcast import join_as_sender

        self.weight_group = join_as_sender(addr, port, world, self.policy.arch, self.policy.params_dtype,
                                           bucket_bytes)

    def broadcast_weights(self, version: int, checksum: bool = False) -> int | None:
        """Stream this version's weights through the broadcast group (replica 0's ranks gather; rank 0 sends)."""
        if self.policy.dp_rank != 0:
            return None
        with self.tracer.span("broadcast_weights", version=version) as args:
            tensors = self.policy.hf_weights(copy=False)
            group = getattr(self, "weight_group", None)
            if group is None:  # a TP/PP peer of the sender: only takes part in the gathering
                for _ in tensors:
                    pass
                return None
            args["bytes"] = sent = group.send(version, tensors, checksum)
        return sent

    def save_checkpoint(self, path: str) -> str:
        with self.tracer.span("save_checkpoint"):
            return str(self.policy.save_checkpoint(path))

    def load_checkpoint(self, path: str, version: int) -> None:
        """Restore model, optimizer, scheduler and RNG; the weights are version `version` (the next step)."""
        self.policy.load_checkpoint(path)
        self.version = version
