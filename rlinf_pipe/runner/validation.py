"""Periodic validation (`runner.val_interval`): the rollout engines generate on the held-out prompts between steps,
the reward workers judge, the driver counts (`rlinf_pipe.engines.evaluation`).

Validation at step s evaluates version s (the weights after s steps), before step s trains: the engines load
version s (the step's own weight sync then has nothing left to do), and with `runner.max_staleness` 1 they first
finish the rollouts they started ahead. It draws nothing from the training sampler, so training is the same with or
without it. Its metrics join step s's row of metrics.jsonl; the evaluation after the last step has a row of its own.
Each problem's responses go to `<run dir>/validation.jsonl`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from rlinf_pipe.data.structs import PromptItem
from rlinf_pipe.engines.evaluation import eval_metrics, eval_problems, eval_requests, score_pairs, write_problems
from rlinf_pipe.engines.rollout.engine import SamplingParams
from rlinf_pipe.runner.generation import RolloutSchedule
from rlinf_pipe.runner.weight_sync import WeightSync
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.workers.reward import RewardWorker
from rlinf_pipe.workers.rollout import RolloutWorker
from rlinf_pipe.utils.tracing import Tracer

PROBLEMS_FILE = "validation.jsonl"


@dataclass
class Validation:
    """When to validate and how (see the module docstring)."""

    prompts: list[PromptItem]
    interval: int
    before_train: bool
    max_steps: int
    k: int
    sampling: SamplingParams
    seed: int
    run_dir: Path

    def due(self, step: int) -> bool:
        """Whether the weights of version `step` are evaluated."""
        if not self.interval and not self.before_train:
            return False
        if step == 0:
            return self.before_train
        return bool(self.interval) and (step % self.interval == 0 or step == self.max_steps)

    async def run(self, step: int, rollout: WorkerGroup[RolloutWorker], reward: WorkerGroup[RewardWorker],
                  weights: WeightSync, schedule: RolloutSchedule, tracer: Tracer) -> dict[str, float]:
        """Evaluate version `step` on the engines; returns the `val/*` metrics and appends the problems' records."""
        await schedule.engines_idle()
        await weights.sync(version=step)
        with tracer.span("validate", step=step, problems=len(self.prompts)):
            requests = eval_requests(self.prompts, self.sampling, self.k, self.seed)
            outputs = list(itertools.chain.from_iterable(
                await rollout.sharded.call(RolloutWorker.evaluate, requests, step)))
            pairs = score_pairs(self.prompts, outputs)
            correct = list(itertools.chain.from_iterable(await reward.sharded.call(RewardWorker.judge, pairs)))
        problems = eval_problems(self.prompts, outputs, correct)
        write_problems(self.run_dir / PROBLEMS_FILE, problems, step=step)
        return eval_metrics(problems, self.k)
