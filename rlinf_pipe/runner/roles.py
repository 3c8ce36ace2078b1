"""The roles the driver calls that worker classes with no common base play, as protocols: a group of either class is
typed by the role (`WorkerGroup[LogprobComputing]`), and the verbs check the driver's calls against the role's
methods (`group.all.call(LogprobComputing.logprob_step, step, src, dst)`; see `rlinf_pipe.runtime.verbs`). Roles
with a base class (`WeightReceiverWorker`) are typed by it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rlinf_pipe.channels import Channel
    from rlinf_pipe.data.structs import ScoredGroup
    from rlinf_pipe.data.train_batch import TrainBatch


class LogprobComputing(Protocol):
    """A worker that computes a step's old / reference log-probs: the inference workers (`InferenceWorker`) or the
    actor (`ActorWorker`)."""

    async def logprob_step(self, step: int, src: Channel[ScoredGroup], dst: Sequence[Channel[TrainBatch]]) -> int: ...
