"""`ReplicaRanks` over Megatron's parallel state in spawned gloo worlds: the model-parallel and data-parallel groups'
host-side gloo twins (Megatron's are NCCL on GPUs, forced here; theirs and its gloo groups fail after 30 minutes,
the twins wait a day) group each replica's ranks, carry its shared input and the replicas' votes."""

from __future__ import annotations

import pytest
from support.actor_run import spawn

from rlinf_pipe.engines.policy import parallel

pytestmark = pytest.mark.slow


def _replica_of_two_tensor_ranks(rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlinf_pipe.engines.policy import parallel

    megatron_group = ps.get_model_parallel_group()
    real_backend = dist.get_backend
    # (as on GPUs: Megatron's group is NCCL, so a gloo twin is made for host-side collectives)
    dist.get_backend = lambda group=None: "nccl" if group is megatron_group else real_backend(group)
    try:
        ranks = parallel.ReplicaRanks.current()
        again = parallel.mp_object_group()  # (made once)
    finally:
        dist.get_backend = real_backend
    shared = ranks.share(f"group read by rank {rank}" if ranks.is_input else None)
    vote = ranks.agree(rank < 2)  # the second replica (ranks 2-3) says no: every rank learns it
    return {"twin": ranks.mp_group is not megatron_group and again is ranks.mp_group,
            "members": dist.get_process_group_ranks(ranks.mp_group), "backend": real_backend(ranks.mp_group),
            "input_rank": ranks.input_rank, "is_input": ranks.is_input, "shared": shared,
            "dp_twin": ranks.dp_group is not ps.get_data_parallel_group() and ranks.dp_group is not None
            and ranks.dp_group is parallel.dp_object_group(),
            "dp_members": dist.get_process_group_ranks(ranks.dp_group), "dp_backend": real_backend(ranks.dp_group),
            "timeouts": [group._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # noqa: SLF001
                         for group in (ranks.mp_group, ranks.dp_group)],
            "vote": vote}


def test_each_replica_shares_its_input_rank_item_over_a_gloo_twin_of_its_group(tmp_path):
    results = spawn(4, _replica_of_two_tensor_ranks, str(tmp_path), parallel={"tp": 2})
    for rank, r in enumerate(results):
        first = rank // 2 * 2  # TP 2: ranks 0-1 and 2-3 are the replicas
        assert r["twin"] and r["backend"] == "gloo" and r["members"] == [first, first + 1]
        assert r["input_rank"] == first and r["is_input"] == (rank == first)
        assert r["shared"] == f"group read by rank {first}"
        assert r["dp_twin"] and r["dp_backend"] == "gloo" and r["dp_members"] == [rank % 2, rank % 2 + 2]
        assert r["timeouts"] == [parallel.OBJECT_GROUP_TIMEOUT.total_seconds()] * 2
        assert r["vote"] is False
