"""`InferenceWorker`: the `inference:` placement's Megatron log-prob worker (old and reference log-probs).

Each step it streams the scored groups into log-prob'd training batches (`LogprobStage`): old log-probs with the
weights of the step's version, reference log-probs with the initial weights (a second, forward-only model).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from rlinf_pipe.algorithms.logprob_needs import needs_ref, recomputes_old
from rlinf_pipe.config.schema import Config
from rlinf_pipe.engines.policy import MegatronPolicy, ReplicaRanks
from rlinf_pipe.models.megatron_gpt import init_model_parallel
from rlinf_pipe.channels import Channel
from rlinf_pipe.data.structs import ScoredGroup
from rlinf_pipe.data.train_batch import TrainBatch
from rlinf_pipe.runtime.locks import DeviceShare
from rlinf_pipe.utils.device_memory import hand_back_cached_memory
from rlinf_pipe.workers.logprob_stage import LogprobStage, pad_token_id, policy_options, train_routing
from rlinf_pipe.workers.replica_balance import TrainRoute
from rlinf_pipe.workers.weight_receiver import WeightReceiverWorker


def replica_gpus(mine: Sequence[int], ranks: ReplicaRanks) -> list[int]:
    """The GPUs of every rank of this rank's model-parallel replica (collective over the replica)."""
    if ranks.mp_size == 1:
        return list(mine)
    import torch.distributed as dist

    gathered: list[Any] = [None] * ranks.mp_size
    dist.all_gather_object(gathered, list(mine), group=ranks.mp_group)
    return sorted({gpu for gpus in gathered for gpu in gpus})


class InferenceWorker(WeightReceiverWorker):
    """Old / reference log-probs of scored groups, streamed channel to channel. Its GPUs' `share`: taken in turns
    with the engines (inference on the rollout's GPUs), it holds them for each group's log-probs, between the
    engines' generations. The weight versions load into its log-prob stage (`WeightReceiverWorker`)."""

    def __init__(self, cfg: Config, model_path: str, actor_dp: int, share: DeviceShare = DeviceShare(),
                 balancer: Any = None, pad_id: int | None = None):
        super().__init__(model_path)
        init_model_parallel(cfg.inference.tensor_parallel_size, cfg.inference.pipeline_parallel_size,
                            cfg.inference.context_parallel_size)
        self.share = share
        self.policy = MegatronPolicy(model_path, train=False, **policy_options(cfg, "inference"))
        ref = MegatronPolicy(model_path, train=False, **policy_options(cfg, "inference")) if needs_ref(cfg) else None
        self.stage = LogprobStage(
            self.policy, ref, TrainRoute(train_routing(cfg, actor_dp), balancer),
            pad_token_id(model_path, pad_id),
            recompute_old=recomputes_old(cfg), tracer=self.tracer, on_devices=self._on_devices,
        )
        self.replica_gpus = replica_gpus(self.info.global_gpus, self.stage.ranks)
        hand_back_cached_memory()  # (what building the models left cached: an engine on these GPUs sizes its KV
        # cache by the memory free when it starts)

    def _on_devices(self, turn: str) -> AbstractAsyncContextManager[None]:
        """The replica's GPUs for one group's log-probs (`turn`, the same on every rank of the replica), taken by its
        ranks as one gang: they meet in collectives while holding them. The first rank's grant takes every GPU of
        the replica at once, so no engine can take a sibling's in between."""
        gang = f"{self.info.group}/replica{self.stage.ranks.dp_rank}@{turn}"

        async def hand_back() -> None:
            hand_back_cached_memory()

        return self.share.hold(self.replica_gpus, self.owner, gang, before_give_back=hand_back)

    def weight_target(self) -> LogprobStage:
        return self.stage

    async def logprob_step(self, step: int, src: Channel[ScoredGroup], dst: Sequence[Channel[TrainBatch]]) -> int:
        """The step's log-probs, from the scored channel `src` into the train channels `dst` (`LogprobStage.run`)."""
        return await self.stage.run(step, src, dst)
