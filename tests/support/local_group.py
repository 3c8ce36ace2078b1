"""`LocalGroup`: a stand-in for a `WorkerGroup` whose ranks are objects in the test's process, called through the
same verbs (`group.all.call(ActorWorker.train_step, step, src)`), so the driver's code runs unchanged against fake
workers. A call runs each rank's method at once, by the method's name, and returns a `LocalCall`: `await` it (an
async method's coroutines are awaited then) or `.wait()` it (methods that are not async)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from rlinf_pipe.runtime.verbs import method_name


class LocalCall:
    """The results of one call on some ranks; `pick` makes the call's result of them, as the real verbs do."""

    def __init__(self, results: list[Any], pick: Callable[[list[Any]], Any]):
        self.results, self.pick = results, pick

    async def _gather(self) -> Any:
        return self.pick([await r if inspect.isawaitable(r) else r for r in self.results])

    def __await__(self):
        return self._gather().__await__()

    def wait(self, timeout_s: float | None = None) -> Any:
        assert not any(inspect.isawaitable(r) for r in self.results), "await a call of an async method"
        return self.pick(self.results)


class LocalVerb:
    """Calls a method on some of a `LocalGroup`'s ranks (`sharded`: the first argument split over all of them)."""

    def __init__(self, workers: Sequence[Any], pick: Callable[[list[Any]], Any], sharded: bool = False):
        self.workers, self.pick, self.sharded = list(workers), pick, sharded

    def call(self, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> LocalCall:
        name = method_name(method)
        if self.sharded:
            batch, *rest = args
            n = len(self.workers)
            bounds = [len(batch) * d // n for d in range(n + 1)]
            results = [getattr(w, name)(list(batch[bounds[d]:bounds[d + 1]]), *rest, **kwargs)
                       for d, w in enumerate(self.workers)]
        else:
            results = [getattr(w, name)(*args, **kwargs) for w in self.workers]
        return LocalCall(results, self.pick)


class LocalGroup:
    """A group of local `workers`, one per rank, each rank its own replica; `placement` as the real group's."""

    def __init__(self, workers: Sequence[Any], placement: Any = None, name: str = "local"):
        self.workers, self.placement, self.name = list(workers), placement, name

    @property
    def all(self) -> LocalVerb:
        return LocalVerb(self.workers, list)

    @property
    def replicas(self) -> LocalVerb:
        return LocalVerb(self.workers, list)

    @property
    def sharded(self) -> LocalVerb:
        return LocalVerb(self.workers, list, sharded=True)

    def some(self, ranks: Sequence[int]) -> LocalVerb:
        return LocalVerb([self.workers[r] for r in ranks], list)

    def rank(self, rank: int) -> LocalVerb:
        return LocalVerb([self.workers[rank]], lambda results: results[0])

    def leader(self, rank: int = 0) -> LocalVerb:
        return LocalVerb(self.workers, lambda results: results[rank])
