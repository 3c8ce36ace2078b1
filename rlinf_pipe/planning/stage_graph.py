"""The step's stage graph, decided once from the run plan: each stage, the component whose workers run it, the
channels it reads and writes, and the GPU set it takes turns on. The runner creates these channels and passes
them at each stage call; `plan` prints the graph; a planner can simulate the same graph.

    generate (rollout)  prompts  -> [rollouts]
    score    (reward)   [rollouts] -> [scored]          ([train] when no stage computes log-probs)
    logprob  (inference, or the actor)  [scored] -> [train]      (only where the algorithm needs log-probs)
    train    (actor)    [train]  -> weights
"""

from __future__ import annotations

from dataclasses import dataclass

from rlinf_pipe.planning.placement import reward_placement
from rlinf_pipe.planning.run_plan import RunPlan

ROLLOUTS, SCORED, TRAIN = "rollouts", "scored", "train"


@dataclass(frozen=True)
class ChannelPlan:
    """One stream of the step: its item type, the processes that put into it, whether it is one channel per actor
    replica (`per_replica`) and whether it holds a whole step (`unbounded`: its consumer may start only once its
    producer's phase ended, or a replica waiting in the step's vote must not block its producers)."""

    name: str
    item: str
    producers: int
    per_replica: bool
    unbounded: bool


@dataclass(frozen=True)
class Stage:
    """A stage of the step: `component`'s workers read `reads` (None: the driver's prompts) and write `writes`
    (None: the trained weights); `turns_with` are the components it takes turns with on its GPUs (empty: its GPUs
    are its own, or it has none)."""

    name: str
    component: str
    reads: str | None
    writes: str | None
    turns_with: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageGraph:
    """The stages in data order and the channels between them."""

    stages: tuple[Stage, ...]
    channels: tuple[ChannelPlan, ...]

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def channel(self, name: str) -> ChannelPlan | None:
        return next((c for c in self.channels if c.name == name), None)

    def to_json(self) -> list[dict[str, object]]:
        """The stages as `plan --json` gives them, each with its channels' item types."""
        items = {c.name: c.item for c in self.channels}
        return [{"stage": s.name, "component": s.component, "reads": s.reads, "writes": s.writes,
                 "reads_item": items.get(s.reads or ""), "writes_item": items.get(s.writes or ""),
                 "turns_with": list(s.turns_with)} for s in self.stages]

    def describe(self) -> list[str]:
        """One line per stage, as `plan` prints it."""
        lines = []
        for s in self.stages:
            turns = f"; takes turns on its GPUs with {', '.join(s.turns_with)}" if s.turns_with else ""
            lines.append(f"{s.name:<8} {s.component:<9} {f'[{s.reads}]' if s.reads else 'prompts':<10} -> "
                         f"{f'[{s.writes}]' if s.writes else 'weights'}{turns}")
        return lines


def stage_graph(plan: RunPlan) -> StageGraph:
    """The graph of `plan`'s step (see the module docstring)."""
    comps = plan.placement.components
    reward_processes = len(reward_placement(plan.placement).processes)
    logprob = plan.logprob_component
    turns = plan.turns
    stages = [Stage("generate", "rollout", None, ROLLOUTS, turns.get("rollout", ())),
              Stage("score", "reward", ROLLOUTS, SCORED if logprob else TRAIN)]
    if logprob is not None:
        stages.append(Stage("logprob", logprob, SCORED, TRAIN, turns.get(logprob, ())))
    stages.append(Stage("train", "actor", TRAIN, None, turns.get("actor", ())))
    unbounded = plan.buffers_steps
    channels = [ChannelPlan(ROLLOUTS, "RolloutGroup", len(comps["rollout"].processes), False, unbounded)]
    if logprob is not None:
        channels.append(ChannelPlan(SCORED, "ScoredGroup", reward_processes, False, unbounded))
    feeders = comps[logprob].dp if logprob else reward_processes
    channels.append(ChannelPlan(TRAIN, "TrainBatch", feeders, True, True))
    return StageGraph(tuple(stages), tuple(channels))
