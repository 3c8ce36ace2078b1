"""The runner: launches a job from its config, runs its steps (`rlinf_pipe.runner.steps`), writes what it
measured, checkpoints and resumes.

    run(cfg)   # = Runner.start(cfg).run() and shutdown: plan (before Ray), launch, open weights, resume, train
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from rlinf_pipe.config.schema import Config
from rlinf_pipe.runner import checkpoints
from rlinf_pipe.runner.components import Components, launch
from rlinf_pipe.runner.devices import actor_phases
from rlinf_pipe.runner.generation import DynamicSampling, PlainGeneration, RolloutSchedule
from rlinf_pipe.runner.outputs import run_summary, step_metrics, write_pictures
from rlinf_pipe.runner.plan import plan_run
from rlinf_pipe.runner.progress import Progress
from rlinf_pipe.runner.run_dir import create_run_dir, find_resume_checkpoint, write_config
from rlinf_pipe.runner.steps import CollocatedStep, PipelineStep
from rlinf_pipe.runner.weight_sync import WeightSync
from rlinf_pipe.scheduler import traffic
from rlinf_pipe.scheduler.memory import memory_report
from rlinf_pipe.utils.metrics import MetricsWriter, json_safe
from rlinf_pipe.utils.timeline import STEP_SPAN
from rlinf_pipe.utils.tracing import Span, Tracer


log = logging.getLogger(__name__)


class Runner:
    """Runs a launched job to `runner.max_steps`; its parts are picked once from the job's `RunPlan`."""

    def __init__(self, cfg: Config, components: Components, run_dir: Path):
        self.cfg, self.c, self.run_dir = cfg, components, run_dir
        self.tracer = Tracer("driver")
        self.spans: list[Span] = []
        self.start_step = 0
        plan, c, r = components.plan, components, cfg.runner
        generation = (
            DynamicSampling(c.rollout, c.reward, c.sampling_rounds, c.sampler, cfg.algorithm.max_extra_rounds)
            if plan.dynamic_sampling else PlainGeneration(c.rollout, c.reward)
        )
        self.schedule = RolloutSchedule(generation, c.sampler, plan.staleness, r.max_steps)
        phase = actor_phases(c.actor, plan.collocated)
        self.weights = WeightSync(plan.weight_transport, plan.weight_routes, c.actor, c.weight_receivers, r.verify_weights,
                                  self.tracer, phase, plan.collocated)
        self.steps = (
            CollocatedStep(self.weights, self.schedule, c.actor, phase, r.max_steps) if plan.collocated
            else PipelineStep(self.weights, self.schedule, c.logprob_group, c.actor, r.max_steps)
        )

    @classmethod
    def start(cls, cfg: Config) -> Runner:
        """Check the plan (before Ray starts; a memory estimate that does not fit is a warning naming the keys to
        change), create the run folder, launch the job."""
        plan = plan_run(cfg)
        checkpoints.check_resume(cfg)  # a checkpoint that cannot continue this run fails here, before Ray starts
        for warning in memory_report(cfg, plan.placement).warnings():
            log.warning("memory estimate: %s (rlinf-pipe plan shows the estimate; docs/memory.md)", warning)
        run_dir = create_run_dir(cfg)
        write_config(cfg, run_dir)
        return cls(cfg, launch(cfg), run_dir)

    # --- the run -----------------------------------------------------------------------------------------------
    def run(self) -> Path:
        """Train to `runner.max_steps`; returns the run folder."""
        cfg = self.cfg.runner
        writer = MetricsWriter(self.run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project,
                               wandb_name=cfg.experiment_name)
        try:
            asyncio.run(self.train(writer))
        finally:
            writer.close()
            write_pictures(self.spans, self.run_dir, cfg.experiment_name)
        summary = run_summary(self.run_dir, self.spans)
        (self.run_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False))
        if cfg.progress:
            print(Progress.render_summary(summary, self.run_dir))
        return self.run_dir

    async def train(self, writer: MetricsWriter) -> None:
        """The run in one event loop (channel waiters live in it): open the weight transport, resume, run the
        steps, checkpoint."""
        cfg = self.cfg.runner
        await self.weights.open()
        await self.resume()
        progress = Progress(cfg.max_steps, self.start_step, enabled=cfg.progress)
        try:
            for step in range(self.start_step, cfg.max_steps):
                metrics = await self.step(step)
                writer.write(step, metrics)
                progress.update(step, metrics)
                if cfg.save_interval and (step + 1) % cfg.save_interval == 0 and step + 1 < cfg.max_steps:
                    await self.save(step + 1)
            await self.save(cfg.max_steps)
            self.spans += await self.collect_spans()  # the final checkpoint's spans
        finally:
            progress.close()

    async def step(self, step: int) -> dict[str, float]:
        """One step (see `rlinf_pipe.runner.steps`); returns its metrics."""
        sent_before = traffic.total_bytes()
        with self.tracer.span(STEP_SPAN, step=step) as args:
            outcome = await self.steps.run(step)
            args["version"] = step
        spans = await self.collect_spans()
        self.spans += spans
        return step_metrics(outcome, spans, traffic.total_bytes() - sent_before)

    async def collect_spans(self) -> list[Span]:
        spans = self.tracer.drain()
        for group in self.c.groups():
            for worker_spans in await group.all.drain_spans():
                spans.extend(worker_spans)
        return spans

    # --- checkpoints -------------------------------------------------------------------------------------------
    async def save(self, next_step: int) -> Path:
        with self.tracer.span("checkpoint", step=next_step):
            return await checkpoints.save_checkpoint(self.run_dir, next_step, self.c.actor,
                                                     self.schedule.sampler_state())

    async def resume(self) -> None:
        """Continue from `runner.resume_dir`'s checkpoint, if any: actor state, data order, next step."""
        ckpt = find_resume_checkpoint(self.cfg)
        if ckpt is None:
            return
        state = await checkpoints.load_checkpoint(ckpt, self.c.actor)
        self.c.sampler.load_state_dict(state["sampler"])
        self.start_step = int(state["next_step"])
        print(f"[rlinf_pipe] resumed from {ckpt} at step {self.start_step}")

    def shutdown(self) -> None:
        self.c.shutdown()


def run(cfg: Config) -> Path:
    """Run `cfg` end to end (starting or joining Ray, and leaving it as it was); returns the run folder."""
    runner = Runner.start(cfg)
    try:
        return runner.run()
    finally:
        runner.shutdown()


__all__ = ["Runner", "run"]
