"""`StepChannels`: the streams of a job's step, created by the driver and handed to every worker.

    rollouts: engines -> reward workers          (RolloutGroup)
    scored:   reward workers -> log-prob stage   (ScoredGroup; None without a log-prob stage)
    train[r]: log-prob stage -> actor replica r  (TrainBatch; from the reward workers without a log-prob stage)

After a lost worker the driver creates a new set and gives it to the workers that stayed (`use_channels`) and to
the replacement (its constructor): a step abandoned half-way leaves nothing behind in the new channels.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlinf_pipe.channels import Channel


@dataclass
class StepChannels:
    """The step's streams (see the module docstring)."""

    rollouts: Channel
    scored: Channel | None
    train: list[Channel]

    def abort(self) -> None:
        """Stop this process's ends of the channels (before Ray goes, or when they are replaced)."""
        for channel in (self.rollouts, self.scored, *self.train):
            if channel is not None:
                channel.abort()
