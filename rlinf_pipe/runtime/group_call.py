"""The calls a `WorkerGroup`'s verbs make: `Verb` sends a method call to some of the group's ranks, `GroupCall`
gathers their results (`await` or `.wait()`), turning a remote failure into one `WorkerError` that names the
group, rank, node and GPUs (a `WorkerLost` when the rank's process is gone)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from rlinf_pipe.errors import ConfigError, UserCodeError, WorkerError
from rlinf_pipe.channels import traffic
from rlinf_pipe.utils.worker_death import ANSI_ESCAPES, CALL_FAILED, GONE, death_cause
from rlinf_pipe.planning.gpu_ids import format_ids
from rlinf_pipe.planning.placement import ProcessPlacement

_INLINE = (int, float, bool, str, bytes, type(None))


@dataclass(frozen=True)
class Member:
    rank: int
    process: ProcessPlacement
    actor: Any
    name: str

    def where(self) -> str:
        gpus = format_ids(self.process.global_gpus) if self.process.global_gpus else "none"
        return f"node {self.process.node_rank}, GPUs {gpus}"


class GroupCall:
    """A call running on some ranks of a group. `await call` or `call.wait(timeout_s)` gives its result: what the
    verb makes of the ranks' results (see the module docstring)."""

    def __init__(self, group: Any, method: str, members: Sequence[Member], refs: Sequence[Any],
                 pick: Callable[[list[Any]], Any]):
        self.group, self.method, self.members, self.refs, self.pick = group, method, list(members), list(refs), pick

    def wait(self, timeout_s: float | None = None) -> Any:
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
                self.drain_finished(pending)
                raise
        return self.pick([self._result(ref) for ref in self.refs])

    @staticmethod
    def drain_finished(pending: list[Any]) -> None:
        """Fetch the other ranks' finished errors so Ray does not log each of them again as unhandled."""
        finished, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for ref in finished:
            try:
                ray.get(ref)
            except CALL_FAILED:
                pass

    async def _gather(self) -> Any:
        tasks = [asyncio.ensure_future(self._await_one(ref)) for ref in self.refs]
        try:
            return self.pick(list(await asyncio.gather(*tasks)))
        finally:
            for task in tasks:
                task.cancel()

    def __await__(self):
        return self._gather().__await__()

    async def _await_one(self, ref: Any) -> Any:
        try:
            return await ref
        except CALL_FAILED as exc:
            raise self._error(ref, exc) from None

    def _result(self, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except CALL_FAILED as exc:
            raise self._error(ref, exc) from None

    def _error(self, ref: Any, exc: Exception) -> WorkerError:
        member = self.members[self.refs.index(ref)]
        head = f"{self.group.name} rank {member.rank} ({member.where()}) in {self.method}()"
        remote = ANSI_ESCAPES.sub("", str(exc))
        if isinstance(exc, RayActorError) and exc.actor_init_failed:
            last_line = remote.strip().splitlines()[-1]
            return WorkerError(
                f"{self.group.name} rank {member.rank} ({member.where()}) failed in its constructor: {last_line}"
                f"\n--- remote traceback ---\n{remote}"
            )
        if isinstance(exc, GONE):
            return self.group.died(member, head, death_cause(exc))
        if isinstance(getattr(exc, "cause", None), (ConfigError, UserCodeError)):  # (its message says it all)
            return WorkerError(f"{head}: {exc.cause}")
        return WorkerError(f"{head} raised {type(exc.cause).__name__}: {exc.cause}\n--- remote traceback ---\n{remote}")


def _shared(value: Any) -> Any:
    """`value` as an argument for several ranks: put into the object store once unless it is a plain scalar."""
    return value if isinstance(value, _INLINE) else ray.put(value)


class Verb:
    """Calls methods of the worker class on `members`; `pick` turns their results into the call's result.
    `sharded`: the first argument is split into one contiguous shard per data-parallel replica."""

    def __init__(self, group: Any, members: Sequence[Member], pick: Callable[[list[Any]], Any],
                 sharded: bool = False):
        self._group, self._members, self._pick, self._sharded = group, list(members), pick, sharded

    def __getattr__(self, method: str) -> Callable[..., GroupCall]:
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args: Any, **kwargs: Any) -> GroupCall:
            members, group = self._members, self._group
            traffic.record(traffic.payload_bytes((args, kwargs)))
            shards: list[Any] = []
            if self._sharded:
                batch, *rest = args
                args = tuple(rest)
                shards = group._shards(batch)
                if len(members) > group.dp_size:  # several ranks per replica: one copy of each shard
                    shards = [_shared(shard) for shard in shards]
            if len(members) > 1:
                args = tuple(_shared(a) for a in args)
                kwargs = {k: _shared(v) for k, v in kwargs.items()}
            refs = [
                getattr(m.actor, method).remote(*([shards[group.dp_rank_of(m.rank)]] if self._sharded else []),
                                                *args, **kwargs)
                for m in members
            ]
            group._track(members, refs)
            return GroupCall(group, method, members, refs, self._pick)

        return call
