"""A rank's place in its model replica: which rank reads the replica's inputs, which writes its outputs, and how
the input rank shares what it read with the others."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def dp_object_group() -> Any:
    """The data-parallel group for host-side collectives (pickled objects, votes): its gloo twin when Megatron made
    one (no device copies)."""
    from megatron.core import parallel_state as ps

    try:
        group = ps.get_data_parallel_group_gloo()
    except (AssertionError, RuntimeError):
        group = None
    return group if group is not None else ps.get_data_parallel_group()


@dataclass(frozen=True)
class ReplicaRanks:
    """This rank in its data-parallel replica (TP x PP ranks). The input rank (tensor rank 0 of the first pipeline
    stage) reads a stage's channel; the output rank (tensor rank 0 of the last stage) writes results."""

    dp_rank: int
    dp_size: int
    mp_size: int
    is_input: bool
    is_output: bool
    mp_group: Any
    input_rank: int  # global rank of the replica's input rank
    dp_group: Any = None  # this rank's data-parallel group, for host-side votes (gloo where Megatron made one)

    @classmethod
    def current(cls) -> ReplicaRanks:
        """From Megatron's parallel state (initialised by `models.megatron_gpt.init_model_parallel`)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        mp_size = ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
        group = ps.get_model_parallel_group()
        tp0 = ps.get_tensor_model_parallel_rank() == 0
        return cls(
            dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(), mp_size=mp_size,
            is_input=tp0 and ps.is_pipeline_first_stage(), is_output=tp0 and ps.is_pipeline_last_stage(),
            mp_group=group, input_rank=dist.get_global_rank(group, 0) if mp_size > 1 else dist.get_rank(),
            dp_group=dp_object_group(),
        )

    def agree(self, ok: bool) -> bool:
        """Whether `ok` holds on every replica (collective over the data-parallel group; one replica: `ok`). All
        ranks of a replica pass the same value."""
        if self.dp_size == 1:
            return ok
        import torch
        import torch.distributed as dist

        vote = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.dp_group)
        return bool(vote.item())

    def share(self, item: Any) -> Any:
        """The input rank's `item`, on every rank of the replica (collective over the replica; others pass None)."""
        if self.mp_size == 1:
            return item
        import torch.distributed as dist

        box = [item]
        dist.broadcast_object_list(box, src=self.input_rank, group=self.mp_group)
        return box[0]
