"""`WorkerGroup`: one Ray actor per placed process of a component, called through explicit, typed verbs.

    group = WorkerGroup.launch(MyWorker, "actor", placement.components["actor"], cluster)  # WorkerGroup[MyWorker]
    await group.all.call(MyWorker.train, step)               # every rank; a list of results in rank order
    await group.replicas.call(MyWorker.metrics)              # every rank; one result per data-parallel replica
    await group.rank(0).call(MyWorker.free_port)             # one rank; its result
    await group.some([0, 2]).call(MyWorker.abandon_step)     # some ranks; their results in the order given
    await group.leader(0).call(MyWorker.publish, version)    # every rank (a collective); rank 0's result
    await group.sharded.call(MyWorker.generate, prompts, 3)  # `prompts` split into one contiguous shard per replica

A verb's `call` takes the worker class's method, then its arguments: a type checker checks them against the method
and gives the call the method's result type (`rlinf_pipe.runtime.verbs`). Every call returns a `GroupCall`: `await`
it in asyncio code or `.wait()` elsewhere; the first failing rank raises a `WorkerError` at once. An argument other
than a number, a string or None that goes to several ranks is put into Ray's object store once and shared by
reference.

After a lost worker: `group.relaunch(ranks, *args)` starts ranks again on their nodes and GPUs, and `await
group.settle(timeout_s)` waits until every call made through the verbs has finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rlinf_pipe.errors import ClusterError, WorkerError, WorkerLost
from rlinf_pipe.runtime.cluster import Cluster
from rlinf_pipe.utils.worker_death import CALL_FAILED, death_cause
from rlinf_pipe.runtime.group_call import GroupCall, Member
from rlinf_pipe.runtime.verbs import ListVerb, OneVerb, ShardedVerb
from rlinf_pipe.runtime.rendezvous import rendezvous_point
from rlinf_pipe.runtime.last_output import announced_output, forget_output, output_tail
from rlinf_pipe.planning.placement import ComponentPlacement, ProcessPlacement
from rlinf_pipe.runtime.worker import (
    CONTROL_GROUP,
    Worker,
    WorkerInfo,
    placement_env,
    rendezvous_env,
)

W_co = TypeVar("W_co", covariant=True)  # the group's worker class (or a protocol its workers follow)
V = TypeVar("V", bound=Worker)


@dataclass(frozen=True)
class _Recipe:
    """How a group's actors are started (kept to start some of them again)."""

    remote_cls: Any
    cluster: Cluster
    distributed: bool
    env: dict[str, str]
    runtime_env: dict[str, Any] | None


_PING_FAILED: tuple[type[Exception], ...] = (*CALL_FAILED, GetTimeoutError)  # a ping that fails or times out

TRACKED_CALLS = 256  # in-flight calls a group remembers before it forgets the finished ones


def _name_taken(actor_name: str) -> bool:
    """Whether Ray still knows a live actor by `actor_name`."""
    try:
        ray.get_actor(actor_name)
    except ValueError:
        return False
    return True


class WorkerGroup(Generic[W_co]):
    """The Ray actors of one component and the verbs that call them (see the module docstring)."""

    def __init__(self, name: str, placement: ComponentPlacement, members: list[Member],
                 recipe: _Recipe | None = None):
        self.name, self.placement, self._members, self._recipe = name, placement, members, recipe
        self._calls: list[tuple[Member, Any]] = []  # calls made through the verbs, not known to be finished
        self._building: GroupCall[list[WorkerInfo]] | None = None  # `start`'s readiness call, until `ready` has waited for it

    @classmethod
    def launch(
        cls,
        worker_cls: type[V],
        name: str,
        placement: ComponentPlacement,
        cluster: Cluster,
        *args: Any,
        distributed: bool = True,
        env: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> WorkerGroup[V]:
        """`start` the group and wait until it is `ready`."""
        return cls.start(worker_cls, name, placement, cluster, *args, distributed=distributed, env=env,
                         **kwargs).ready()

    @classmethod
    def start(
        cls,
        worker_cls: type[V],
        name: str,
        placement: ComponentPlacement,
        cluster: Cluster,
        *args: Any,
        distributed: bool = True,
        env: dict[str, str] | None = None,
        runtime_env: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> WorkerGroup[V]:
        """Start one actor per placed process on its exact node with its GPUs; with `distributed`, their
        constructors join one torch.distributed world (rank 0's node hosts the rendezvous). `env` adds environment
        variables, `runtime_env` other Ray runtime-env fields (e.g. `nsight`). `args` / `kwargs` go to the worker's
        constructor. Returns at once: the constructors run until `ready()` (so several groups can
        start together)."""
        if not issubclass(worker_cls, Worker):
            raise TypeError(f"{worker_cls.__name__} must subclass rlinf_pipe.runtime.worker.Worker")
        # (Ray's stubs leave out `concurrency_groups`, an actor class's option)
        remote_cls = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(worker_cls)  # type: ignore[call-overload]
        group: WorkerGroup[V] = WorkerGroup(name, placement, [],
                                            _Recipe(remote_cls, cluster, distributed, dict(env or {}), runtime_env))
        group._members = group._start_members(list(placement.processes), args, kwargs)
        # asked now, each rank answers as soon as its constructor returns (which its launch span records)
        group._building = group._every().call(Worker.worker_info)
        return group

    @property
    def recipe(self) -> _Recipe:
        """How the group's actors were started (a group made of given members, in tests, has none)."""
        if self._recipe is None:
            raise ClusterError(f"{self.name}: a group not started by WorkerGroup.start cannot start actors")
        return self._recipe

    def _start_members(self, procs: list[ProcessPlacement], args: tuple, kwargs: dict[str, Any]) -> list[Member]:
        """Start an actor for each of `procs` (with the group's recipe and these constructor arguments)."""
        recipe, name = self.recipe, self.name
        cluster = recipe.cluster
        reservations = cluster.reserve_nodes(sorted({p.node_rank for p in procs if p.global_gpus}))
        world = len(self.placement.processes)
        shared_env = dict(recipe.env)
        if recipe.distributed and world > 0:
            shared_env.update(rendezvous_env(*rendezvous_point(cluster.nodes[procs[0].node_rank])))
        started: list[Member] = []
        for proc in procs:
            strategy = (
                PlacementGroupSchedulingStrategy(reservations[proc.node_rank], placement_group_bundle_index=0)
                if proc.global_gpus
                else NodeAffinitySchedulingStrategy(cluster.nodes[proc.node_rank].node_id, soft=False)
            )
            actor_name = f"rlinf_pipe:{name}:{proc.rank}"
            process_env = placement_env(name, proc.rank, world, proc.node_rank, proc.local_gpus, proc.global_gpus)
            try:
                actor = recipe.remote_cls.options(
                    name=actor_name,
                    num_cpus=0,
                    num_gpus=0,  # the node's GPUs are held by the reservation; devices come from the placement
                    scheduling_strategy=strategy,
                    runtime_env={**(recipe.runtime_env or {}), "env_vars": {**shared_env, **process_env}},
                ).remote(*args, **kwargs)
            except ValueError as exc:
                for member in started:
                    ray.kill(member.actor, no_restart=True)
                raise ClusterError(
                    f"cannot start worker {actor_name}: {exc} (is a group named {name!r} running?)"
                ) from None
            started.append(Member(proc.rank, proc, actor, actor_name))
        return started

    def relaunch(self, ranks: Sequence[int], *args: Any, **kwargs: Any) -> WorkerGroup[W_co]:
        """Stop `ranks` and start them again on the same nodes and GPUs (constructor arguments `args` / `kwargs`),
        then wait until they are `ready`. A group with a torch.distributed world is relaunched whole (its ranks
        form the world at construction)."""
        ranks = sorted(set(ranks))
        for rank in ranks:
            self._check_rank(rank)
        if self.recipe.distributed and len(ranks) != self.size:
            raise ValueError(f"{self.name}: a group with a torch.distributed world is relaunched whole, not ranks "
                             f"{ranks} of 0-{self.size - 1}")
        self.kill(ranks)
        procs = [self._members[r].process for r in ranks]
        try:
            started = {m.rank: m for m in self._start_members(procs, args, kwargs)}
            self._members = [started.get(m.rank, m) for m in self._members]
            ListVerb[Worker](self, [self._members[r] for r in ranks], list).call(Worker.worker_info).wait()
        except (ClusterError, WorkerError):
            self.shutdown()
            raise
        return self

    def kill(self, ranks: Sequence[int], wait_s: float = 30.0) -> None:
        """Kill `ranks` (their in-flight calls fail) and wait up to `wait_s` until they are gone, so their names can
        be taken again."""
        members = [self._members[r] for r in ranks]
        for member in members:
            ray.kill(member.actor, no_restart=True)
        if wait_s > 0 and members:
            deadline = time.monotonic() + wait_s
            gone = [m.actor.ping.remote() for m in members]
            ray.wait(gone, num_returns=len(gone), timeout=wait_s)
            # A dead process's name is released by Ray's control store a moment after its calls fail.
            while any(_name_taken(m.name) for m in members) and time.monotonic() < deadline:
                time.sleep(0.05)
        killed = {id(m) for m in members}
        self._calls = [(m, ref) for m, ref in self._calls if id(m) not in killed]

    # --- in-flight calls --------------------------------------------------------------------------------------
    def track(self, members: Sequence[Member], refs: Sequence[Any]) -> None:
        self._calls.extend(zip(members, refs, strict=True))
        if len(self._calls) > TRACKED_CALLS:
            self._calls = self._unfinished(self._calls, 0.0)

    @staticmethod
    def _unfinished(calls: list[tuple[Member, Any]], timeout_s: float, drain: bool = False
                    ) -> list[tuple[Member, Any]]:
        refs = [ref for _, ref in calls]
        finished, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
        if drain:  # calls of an abandoned step: their errors are expected, not to be logged as unhandled
            GroupCall.drain_finished(finished)
        pending_set = set(pending)
        return [(m, ref) for m, ref in calls if ref in pending_set]

    async def settle(self, timeout_s: float) -> list[int]:
        """Wait up to `timeout_s` until every call made through the verbs has finished (failed ones included, their
        errors dropped); returns the ranks with calls still running."""
        if self._calls:
            self._calls = await asyncio.to_thread(self._unfinished, self._calls, timeout_s, True)
        return sorted({m.rank for m, _ in self._calls})

    def ready(self) -> WorkerGroup[W_co]:
        """Wait until every rank's constructor finished. A rank failing there raises a `WorkerError` naming it, and
        the group's other actors are stopped (none is left waiting in the rendezvous)."""
        building, self._building = self._building, None
        try:
            (building or self._every().call(Worker.worker_info)).wait()
        except WorkerError:
            self.shutdown()
            raise
        return self

    # --- verbs (rlinf_pipe.runtime.verbs) --------------------------------------------------------------------
    @property
    def all(self) -> ListVerb[W_co]:
        """Every rank; the call's result is the list of the ranks' results, in rank order."""
        return ListVerb(self, self._members, list)

    @property
    def replicas(self) -> ListVerb[W_co]:
        """Every rank (a collective over the group); the result is one value per data-parallel replica, from the
        replica's output rank (tensor rank 0 of its last pipeline stage), in replica order."""
        return ListVerb(self, self._members, self._pick_outputs)

    @property
    def sharded(self) -> ShardedVerb[W_co]:
        """Like `replicas`, with the method's first argument split into one contiguous shard per replica (every rank
        of a replica gets its replica's shard)."""
        return ShardedVerb(self, self._members, self._pick_outputs)

    def leader(self, rank: int = 0) -> OneVerb[W_co]:
        """Every rank (a collective led by `rank`); the result is the leader's result."""
        self._check_rank(rank)
        return OneVerb(self, self._members, lambda results: results[rank])

    def some(self, ranks: Sequence[int]) -> ListVerb[W_co]:
        """Some ranks; the result is the list of their results, in the order given."""
        for rank in ranks:
            self._check_rank(rank)
        return ListVerb(self, [self._members[r] for r in ranks], list)

    def rank(self, rank: int) -> OneVerb[W_co]:
        """One rank; the result is its result."""
        self._check_rank(rank)
        return OneVerb(self, [self._members[rank]], lambda results: results[0])

    def _every(self) -> ListVerb[Worker]:
        """`all` for the methods every worker has (`Worker`'s)."""
        return ListVerb(self, self._members, list)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self._members):
            raise ValueError(f"{self.name} has ranks 0-{len(self._members) - 1}; no rank {rank}")

    def _pick_outputs(self, results: list[Any]) -> list[Any]:
        return [results[i] for i, m in enumerate(self._members) if self.is_output_rank(m.rank)]

    def shards(self, batch: Sequence[Any]) -> list[list[Any]]:
        dp = self.dp_size
        bounds = [len(batch) * d // dp for d in range(dp + 1)]
        return [list(batch[bounds[d] : bounds[d + 1]]) for d in range(dp)]

    # --- topology --------------------------------------------------------------------------------------------
    # Ranks follow Megatron's default order: tensor-parallel fastest, then context-parallel, then data-parallel, then
    # pipeline. A process that owns all GPUs of its model-parallel group (a rollout engine with TP GPUs) is a replica
    # on its own.
    @property
    def size(self) -> int:
        return len(self._members)

    @property
    def _proc_tp_pp(self) -> tuple[int, int, int]:
        """(TP, PP, CP) in processes."""
        if self.placement.gpus_per_process > 1:
            return 1, 1, 1
        return self.placement.tp, self.placement.pp, self.placement.cp

    @property
    def dp_size(self) -> int:
        return self.placement.dp

    def dp_rank_of(self, rank: int) -> int:
        tp, _, cp = self._proc_tp_pp
        return (rank // (tp * cp)) % self.dp_size

    def is_output_rank(self, rank: int) -> bool:
        """The rank that returns a replica's result: tensor- and context-parallel rank 0 of the last pipeline
        stage."""
        tp, pp, cp = self._proc_tp_pp
        return rank % (tp * cp) == 0 and rank // (tp * cp * self.dp_size) == pp - 1

    # --- health ---------------------------------------------------------------------------------------------
    def infos(self) -> list[WorkerInfo]:
        return self._every().call(Worker.worker_info).wait()

    def alive(self, timeout_s: float = 10.0) -> list[bool]:
        """Whether each rank answers a ping (answered even while the rank runs a long method)."""
        refs = [m.actor.ping.remote() for m in self._members]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        status = []
        for ref in refs:
            try:
                status.append(ref in ready and ray.get(ref, timeout=0) > 0)
            except _PING_FAILED:
                status.append(False)
        return status

    async def unhealthy(self, timeout_s: float, round_trips: list[float] | None = None) -> list[WorkerLost]:
        """The ranks that are gone (their ping fails) or hung (no answer within `timeout_s`; the ping runs in the
        control thread, so a rank busy with a long method still answers). Each answered ping's seconds are
        appended to `round_trips` (a call's round trip to a worker, which the planner's profile reads)."""

        async def probe(member: Member) -> WorkerLost | None:
            where = f"{self.name} rank {member.rank} ({member.where()})"
            try:
                sent = time.perf_counter()
                await asyncio.wait_for(member.actor.ping.remote(), timeout_s)
                if round_trips is not None:
                    round_trips.append(time.perf_counter() - sent)
            except asyncio.TimeoutError:
                return WorkerLost(member.name, where, "hung",
                                  f"alive but no answer to a heartbeat within {timeout_s:g} s (stopped, or stuck "
                                  "holding the Python interpreter lock)")
            except CALL_FAILED as exc:
                return self.died(member, where, death_cause(exc))
            return None

        return [lost for lost in await asyncio.gather(*(probe(m) for m in self._members)) if lost is not None]

    def died(self, member: Member, where: str, detail: str) -> WorkerLost:
        """The loss of `member`, whose process is gone: `detail` (Ray's word), then what it printed last (the tail of
        the output file it announced, `last_output`)."""
        node = member.process.node_rank
        ip = f" ({self._recipe.cluster.nodes[node].ip})" if self._recipe is not None else ""
        said = output_tail(announced_output(member.actor._actor_id.hex()), f"node {node}{ip}")
        return WorkerLost(member.name, where, "died", f"{detail}\n{said}" if said else detail)

    def shutdown(self, wait_s: float = 0.0, grace_s: float = 0.0) -> None:
        """Kill every rank; with `grace_s`, each first releases what a killed process would leave behind
        (`Worker.before_stop`, up to that long: a forkserver's socket folder in /tmp, for one); with `wait_s`, wait
        up to that long until they are gone (so their names can be taken again by a relaunched group)."""
        if grace_s > 0 and self._members:
            released = [member.actor.before_stop.remote() for member in self._members]
            ray.wait(released, num_returns=len(released), timeout=grace_s)
        self.kill(range(self.size), wait_s)
        building, self._building = self._building, None
        if building is not None:  # (its calls fail with the killed ranks: fetched, Ray does not log them)
            ray.wait(building.refs, num_returns=len(building.refs), timeout=1.0)
            GroupCall.drain_finished(building.refs)
        for member in self._members:
            forget_output(member.actor._actor_id.hex())
        self._members = []
