"""The verbs of a `WorkerGroup`: which ranks a call goes to and what it returns, typed by the worker's method.

A verb's `call` takes the worker class's method itself (`ActorWorker.train_step`), then that method's arguments, so
a type checker sees the call: a method the workers do not have, an argument they do not take or the wrong type of
one fails `mypy`, and the result has the method's return type (an `async def` method's: what it returns when
awaited).

    ListVerb    `group.all`, `group.some(ranks)`, `group.replicas`: GroupCall[list[R]], one result per rank called
                (per data-parallel replica for `replicas`)
    OneVerb     `group.rank(i)`, `group.leader(i)`: GroupCall[R]
    ShardedVerb `group.sharded`: the method's first argument is split into one contiguous shard per replica;
                GroupCall[list[R]], one result per replica

The call goes to each rank's actor by the method's name, so a subclass's override of a base class's method (the
worker's `on_abandon`, `before_stop`) runs, as for any Python call. An argument other than a number, a string or
None that goes to several ranks is put into Ray's object store once and shared by reference.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

import ray

from rlinf_pipe.channels import traffic
from rlinf_pipe.runtime.group_call import CallingGroup, GroupCall, Member

W_co = TypeVar("W_co", covariant=True)  # the group's worker class (or a protocol its workers follow)
P = ParamSpec("P")
R = TypeVar("R")
X = TypeVar("X")  # an item of what a sharded call splits (each replica's method gets a list of them)

_INLINE = (int, float, bool, str, bytes, type(None))


class VerbGroup(CallingGroup, Protocol):
    """What a verb needs of its group (a `WorkerGroup`): its replicas, to shard, and its in-flight calls."""

    @property
    def dp_size(self) -> int: ...

    def dp_rank_of(self, rank: int) -> int: ...

    def shards(self, batch: Sequence[Any]) -> list[list[Any]]: ...

    def track(self, members: Sequence[Member], refs: Sequence[Any]) -> None: ...


def _shared(value: Any) -> Any:
    """`value` as an argument for several ranks: put into the object store once unless it is a plain scalar."""
    return value if isinstance(value, _INLINE) else ray.put(value)


def method_name(method: Callable[..., Any]) -> str:
    """The name a verb calls `method` by on each rank's actor: a public method of the worker class."""
    name = getattr(method, "__name__", "")
    if not name.isidentifier() or name.startswith("_"):
        raise TypeError(f"a verb calls a public method of the worker class (e.g. `ActorWorker.train_step`), not "
                        f"{method!r}")
    return name


class _Verb(Generic[W_co]):
    """Sends one method call to `members`; `pick` turns their results (in member order) into the call's result."""

    def __init__(self, group: VerbGroup, members: Sequence[Member], pick: Callable[[list[Any]], Any]):
        self._group, self._members, self._pick = group, list(members), pick

    def _send(self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              sharded: bool = False) -> GroupCall[Any]:
        name = method_name(method)
        members, group = self._members, self._group
        traffic.record(traffic.payload_bytes((args, kwargs)))
        shards: list[Any] = []
        if sharded:
            batch, *rest = args
            args = tuple(rest)
            shards = group.shards(batch)
            if len(members) > group.dp_size:  # several ranks per replica: one copy of each shard
                shards = [_shared(shard) for shard in shards]
        if len(members) > 1:
            args = tuple(_shared(a) for a in args)
            kwargs = {k: _shared(v) for k, v in kwargs.items()}
        refs = [
            getattr(m.actor, name).remote(*([shards[group.dp_rank_of(m.rank)]] if sharded else []), *args, **kwargs)
            for m in members
        ]
        group.track(members, refs)
        return GroupCall(group, name, members, refs, self._pick)


# Each verb's `call` has two overloads, tried in order: an `async def` method (its result is what it returns when
# awaited), then any other.
class ListVerb(_Verb[W_co]):
    """Calls several ranks; the result is a list (see the module docstring)."""

    @overload
    def call(
        self, method: Callable[Concatenate[W_co, P], Coroutine[Any, Any, R]], /, *args: P.args, **kwargs: P.kwargs
    ) -> GroupCall[list[R]]: ...

    @overload
    def call(self, method: Callable[Concatenate[W_co, P], R], /, *args: P.args,
             **kwargs: P.kwargs) -> GroupCall[list[R]]: ...

    def call(self, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> GroupCall[Any]:
        """Call `method(*args, **kwargs)` on each of the verb's ranks."""
        return self._send(method, args, kwargs)


class OneVerb(_Verb[W_co]):
    """Calls one rank, or every rank with one rank's result (see the module docstring)."""

    @overload
    def call(
        self, method: Callable[Concatenate[W_co, P], Coroutine[Any, Any, R]], /, *args: P.args, **kwargs: P.kwargs
    ) -> GroupCall[R]: ...

    @overload
    def call(self, method: Callable[Concatenate[W_co, P], R], /, *args: P.args, **kwargs: P.kwargs) -> GroupCall[R]: ...

    def call(self, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> GroupCall[Any]:
        """Call `method(*args, **kwargs)` on each of the verb's ranks."""
        return self._send(method, args, kwargs)


class ShardedVerb(_Verb[W_co]):
    """Calls every rank, each replica with its shard of `batch` (a list) as the method's first argument."""

    @overload
    def call(
        self, method: Callable[Concatenate[W_co, list[X], P], Coroutine[Any, Any, R]], batch: Sequence[X], /,
        *args: P.args, **kwargs: P.kwargs,
    ) -> GroupCall[list[R]]: ...

    @overload
    def call(self, method: Callable[Concatenate[W_co, list[X], P], R], batch: Sequence[X], /, *args: P.args,
             **kwargs: P.kwargs) -> GroupCall[list[R]]: ...

    def call(self, method: Callable[..., Any], batch: Sequence[Any], /, *args: Any, **kwargs: Any
             ) -> GroupCall[Any]:
        """Call `method(shard, *args, **kwargs)` on every rank, `shard` its replica's part of `batch`."""
        return self._send(method, (batch, *args), kwargs, sharded=True)
