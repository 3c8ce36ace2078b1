"""Recovering from a lost worker inside the run: relaunch what was lost, keep the rest.

    rollout engine r, reward worker r -> that rank, relaunched on its GPUs
    a log-prob (inference) worker     -> the inference group (its ranks share a torch.distributed world)
    an actor rank                     -> the actor group, which then loads the run's last complete checkpoint

Every other worker stays. It abandons the broken step (`Worker.abandon_step`: its channel ends are aborted and its
weight transfers cancelled, so its calls end), the driver waits until its calls have ended (`WorkerGroup.settle`),
and creates new channels, which the calls of the retried step pass (no worker holds a channel between calls). What
the runner then does with the actor's state (back to the start of the broken step, or to the checkpoint) is
`Runner.recover`'s part. Workers that do not settle in time, or a relaunch that fails, raise `RecoveryFailed`: the
runner then relaunches the whole job instead.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rlinf_pipe.errors import ClusterError, RlinfPipeError, WorkerError
from rlinf_pipe.runner.components import Components
from rlinf_pipe.runtime.worker import Worker


class RecoveryFailed(RlinfPipeError):
    """Replacing the lost workers did not work out (the others did not settle, or a relaunch failed)."""


@dataclass(frozen=True)
class LostUnit:
    """What is relaunched for a lost worker: ranks of one group."""

    group: str
    ranks: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.group} rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}"


def lost_unit(components: Components, worker: str) -> LostUnit:
    """The unit relaunched for the lost `worker` (its actor name, `rlinf_pipe:<group>:<rank>`)."""
    try:
        _, name, rank = worker.split(":")
        group = components.group(name)
        index = int(rank)
    except ValueError:
        raise RecoveryFailed(f"cannot tell which worker {worker!r} is") from None
    if name in ("actor", "inference"):  # ranks that share a torch.distributed world go together
        return LostUnit(name, tuple(range(group.size)))
    return LostUnit(name, (index,))


async def replace_unit(components: Components, unit: LostUnit, settle_s: float) -> None:
    """Kill `unit`, make every other worker abandon the step and wait until its calls ended, give everyone new
    channels, relaunch `unit` on its GPUs (see the module docstring)."""
    lost_group = components.group(unit.group)
    await asyncio.to_thread(lost_group.kill, list(unit.ranks))
    # (what the lost ranks held would keep the others waiting for their devices)
    await components.recipes.share(unit.group).forfeit([f"{unit.group}/{rank}" for rank in unit.ranks])
    survivors = [(group, [r for r in range(group.size) if group is not lost_group or r not in unit.ranks])
                 for group in components.groups()]
    survivors = [(group, ranks) for group, ranks in survivors if ranks]
    try:
        await asyncio.gather(*(group.some(ranks).call(Worker.abandon_step) for group, ranks in survivors))
        busy = await asyncio.gather(*(group.settle(settle_s) for group, _ in survivors))
    except WorkerError as exc:
        raise RecoveryFailed(f"a worker failed while the step was abandoned: {exc}") from None
    running = [f"{group.name} ranks {ranks}" for (group, _), ranks in zip(survivors, busy, strict=True) if ranks]
    if running:
        raise RecoveryFailed(f"{'; '.join(running)} still in the abandoned step after {settle_s:g} s")
    try:
        if unit.group != "actor":  # (a phase the abandoned step left open; none where the GPUs are the actor's own)
            from rlinf_pipe.workers.actor import ActorWorker

            await components.actor.all.call(ActorWorker.settle_devices)
        await components.reset_device_locks()
        components.renew_channels()  # (the calls of the retried step pass them)
        await asyncio.to_thread(components.relaunch, unit.group, list(unit.ranks))
    except (ClusterError, WorkerError) as exc:
        raise RecoveryFailed(f"relaunching {unit.describe()} failed: {exc}") from None
