"""A rank's place in its model replica (its TP x PP x CP ranks): which rank reads the replica's inputs, which writes
its outputs, and how the input rank shares what it read with the others."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

# How long a rank may wait in a host-side collective of its replica or of its data-parallel group: as long as a
# stage waits for its first input (a whole generation, at the step's start), or a replica whose mini-batch is
# complete waits in the step's vote for the slowest one (long generations, dynamic sampling). Megatron's own groups,
# gloo ones included, fail after 30 minutes. A lost peer fails a wait at once (its connections close).
OBJECT_GROUP_TIMEOUT = timedelta(hours=24)
_object_twins: dict[str, tuple[Any, Any]] = {}  # "dp" / "mp" -> (Megatron's group, its gloo twin) once made


def dp_object_group() -> Any:
    """The data-parallel group for host-side collectives (pickled metrics, the replicas' votes): a gloo twin of
    Megatron's with `OBJECT_GROUP_TIMEOUT` (`object_twin`)."""
    from megatron.core import parallel_state as ps

    return object_twin("dp", ps.get_data_parallel_group())


def mp_object_group() -> Any:
    """The replica's group for host-side collectives (the input a replica's ranks share, pickled objects): a gloo
    twin, with `OBJECT_GROUP_TIMEOUT` (`object_twin`), of Megatron's model-parallel group (TP x PP), or under context
    parallelism of every rank of this rank's data-parallel replica (TP x PP x CP: Megatron has no such group).
    Waiting there costs no GPU: an NCCL receive runs a kernel that spins on the GPU until its sender posts (beside
    engines generating on shared GPUs, outside the device locks)."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() == 1:
        return object_twin("mp", ps.get_model_parallel_group())
    return object_twin("replica", None, ps.get_data_parallel_rank())


def object_twin(kind: str, group: Any, key: Any = None) -> Any:
    """A gloo group of the ranks of this rank's `group` (None: of the ranks that pass the same `key`) that waits up
    to `OBJECT_GROUP_TIMEOUT`, made once per `kind` and group. Collective over the world at its first use: every
    rank makes every twin of that kind."""
    import torch.distributed as dist

    made = _object_twins.get(kind)
    if made is None or made[0] is not group:
        everyone: list[Any] = [None] * dist.get_world_size()
        if group is None:
            keys: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(keys, key)
            everyone = [[r for r, k in enumerate(keys) if k == mine] for mine in keys]
        else:
            dist.all_gather_object(everyone, dist.get_process_group_ranks(group))
        mine = None
        for ranks in sorted({tuple(r) for r in everyone}):  # (the same groups in the same order on every rank)
            twin = dist.new_group(list(ranks), backend="gloo", timeout=OBJECT_GROUP_TIMEOUT)
            if dist.get_rank() in ranks:
                mine = twin
        _object_twins[kind] = made = (group, mine)
    return made[1]


@dataclass(frozen=True)
class ReplicaRanks:
    """This rank in its data-parallel replica (TP x PP x CP ranks). The input rank (tensor and context rank 0 of the
    first pipeline stage) reads a stage's channel; the output rank (tensor and context rank 0 of the last stage)
    writes results."""

    dp_rank: int
    dp_size: int
    mp_size: int
    is_input: bool
    is_output: bool
    mp_group: Any  # the replica's ranks, for host-side collectives (`mp_object_group`)
    input_rank: int  # global rank of the replica's input rank
    dp_group: Any = None  # this rank's data-parallel group's gloo twin, for host-side votes (`dp_object_group`)

    @classmethod
    def current(cls) -> ReplicaRanks:
        """From Megatron's parallel state (initialised by `models.megatron_gpt.init_model_parallel`)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        mp_size = (ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
                   * ps.get_context_parallel_world_size())
        group = mp_object_group()
        tp0 = ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
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
