"""The runner: launches a job from its config, runs its steps (`rlinf_pipe.runner.steps`), writes what it
measured, checkpoints and resumes.

    runner = Runner.start(cfg)   # prepare (plan, resume check, run folder, prompts), launch, open weights
    runner.run(); runner.shutdown()   # resume, train, write what was measured

`rlinf_pipe.runner.run(cfg)` does the same with the preparation beside Ray's start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from rlinf_pipe.config.schema import Config
from rlinf_pipe.engines.rollout.factory import sampling_params
from rlinf_pipe.errors import OutputError, RunStopped, WorkerError, WorkerLost
from rlinf_pipe.runner import checkpoints
from rlinf_pipe.runner.clocks import NodeClocks
from rlinf_pipe.runner.components import Components, launch
from rlinf_pipe.runner.cpu_shares import CpuLending, cpu_stages, lends_cpus
from rlinf_pipe.runner.devices import actor_phases
from rlinf_pipe.runner.generation import DynamicSampling, PlainGeneration, RolloutSchedule
from rlinf_pipe.runner.health import Health
from rlinf_pipe.runner.outputs import previous_spans, run_summary, step_metrics, write_pictures
from rlinf_pipe.runner.prepare import PreparedRun, prepare_run
from rlinf_pipe.runner.progress import Progress
from rlinf_pipe.runner.recovery import RecoveryFailed, lost_unit, replace_unit
from rlinf_pipe.runner.run_dir import record_event
from rlinf_pipe.runner.steps import Step
from rlinf_pipe.runner.stop import StepAbandoned, StopSignals
from rlinf_pipe.runner.validation import Validation
from rlinf_pipe.runner.weight_sync import WeightSync
from rlinf_pipe.runner.workers_record import record_workers
from rlinf_pipe.channels import traffic
from rlinf_pipe.runtime.cluster import Cluster
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.utils.metrics import MetricsWriter, WandbRun, json_safe
from rlinf_pipe.utils.profiling import PROFILE_DIR, write_profile
from rlinf_pipe.utils.timeline import STEP_SPAN
from rlinf_pipe.utils.tracing import Span, Tracer
from rlinf_pipe.workers.actor import ActorWorker
from rlinf_pipe.workers.weight_receiver import WeightReceiverWorker


log = logging.getLogger(__name__)


class Runner:
    """Runs a launched job to `runner.max_steps`; its parts are picked once from the job's `RunPlan`, and again
    after a restart relaunched the job's workers."""

    def __init__(self, cfg: Config, components: Components, run_dir: Path, resume_from: Path | None = None,
                 stop: StopSignals | None = None):
        self.cfg, self.run_dir, self.resume_from = cfg, run_dir, resume_from
        self.tracer = Tracer("driver")
        self.spans: list[Span] = previous_spans(run_dir)
        self.start_step = 0
        self.last_checkpoint: Path | None = None  # what a restart continues from
        self.restarts: list[dict] = []
        self.stop = stop or StopSignals(cfg.runner.stop_grace_s)
        self.abandoned = False  # a step was cut short by a stop: the actor's state is no step's end
        self.health = Health(lambda: self.c.groups(), cfg.runner.heartbeat_timeout_s)
        self.initial_sampler = components.sampler.state_dict()  # a recovery with no checkpoint goes back here
        self.sampler_at_step = self.initial_sampler  # ... and one that retries a step, to its start
        self.clocks = NodeClocks(components.cluster.driver_node())
        self.assemble(components)

    def assemble(self, components: Components) -> None:
        """Take the job's parts from its (re)launched components."""
        plan, c, cfg, r = components.plan, components, self.cfg, self.cfg.runner
        self.c = components
        generation = (
            DynamicSampling(c.rollout, c.reward, lambda: c.channels, c.sampling_rounds, c.sampler,
                            cfg.algorithm.max_extra_rounds, c.balancer)
            if plan.dynamic_sampling else PlainGeneration(c.rollout, c.reward, lambda: c.channels, c.arrival_slots,
                                                          c.balancer)
        )
        self.schedule = RolloutSchedule(generation, c.sampler, plan.staleness, r.max_steps)
        phase = actor_phases(c.actor, plan.engines_share_actor)
        self.weights = WeightSync(plan.weight_transport, plan.weight_routes, c.actor, c.weight_receivers,
                                  r.verify_weights, self.tracer, phase, plan.engines_share_actor,
                                  plan.inference_shares_rollout)
        self.validation = Validation(c.val_prompts, r.val_interval, r.val_before_train, r.max_steps, r.val_k,
                                     sampling_params(cfg.rollout, r.val_k), r.seed, self.run_dir)
        lending = (CpuLending(c.stages(cpu_stages(cfg))) if lends_cpus(cfg, plan.staleness, plan.engines_share_actor)
                   else None)
        self.steps = Step(self.weights, self.schedule, lambda: c.channels, c.logprob_group, c.actor, phase,
                          plan.engines_share_actor, r.max_steps, lending,
                          starts_itself=lambda step: step in r.profile_steps or self.validation.due(step))

    @classmethod
    def start(cls, cfg: Config, stop: StopSignals | None = None, cluster: Cluster | None = None,
              prepared: PreparedRun | None = None) -> Runner:
        """Launch the job `prepare_run` readied (it runs here unless `prepared` is given: the plan is checked before
        Ray starts), on `cluster` if given (its owner shuts it down), else on a Ray started or joined here."""
        prepared = prepared or prepare_run(cfg)
        stop = stop or StopSignals(cfg.runner.stop_grace_s)
        components = launch(cfg, prepared.inputs, cluster, on_connect=stop.reinstall, run_dir=prepared.run_dir,
                            resume_from=prepared.resume_from)
        return cls(cfg, components, prepared.run_dir, prepared.resume_from, stop)

    # --- the run -----------------------------------------------------------------------------------------------
    def run(self) -> Path:
        """Train to `runner.max_steps`; returns the run folder. A stop signal raises `RunStopped` once the run's
        outputs are written."""
        cfg = self.cfg.runner
        wandb_run = None if cfg.wandb_project is None else WandbRun(
            cfg.wandb_project, cfg.wandb_entity, cfg.wandb_run_name or cfg.experiment_name,
            tuple(cfg.wandb_tags))
        writer = MetricsWriter(self.run_dir, tensorboard=cfg.tensorboard, wandb_run=wandb_run)
        try:
            asyncio.run(self.train(writer))
            record_workers(self.c.groups(), self.run_dir)
        except RunStopped:
            self.write_summary(quiet=True)
            raise
        except OSError as exc:  # the driver's own writes: metrics, runner state
            raise OutputError(f"cannot write the run's outputs in {self.run_dir}: {exc}; "
                              f"{self.resume_hint()}") from None
        finally:
            writer.close()
            self.spans += self.tracer.drain()  # a failed step's driver spans
            self.write_pictures()
        summary = self.write_summary()
        if cfg.progress:
            print(Progress.render_summary(summary, self.run_dir))
        return self.run_dir

    def write_pictures(self) -> None:
        """timeline.json, timeline.png and reward.png. A failure to write them (a full disk) is logged, not raised:
        it must not hide the error that ended the run."""
        try:
            write_pictures(self.spans, self.run_dir, self.cfg.runner.experiment_name)
        except OSError as exc:
            log.error("could not write the timeline and pictures in %s: %s", self.run_dir, exc)

    def write_summary(self, quiet: bool = False) -> dict:
        """summary.json; returns it. `quiet`: a failure to write it is logged, not raised."""
        summary = run_summary(self.run_dir, self.spans)
        try:
            (self.run_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False))
        except OSError as exc:
            if not quiet:
                raise OutputError(f"cannot write the run's outputs in {self.run_dir}: {exc}") from None
            log.error("could not write %s: %s", self.run_dir / "summary.json", exc)
        return summary

    def resume_hint(self) -> str:
        if self.last_checkpoint is None:
            return "no checkpoint was saved in this run"
        return f"the last complete checkpoint is {self.last_checkpoint}: free space, then resume from it"

    async def train(self, writer: MetricsWriter) -> None:
        """The run in one event loop (channel waiters live in it): open the weight transport, resume, run the
        steps (restarting after a lost worker, stopping on a signal), checkpoint."""
        cfg = self.cfg.runner
        self.stop.attach(asyncio.get_running_loop())
        await self.weights.open()
        step = self.start_step = await self.resume(self.resume_from, announce=True)
        writer.truncate(step)
        progress = Progress(cfg.max_steps, step, enabled=cfg.progress)
        try:
            while step < cfg.max_steps and not self.stop.requested:
                try:
                    self.sampler_at_step = self.schedule.sampler_state()  # (before prompts drawn ahead)
                    metrics = await self.stop.or_abandon(self.health.guard(self.validate(step)))
                    metrics |= await self.stop.or_abandon(self.health.guard(self.step(step)))
                    if (round_trip := self.health.take_round_trip_s()) is not None:
                        metrics["timing/call_round_trip"] = round_trip
                    writer.write(step, metrics)
                    progress.update(step, metrics)
                    step += 1
                    if cfg.save_interval and step % cfg.save_interval == 0 and step < cfg.max_steps:
                        await self.health.guard(self.save(step))
                except WorkerLost as lost:
                    if self.stop.requested:  # a signal to the whole process group also reaches the workers
                        self.abandoned = True
                        break
                    step = await self.recover(lost, step)
                    writer.truncate(step)
                    progress.rewind(step)
                except StepAbandoned:
                    self.abandoned = True
                    break
            if self.stop.requested and step < cfg.max_steps:
                await self.stop_run(step)
            if step == cfg.max_steps and self.validation.due(step):  # the weights the last step trained
                writer.write(step, await self.health.guard(self.validate(step)))
            await self.health.guard(self.save(cfg.max_steps))
            self.spans += await self.collect_spans()  # the final checkpoint's spans
        finally:
            self.stop.detach()
            progress.close()

    async def step(self, step: int) -> dict[str, float]:
        """One step (see `rlinf_pipe.runner.steps`), profiled if `runner.profile_steps` names it; its metrics."""
        profiled = step in self.cfg.runner.profile_steps
        if profiled:
            await asyncio.gather(*(group.all.call(Worker.start_profile, step) for group in self.c.groups()))
        sent_before = traffic.total_bytes()
        started = time.time()
        try:
            outcome = await self.steps.run(step)
        except BaseException:
            self.tracer.add("failed_step", started, time.time(), step=step)
            raise
        if profiled:
            await self.write_profiles(step)
        self.tracer.add(STEP_SPAN, started, time.time(), step=step, version=step,
                        generation_started_ahead=outcome.started_ahead)
        spans = await self.collect_spans()
        self.spans += spans
        return {**step_metrics(outcome, spans, traffic.total_bytes() - sent_before),
                "runner/restarts": float(len(self.restarts))}

    async def write_profiles(self, step: int) -> None:
        """Stop every worker's profiler and write its trace into `<run dir>/profile/`."""
        groups = self.c.groups()
        with self.tracer.span("write_profiles", step=step):
            stopped = await asyncio.gather(*(g.all.call(Worker.stop_profile) for g in groups))
            for group, results in zip(groups, stopped, strict=True):
                for rank, (proc, result) in enumerate(zip(group.placement.processes, results, strict=True)):
                    write_profile(self.run_dir / PROFILE_DIR, f"{group.name}/{rank}", step, result,
                                  self.clocks.offsets.get(proc.node_rank, 0.0))

    async def validate(self, step: int) -> dict[str, float]:
        """Evaluate version `step` if `runner.val_interval` says so (`rlinf_pipe.runner.validation`); its metrics."""
        if not self.validation.due(step):
            return {}
        return await self.validation.run(step, self.c.rollout, self.c.reward, self.weights, self.schedule,
                                         self.tracer)

    async def collect_spans(self) -> list[Span]:
        """Every worker's spans since the last call, on the driver's clock (`rlinf_pipe.runner.clocks`)."""
        if self.clocks.due():
            for warning in await self.clocks.measure(self.c.groups()):
                log.warning(warning)
        spans = self.tracer.drain()
        for group in self.c.groups():
            drained = await group.all.call(Worker.drain_spans)
            for proc, worker_spans in zip(group.placement.processes, drained, strict=True):
                spans.extend(self.clocks.align(worker_spans, proc.node_rank))
        return spans

    # --- checkpoints, restarts, stops --------------------------------------------------------------------------
    async def save(self, next_step: int) -> Path:
        """Checkpoint the state before step `next_step`. A save that fails for another reason than a lost worker
        (a full disk) ends the run naming the last complete checkpoint; its partial folder is removed."""
        try:
            with self.tracer.span("checkpoint", step=next_step):
                saved = await checkpoints.save_checkpoint(self.run_dir, next_step, self.c.actor,
                                                          self.schedule.sampler_state())
        except WorkerLost:
            raise
        except (WorkerError, OSError) as exc:
            lost = await self.health.find_lost() if isinstance(exc, WorkerError) else []
            if lost:  # a rank failed because another one is gone: a loss, which a restart may mend
                raise lost[0] from exc
            checkpoints.remove_partial(self.run_dir, next_step)
            cause = str(exc).strip().splitlines()[0]
            raise OutputError(f"cannot save the checkpoint before step {next_step} in {self.run_dir}: {cause}; "
                              f"{self.resume_hint()}") from None
        self.last_checkpoint = saved
        for old in checkpoints.prune_checkpoints(self.run_dir, self.cfg.runner.keep_checkpoints, saved):
            log.info("removed checkpoint %s (runner.keep_checkpoints: %d)", old, self.cfg.runner.keep_checkpoints)
        return saved

    async def resume(self, ckpt: Path | None, announce: bool = False) -> int:
        """Continue from checkpoint `ckpt` (None: from the start): actor state, data order; returns the next
        step."""
        if ckpt is None:
            self.c.sampler.load_state_dict(self.initial_sampler)
            return 0
        state = await checkpoints.load_checkpoint(ckpt, self.c.actor)
        self.c.sampler.load_state_dict(state["sampler"])
        self.last_checkpoint = ckpt
        if announce:
            record_event(self.run_dir, "resume", step=int(state["next_step"]), checkpoint=str(ckpt))
            print(f"[rlinf_pipe] resumed from {ckpt} at step {state['next_step']}")
        return int(state["next_step"])

    async def recover(self, lost: WorkerLost, step: int) -> int:
        """After `lost`: relaunch what was lost on the same GPUs, keep the other workers (`rlinf_pipe.runner.recovery`)
        and continue. A lost engine, reward or log-prob worker: step `step` is retried from the actor's state before
        it. A lost actor: the run continues from its last complete checkpoint (the start, before the first). With
        rollout running ahead (`runner.max_staleness`), for a lost member of a weight group SGLang's ranks joined,
        or when replacing does not work out, every worker is relaunched and the run continues from the checkpoint.
        Returns the step to continue at; with `runner.max_restarts` spent, raises `lost`."""
        limit = self.cfg.runner.max_restarts
        if len(self.restarts) >= limit:
            if limit:
                raise WorkerLost(lost.worker, lost.where, lost.how,
                                 f"runner.max_restarts={limit} restarts are spent; the run stops here") from lost
            raise lost
        started = time.time()
        self.spans += self.tracer.drain()  # the failed step's driver spans
        ckpt = self.last_checkpoint
        unit = None if self.c.plan.staleness else lost_unit(self.c, lost.worker)
        if unit is not None and self.weights.native and unit.group in ("actor", *self.c.weight_receivers):
            # SGLang's ranks share the lost worker's weight group: a version in flight never completes on their
            # devices (an NCCL collective), and sglang has no way to abort the group, so the engines go too
            unit = None
        log.warning("worker %s %s (%s) in step %d: restart %d of %d, relaunching %s on the same GPUs", lost.worker,
                    lost.how, lost.where, step, len(self.restarts) + 1, limit,
                    unit.describe() if unit else "every worker")
        if unit is not None:
            try:
                await replace_unit(self.c, unit, self.cfg.runner.heartbeat_timeout_s)
            except RecoveryFailed as exc:
                log.warning("replacing %s did not work out (%s): relaunching every worker", unit.describe(), exc)
                unit = None
        if unit is None:
            self.c.stop_workers()
            self.c = await asyncio.to_thread(launch, self.cfg, None, self.c.cluster)
        self.assemble(self.c)
        await self.weights.open()
        if unit is not None and unit.group != "actor":  # the actor stayed: back to where the step began
            restored = await self.c.actor.all.call(ActorWorker.rollback, step)
            self.c.sampler.load_state_dict(self.sampler_at_step)
            resumed, origin = step, "the actor's state before the step" if any(restored) else "the actor's state"
        else:
            if unit is not None:  # the engines stayed, with newer weights than the checkpoint's
                await asyncio.gather(*(group.all.call(WeightReceiverWorker.rewind_weights)
                                       for group in self.c.weight_receivers.values()))
            resumed, origin = await self.resume(ckpt), str(ckpt or "the start")
        seconds = time.time() - started
        relaunched = unit.describe() if unit else "every worker"
        self.tracer.add("restart", started, time.time(), step=step, worker=lost.worker, how=lost.how,
                        resumed_at=resumed, relaunched=relaunched)
        self.restarts.append(record_event(self.run_dir, "restart", step=step, worker=lost.worker, how=lost.how,
                                          where=lost.where, relaunched=relaunched, resumed_at=resumed,
                                          resumed_from=origin, seconds=seconds))
        log.warning("restart %d of %d took %.1f s; continuing at step %d from %s", len(self.restarts), limit,
                    seconds, resumed, origin)
        return resumed

    async def stop_run(self, step: int) -> None:
        """After a stop signal: save if asked (and the last step finished), record the stop, raise `RunStopped`
        with where the run stopped and how to resume."""
        cfg = self.cfg.runner
        if cfg.save_on_signal and not self.abandoned and step > self.start_step and (
                self.last_checkpoint is None or checkpoints.step_of(self.last_checkpoint) != step):
            await self.health.guard(self.save(step))
            self.spans += await self.collect_spans()
        record_event(self.run_dir, "stop", signal=self.stop.name, step=step,
                     checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None)
        if self.last_checkpoint is not None:
            resume = (f"checkpoint {self.last_checkpoint} (step {checkpoints.step_of(self.last_checkpoint)}); resume "
                      f"with the same command and runner.resume_dir={self.last_checkpoint}")
        else:
            resume = "no checkpoint was saved (runner.save_on_signal / runner.save_interval); a rerun starts fresh"
        raise RunStopped(self.stop.signum or 0, f"stopped by {self.stop.name} before step {step} of "
                                                f"{cfg.max_steps} ({step - self.start_step} trained in this run); "
                                                f"{resume}. Outputs: {self.run_dir}")

    def shutdown(self) -> None:
        self.c.shutdown()


__all__ = ["Runner"]
