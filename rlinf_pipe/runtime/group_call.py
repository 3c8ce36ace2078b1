"""The calls a `WorkerGroup`'s verbs make (`rlinf_pipe.runtime.verbs`): `GroupCall` gathers the ranks' results
(`await` or `.wait()`), turning a remote failure into one `WorkerError` that names the group, rank, node and GPUs (a
`WorkerLost` when the rank's process is gone)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import ray
from ray.exceptions import RayActorError

from rlinf_pipe.errors import ConfigError, UserCodeError, WorkerError, WorkerLost
from rlinf_pipe.utils.worker_death import ANSI_ESCAPES, CALL_FAILED, GONE, death_cause
from rlinf_pipe.planning.gpu_ids import format_ids
from rlinf_pipe.planning.placement import ProcessPlacement

T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Member:
    """One rank of a group: its placement and its Ray actor (`name`: the actor's name)."""

    rank: int
    process: ProcessPlacement
    actor: Any
    name: str

    def where(self) -> str:
        gpus = format_ids(self.process.global_gpus) if self.process.global_gpus else "none"
        return f"node {self.process.node_rank}, GPUs {gpus}"


class CallingGroup(Protocol):
    """What a call needs of its group: its name, and how to word the loss of a rank (`WorkerGroup.died`)."""

    @property
    def name(self) -> str: ...

    def died(self, member: Member, where: str, detail: str) -> WorkerLost: ...


class GroupCall(Generic[T_co]):
    """A call running on some ranks of a group. `await call` or `call.wait(timeout_s)` gives its result: what the
    verb makes of the ranks' results (`pick`; see `rlinf_pipe.runtime.verbs`)."""

    def __init__(self, group: CallingGroup, method: str, members: Sequence[Member], refs: Sequence[Any],
                 pick: Callable[[list[Any]], T_co]):
        self.group, self.method, self.members, self.refs, self.pick = group, method, list(members), list(refs), pick

    def wait(self, timeout_s: float | None = None) -> T_co:
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

    async def _gather(self) -> T_co:
        tasks = [asyncio.ensure_future(self._await_one(ref)) for ref in self.refs]
        try:
            return self.pick(list(await asyncio.gather(*tasks)))
        finally:
            for task in tasks:
                task.cancel()

    def __await__(self) -> Generator[Any, None, T_co]:
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
        cause = getattr(exc, "cause", None)  # (a RayTaskError's: the remote exception)
        if isinstance(cause, (ConfigError, UserCodeError)):  # (its message says it all)
            return WorkerError(f"{head}: {cause}")
        return WorkerError(f"{head} raised {type(cause).__name__}: {cause}\n--- remote traceback ---\n{remote}")
