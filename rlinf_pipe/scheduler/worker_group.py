"""`WorkerGroup`: one Ray actor per placed process of a component, and calls that fan out to them.

    group = WorkerGroup.launch(MyWorker, "actor", placement.components["actor"], cluster)
    group.train(batch).wait()                   # every rank
    group.execute_on([0]).save(path).wait()     # some ranks
    group.call_sharded("logprobs", samples).wait()  # split along data-parallel ranks, one result per replica
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Any, Generic, Sequence, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rlinf_pipe.errors import ClusterError, WorkerError
from rlinf_pipe.scheduler.cluster import Cluster
from rlinf_pipe.scheduler.placement import ComponentPlacement, ProcessPlacement, format_ids
from rlinf_pipe.scheduler.worker import CONTROL_GROUP, Worker, WorkerInfo, placement_env

W = TypeVar("W", bound=Worker)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class _Member:
    rank: int
    process: ProcessPlacement
    actor: Any
    name: str

    def where(self) -> str:
        gpus = format_ids(self.process.global_gpus) if self.process.global_gpus else "none"
        return f"node {self.process.node_rank}, GPUs {gpus}"


class GroupCall:
    """Handle of a call running on several ranks. `wait()` returns their results in rank order."""

    def __init__(self, group: "WorkerGroup", method: str, members: Sequence[_Member], refs: Sequence[Any]):
        self.group, self.method, self.members, self.refs = group, method, list(members), list(refs)

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        """Block until every rank finished; the first failure raises a `WorkerError` at once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(self.refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                running = [m.rank for m, r in zip(self.members, self.refs, strict=True) if r in pending]
                raise WorkerError(
                    f"{self.group.name}.{self.method}: ranks {running} still running after {timeout_s:g} s"
                )
            try:
                self._result(done[0])
            except WorkerError:
                self._drain_finished(pending)
                raise
        return [self._result(ref) for ref in self.refs]

    @staticmethod
    def _drain_finished(pending: list[Any]) -> None:
        """Fetch the other ranks' finished errors so Ray does not log each of them again as unhandled."""
        finished, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for ref in finished:
            try:
                ray.get(ref)
            except (RayTaskError, RayActorError):
                pass

    async def async_wait(self) -> list[Any]:
        """`wait()` for asyncio code: awaits every rank, raising on the first failure."""
        tasks = [asyncio.ensure_future(self._await_one(ref)) for ref in self.refs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    def __await__(self):
        return self.async_wait().__await__()

    async def _await_one(self, ref: Any) -> Any:
        try:
            return await ref
        except (RayTaskError, RayActorError) as exc:
            raise self._error(ref, exc) from None

    def _result(self, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except (RayTaskError, RayActorError) as exc:
            raise self._error(ref, exc) from None

    def _error(self, ref: Any, exc: Exception) -> WorkerError:
        member = self.members[self.refs.index(ref)]
        head = f"{self.group.name} rank {member.rank} ({member.where()}) in {self.method}()"
        if isinstance(exc, RayActorError):
            remote = _ANSI.sub("", str(exc))
            if exc.actor_init_failed:
                last_line = remote.strip().splitlines()[-1]
                return WorkerError(
                    f"{self.group.name} rank {member.rank} ({member.where()}) failed in its constructor: {last_line}"
                    f"\n--- remote traceback ---\n{remote}"
                )
            return WorkerError(f"worker {member.name} died: {head}\n{remote}")
        remote = _ANSI.sub("", str(exc))
        return WorkerError(f"{head} raised {type(exc.cause).__name__}: {exc.cause}\n--- remote traceback ---\n{remote}")


class _MethodFanOut:
    def __init__(self, group: "WorkerGroup", members: Sequence[_Member]):
        self._group, self._members = group, members

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args: Any, **kwargs: Any) -> GroupCall:
            refs = [getattr(m.actor, method).remote(*args, **kwargs) for m in self._members]
            return GroupCall(self._group, method, self._members, refs)

        return call


class WorkerGroup(Generic[W]):
    """The Ray actors of one component: every public method of the worker class fans out to all ranks."""

    def __init__(self, name: str, placement: ComponentPlacement, members: list[_Member]):
        self.name, self.placement, self._members = name, placement, members

    @classmethod
    def launch(
        cls,
        worker_cls: type[W],
        name: str,
        placement: ComponentPlacement,
        cluster: Cluster,
        *args: Any,
        init_distributed: bool = True,
        env: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> "WorkerGroup[W]":
        """Start one actor per placed process on its exact node with its GPUs, then (optionally) rendezvous them
        into a torch.distributed group. `args`/`kwargs` go to the worker's constructor."""
        if not issubclass(worker_cls, Worker):
            raise TypeError(f"{worker_cls.__name__} must subclass rlinf_pipe.scheduler.worker.Worker")
        remote_cls = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(worker_cls)
        reservations = cluster.reserve_nodes(sorted({p.node_rank for p in placement.processes if p.global_gpus}))
        world = len(placement.processes)
        members = []
        for proc in placement.processes:
            node = cluster.nodes[proc.node_rank]
            strategy = (
                PlacementGroupSchedulingStrategy(reservations[proc.node_rank], placement_group_bundle_index=0)
                if proc.global_gpus
                else NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            )
            actor_name = f"rlinf_pipe:{name}:{proc.rank}"
            process_env = placement_env(name, proc.rank, world, proc.node_rank, proc.local_gpus, proc.global_gpus)
            try:
                actor = remote_cls.options(
                    name=actor_name,
                    num_cpus=0,
                    num_gpus=0,  # the node's GPUs are held by the reservation; devices come from the placement
                    scheduling_strategy=strategy,
                    runtime_env={"env_vars": {**(env or {}), **process_env}},
                ).remote(*args, **kwargs)
            except ValueError as exc:
                raise ClusterError(
                    f"cannot start worker {actor_name}: {exc} (is a group named {name!r} running?)"
                ) from None
            members.append(_Member(proc.rank, proc, actor, actor_name))
        group = cls(name, placement, members)
        group.worker_info().wait()  # surfaces constructor failures with group/rank/traceback
        if init_distributed and world > 0:
            addr, port = group.execute_on([0]).free_port().wait()[0]
            group.init_distributed(addr, port).wait()
        return group

    # --- calls --------------------------------------------------------------------------------------------
    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return getattr(_MethodFanOut(self, self._members), method)

    def execute_on(self, ranks: Sequence[int]) -> _MethodFanOut:
        """Call methods on the given ranks only."""
        unknown = [r for r in ranks if not 0 <= r < len(self._members)]
        if unknown:
            raise ValueError(f"{self.name} has ranks 0-{len(self._members) - 1}; no rank {unknown}")
        return _MethodFanOut(self, [self._members[r] for r in ranks])

    def call_sharded(self, method: str, batch: Sequence[Any], *args: Any, **kwargs: Any) -> GroupCall:
        """Split `batch` into contiguous shards, one per data-parallel replica; every rank of a replica gets its
        replica's shard. `wait()` returns one result per replica (from its output rank), in DP order."""
        dp = self.dp_size
        bounds = [len(batch) * d // dp for d in range(dp + 1)]
        shards = [list(batch[bounds[d] : bounds[d + 1]]) for d in range(dp)]
        refs = [
            getattr(m.actor, method).remote(shards[self.dp_rank_of(m.rank)], *args, **kwargs) for m in self._members
        ]
        outputs = [i for i, m in enumerate(self._members) if self.is_output_rank(m.rank)]
        call = GroupCall(self, method, self._members, refs)
        return _ReplicaCall(call, outputs)

    # --- topology --------------------------------------------------------------------------------------------
    # Ranks follow Megatron's default order: tensor-parallel fastest, then data-parallel, then pipeline. A process
    # that owns all GPUs of its model-parallel group (a rollout engine with TP GPUs) is a replica on its own.
    @property
    def size(self) -> int:
        return len(self._members)

    @property
    def _proc_tp_pp(self) -> tuple[int, int]:
        if self.placement.gpus_per_process > 1:
            return 1, 1
        return self.placement.tp, self.placement.pp

    @property
    def dp_size(self) -> int:
        return self.placement.dp

    def dp_rank_of(self, rank: int) -> int:
        return (rank // self._proc_tp_pp[0]) % self.dp_size

    def is_output_rank(self, rank: int) -> bool:
        """The rank that returns a replica's result: tensor-parallel rank 0 of the last pipeline stage."""
        tp, pp = self._proc_tp_pp
        return rank % tp == 0 and rank // (tp * self.dp_size) == pp - 1

    # --- health ---------------------------------------------------------------------------------------------
    def infos(self) -> list[WorkerInfo]:
        return self.worker_info().wait()

    def alive(self, timeout_s: float = 10.0) -> list[bool]:
        """Whether each rank answers a ping (answered even while the rank runs a long method)."""
        refs = [m.actor.ping.remote() for m in self._members]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        status = []
        for ref in refs:
            try:
                status.append(ref in ready and ray.get(ref, timeout=0) > 0)
            except (RayActorError, RayTaskError, GetTimeoutError):
                status.append(False)
        return status

    def shutdown(self) -> None:
        for member in self._members:
            ray.kill(member.actor, no_restart=True)
        self._members = []


class _ReplicaCall(GroupCall):
    """A sharded call: waits on every rank (so failures surface) and returns the output ranks' results."""

    def __init__(self, call: GroupCall, outputs: list[int]):
        super().__init__(call.group, call.method, call.members, call.refs)
        self.outputs = outputs

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        results = super().wait(timeout_s)
        return [results[i] for i in self.outputs]

    async def async_wait(self) -> list[Any]:
        results = await super().async_wait()
        return [results[i] for i in self.outputs]
