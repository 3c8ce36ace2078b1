"""The one runner for both modes. A step, as `Runner.step` reads:

    sync weights (actor -> engines [+ log-prob workers]), version = step
    prompts -> rollout -> [rollouts] -> reward + advantages -> [scored] -> log-probs -> [train] -> actor

With `algorithm.dynamic_sampling` the driver sits between reward and log-probs: it keeps the scored groups whose
rewards are not all equal (into [kept]) and draws more prompts, round by round, until the batch is full.

Disaggregated pipeline: every stage runs at once on its own GPUs and the channels stream between them, so
generation, scoring, log-probs and training overlap inside the step. Collocated (`actor,rollout: all`): the
same calls, but the rollout phase finishes before the actor phase starts, each holding the device lock of its
GPUs (wake/generate/sleep, then onload/log-probs/train/offload); the channels buffer a whole step.
The driver routes training micro-batches to the actor's data-parallel replicas and steps the optimizer at each
mini-batch boundary; loss normalisation is exact however the batch was split (see docs/pipeline.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from rlinf_pipe.algorithms.filters import DynamicSampler, adaptive_oversample
from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.structs import PromptItem, TrainBatch
from rlinf_pipe.runner.progress import Progress
from rlinf_pipe.runner.run_dir import (
    checkpoint_dir,
    create_run_dir,
    find_resume_checkpoint,
    mark_complete,
    write_config,
)
from rlinf_pipe.runner.setup import Components, launch_components
from rlinf_pipe.runner.stages import MicroBatcher, RewardTally, concat_train_batches
from rlinf_pipe.runner.weight_sync import WeightManifest
from rlinf_pipe.scheduler.channel import StepEnd
from rlinf_pipe.utils.metrics import MetricsWriter, read_metrics
from rlinf_pipe.utils.timeline import (
    STEP_SPAN,
    analyse_step,
    render_curve_png,
    render_timeline_png,
    write_chrome_trace,
)
from rlinf_pipe.utils.tracing import Span, Tracer


class StageCalls:
    """The step's running stage calls; waiting on some of them fails fast when ANY of them fails (a failed stage
    would otherwise leave the others blocked on their channels)."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Future] = {}

        self.watched: dict[str, asyncio.Future] = {}

    def start(self, name: str, call: Any) -> asyncio.Future:
        task = asyncio.ensure_future(call)
        self.tasks[name] = task
        return task

    def adopt(self, name: str, task: asyncio.Future) -> asyncio.Future:
        """Count an already running call (started in an earlier step) as one of this step's stages."""
        self.tasks[name] = task
        return task

    def watch(self, name: str, call: Any) -> asyncio.Future:
        """Start a call that runs into the next step: its failure fails this step, but `all()` leaves it out."""
        task = asyncio.ensure_future(call)
        self.watched[name] = task
        return task

    def all(self) -> list[asyncio.Future]:
        return list(self.tasks.values())

    async def until(self, *targets: asyncio.Future) -> None:
        pending = set(targets)
        while pending:
            running = [*self.tasks.values(), *self.watched.values()]
            watch = pending | {t for t in running if not t.done()}
            done, _ = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    for other in [*self.tasks.values(), *self.watched.values()]:
                        other.cancel()
                    raise task.exception()
            pending -= done


@dataclass
class StepResult:
    """What the driver learned in one step (metrics are what goes to metrics.jsonl)."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


class Runner:
    """Runs `cfg` to `runner.max_steps`; outputs go to `run_dir` (see rlinf_pipe.runner.run_dir)."""

    def __init__(self, cfg: Config, run_dir: Path | None = None):
        self.cfg = cfg
        self.run_dir = run_dir or create_run_dir(cfg)
        write_config(cfg, self.run_dir)
        self.tracer = Tracer("driver")
        self.spans: list[Span] = []
        self.c: Components | None = None
        self.start_step = 0
        self.ahead: tuple[asyncio.Future, int] | None = None  # max_staleness 1: next step's rollout, its prompts
        self.sampler_state: dict[str, Any] | None = None  # sampler state before prompts were drawn ahead
        self.published: WeightManifest | None = None  # the next version's weights, exported at the end of a step
        self.sampling_metrics: dict[str, float] = {}  # dynamic sampling: the current step's counts

    # --- lifecycle ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        self.c = launch_components(self.cfg)
        resume = find_resume_checkpoint(self.cfg)
        if resume is not None:
            self.resume_from(resume)

    def run(self) -> Path:
        """Train to `runner.max_steps`; returns the run folder."""
        if self.c is None:
            self.setup()
        cfg = self.cfg.runner
        writer = MetricsWriter(
            self.run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project,
            wandb_name=cfg.experiment_name,
        )
        progress = Progress(cfg.max_steps, self.start_step, enabled=cfg.progress)
        async def steps() -> None:  # one event loop for the whole run: channel waiters live in it
            for step in range(self.start_step, cfg.max_steps):
                result = await self.step(step)
                writer.write(step, result.metrics)
                progress.update(step, result.metrics)
                if cfg.save_interval and (step + 1) % cfg.save_interval == 0 and step + 1 < cfg.max_steps:
                    self.save(step + 1)
            self.save(cfg.max_steps)
            await self.collect_spans()  # the final checkpoint's spans

        try:
            asyncio.run(steps())
        finally:
            writer.close()
            self.write_outputs()
            progress.close()
        summary = self.summary()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if cfg.progress:
            print(Progress.render_summary(summary, self.run_dir))
        return self.run_dir

    def shutdown(self) -> None:
        if self.c is not None:
            self.c.shutdown()
            self.c = None

    # --- the step --------------------------------------------------------------------------------------------
    async def step(self, step: int) -> StepResult:
        c = self.c
        assert c is not None
        cfg = self.cfg
        off_policy = cfg.runner.max_staleness > 0
        with self.tracer.span(STEP_SPAN, step=step) as step_args:
            calls = StageCalls()
            if self.ahead is not None:  # max_staleness 1: this step's rollout ran during the last step
                rollout, num_prompts = self.ahead
                await calls.until(calls.adopt("rollout", rollout))
            sync = await self.sync_weights(version=step)
            if self.ahead is None:
                prompts = c.next_prompts()
                rollout, num_prompts = calls.start("rollout", self.generate(step, prompts)), len(prompts)
            self.ahead = None
            if off_policy and step + 1 < cfg.runner.max_steps:  # generate step k+1 with version k while k trains
                self.sampler_state = c.sampler.state_dict()  # resume re-draws the prompts dispatched ahead
                ahead, ahead_prompts = self.rollout_after(rollout, step + 1)
                self.ahead = (calls.watch("rollout_ahead", ahead), ahead_prompts)
            reward = rollout if cfg.algorithm.dynamic_sampling else calls.start(  # sampling rounds score their groups
                "reward", c.reward.score_step(step, c.rollouts, c.scored, cfg.algorithm.adv_estimator, c.adv_options)
            )
            if c.collocated:  # the rollout phase releases the devices before the actor phase takes them
                await calls.until(rollout)
                await calls.until(calls.start("onload", c.actor.begin_phase(step)))
            logprob = calls.start(
                "logprob", c.logprob_group.logprob_step(step, c.logprob_input, c.train, recompute_old=not off_policy)
            )
            if c.collocated:  # old log-probs must come from the weights before this step's updates
                await calls.until(logprob)
            train = calls.start("train", self.train_from_channel(step, num_prompts * cfg.algorithm.group_size))
            await calls.until(*calls.all())
            if step + 1 < cfg.runner.max_steps and c.weight_sync == "object_store":
                # publish the next version while the actor holds its devices
                self.published = await self.export_weights(step + 1)
            if c.collocated:
                await calls.until(calls.start("offload", c.actor.end_phase(step)))
            step_args.update(version=step)
        spans = await self.collect_spans()
        metrics = self.step_metrics(step, spans, sync, reward.result(), train.result())
        return StepResult(step, metrics)

    def generate(self, step: int, prompts: list[PromptItem]) -> Any:
        """The step's rollout into `rollouts`: one call, or with dynamic sampling the rounds of
        `sample_dynamically`."""
        c = self.c
        assert c is not None
        if self.cfg.algorithm.dynamic_sampling:
            return self.sample_dynamically(step, prompts)
        return c.rollout_call(step, prompts, c.rollouts)

    async def sample_dynamically(self, step: int, prompts: list[PromptItem]) -> list[RewardTally]:
        """Generate and score round by round, keeping (into `kept`) the first groups whose rewards are not all
        equal, until the step holds `len(prompts)` of them or `algorithm.max_extra_rounds` extra rounds are
        spent. An extra round draws the missing count times the inverse share of groups whose rewards varied so
        far (`adaptive_oversample`: 1 to 4 times). Kept groups stream on to the log-prob stage while
        later rounds generate. Returns every round's reward tallies (all generated groups count in the reward
        metrics); the counts go to `dynamic_sampling/*`."""
        c, algo = self.c, self.cfg.algorithm
        assert c is not None and c.kept is not None
        sampler = DynamicSampler(len(prompts), algo.max_extra_rounds)
        tallies: list[RewardTally] = []

        async def keep_varied_groups() -> None:
            while not isinstance(group := await c.scored.aget(), StepEnd):
                if sampler.offer(torch.from_numpy(group.rewards)):
                    await c.kept.aput(group, weight=group.num_sequences)

        while not sampler.done:
            if sampler.rounds:  # an extra round
                oversample = adaptive_oversample(sampler.seen, sampler.seen - sampler.uniform)
                prompts = c.next_prompts(sampler.start_round(oversample))
            else:
                sampler.start_round()
            *_, round_tallies = await asyncio.gather(
                c.rollout_call(step, prompts, c.rollouts), keep_varied_groups(),
                c.reward.score_step(step, c.rollouts, c.scored, algo.adv_estimator, c.adv_options),
            )
            tallies += round_tallies
        c.kept.end_step()
        self.sampling_metrics = sampler.metrics()
        return tallies

    def rollout_after(self, previous: asyncio.Future, step: int) -> tuple[Any, int]:
        """Draw step `step`'s prompts now; generate them once `previous` (the rollout of the step before) is done,
        with the weights the engines hold then (one version behind the actor that trains on them). Returns the
        coroutine and the number of prompts."""
        c = self.c
        assert c is not None
        prompts = c.next_prompts()

        async def chained() -> Any:
            await asyncio.shield(previous)
            return await c.rollout_call(step, prompts, c.rollouts)

        return chained(), len(prompts)

    async def export_weights(self, version: int) -> WeightManifest:
        """Publish the actor's current weights as `version` (the actor must be on its devices)."""
        c = self.c
        assert c is not None
        manifests = await c.actor.export_weights(
            version, self.cfg.runner.weight_bucket_mb << 20, self.cfg.runner.verify_weights
        )
        return next(m for m in manifests if m is not None)

    async def sync_weights(self, version: int) -> dict[str, float]:
        """Load the actor's weights of `version` into every engine (and log-prob worker). They were published at
        the end of the previous step, while the actor still held its devices; at the first step (and after a
        resume) they are published here."""
        c = self.c
        assert c is not None
        if c.weight_sync == "broadcast":
            return await self.broadcast_weights(version)
        with self.tracer.span("weight_sync", version=version) as args:
            manifest, self.published = self.published, None
            if manifest is None or manifest.version != version:
                if c.collocated:
                    await c.actor.begin_phase(version)
                manifest = await self.export_weights(version)
                if c.collocated:
                    await c.actor.end_phase(version)
            receivers = [c.rollout.update_weights(manifest, self.cfg.runner.verify_weights)]
            if c.inference is not None:
                receivers.append(c.inference.update_weights(manifest, self.cfg.runner.verify_weights))
            await asyncio.gather(*receivers)
            args.update(bytes=manifest.num_bytes, tensors=manifest.num_tensors)
        return {"bytes": float(manifest.num_bytes)}

    async def broadcast_weights(self, version: int) -> dict[str, float]:
        """`runner.weight_sync: broadcast`: the actor streams `version` through the weight group to every engine
        and log-prob worker at once."""
        c = self.c
        assert c is not None
        with self.tracer.span("weight_sync", version=version) as args:
            verify = self.cfg.runner.verify_weights
            receivers = [c.rollout.receive_weights(version, verify)]
            if c.inference is not None:
                receivers.append(c.inference.receive_weights(version, verify))
            sent, *_ = await asyncio.gather(c.actor.broadcast_weights(version, verify), *receivers)
            args["bytes"] = num_bytes = next(b for b in sent if b is not None)
        return {"bytes": float(num_bytes)}

    async def train_from_channel(self, step: int, total_sequences: int) -> list[dict[str, float]]:
        """Route the step's training items to the actor replicas in micro-batches as they arrive; step the
        optimizer after each of the `n_minibatches` mini-batches of `total_sequences / n_minibatches` sequences
        (a last, partial one steps too). Returns the optimizer steps' metrics."""
        c = self.c
        assert c is not None
        per_minibatch = -(-total_sequences // self.cfg.algorithm.n_minibatches)
        batcher = MicroBatcher(self.cfg.actor.micro_batch_size, self.cfg.actor.micro_batch_tokens)
        results: list[dict[str, float]] = []
        pending: list[Any] = []
        seen, boundary, replica = 0, per_minibatch, 0
        sent = [0] * c.actor_dp  # micro-batches per replica since the last optimizer step (the actor checks)

        def dispatch(items: list[TrainBatch] | None) -> None:
            nonlocal replica
            if items:
                batch = concat_train_batches(items, c.pad_token_id)
                pending.append(c.actor_replica(replica).train_micro_batch(batch))
                sent[replica] += 1
                replica = (replica + 1) % c.actor_dp

        async def optimizer_step() -> None:
            dispatch(batcher.flush())
            # Ray does not keep submission order on async actors: a micro-batch must have trained before the step
            await asyncio.gather(*pending)
            pending.clear()
            outs = await c.actor.optimizer_step(step, list(sent))
            sent[:] = [0] * c.actor_dp
            results.append(next(o for o in outs if o is not None))

        while True:
            item = await c.train.aget()
            if isinstance(item, StepEnd):
                break
            seen += item.num_sequences
            for micro_batch in batcher.add(item, item.num_sequences, int(item.input_ids.shape[1])):
                dispatch(micro_batch)
            if seen >= boundary:
                await optimizer_step()
                boundary += per_minibatch
        if batcher.pending or pending:
            await optimizer_step()
        return results  # empty when nothing arrived (dynamic sampling kept no group): the step trains nothing

    # --- outputs ---------------------------------------------------------------------------------------------
    async def collect_spans(self) -> list[Span]:
        c = self.c
        assert c is not None
        spans = self.tracer.drain()
        for group in c.traced_groups():
            for worker_spans in await group.drain_spans():
                spans.extend(worker_spans)
        self.spans.extend(spans)
        return spans

    def step_metrics(
        self, step: int, spans: list[Span], sync: dict[str, float], tallies: list[RewardTally],
        train: list[dict[str, float]],
    ) -> dict[str, float]:
        step_span = next(s for s in spans if s.name == STEP_SPAN)
        analysis = analyse_step(spans, step_span)
        tally = RewardTally()
        for t in tallies:
            tally = tally.merge(t)

        def stage_time(name: str) -> float:  # wall time during which some worker ran this stage
            return analysis.stage_busy.get(name, 0.0) * analysis.duration

        last = train[-1] if train else {}
        metrics: dict[str, float] = {
            **tally.metrics(),
            **self.sampling_metrics,
            "loss": last.get("loss", float("nan")),
            "grad_norm": last.get("grad_norm", float("nan")),
            "lr": last.get("lr", float("nan")),
            "kl": last.get("loss/kl", 0.0),
            "timing/step": analysis.duration,
            "timing/rollout": stage_time("generate"),
            "timing/reward": stage_time("reward"),
            "timing/inference": stage_time("logprob"),
            "timing/train": stage_time("train"),
            "timing/weight_sync": next(s.duration for s in spans if s.name == "weight_sync" and s.track == "driver"),
            "timing/export_weights": sum(s.duration for s in spans if s.name == "export_weights"),
            "weight_sync/bytes": sync["bytes"],
            "throughput/tokens_per_s": tally.response_tokens / analysis.duration,
            "pipeline/bubble_fraction": analysis.bubble_fraction,
            "pipeline/scheduler_overhead_fraction": analysis.scheduler_overhead_fraction,
            "optimizer_steps": float(len(train)),
        }
        for key, value in last.items():
            if key not in ("loss", "grad_norm", "lr") and isinstance(value, (int, float)):
                metrics.setdefault(f"actor/{key}", float(value))
        for name, frac in analysis.stage_busy.items():
            metrics[f"busy/{name}"] = frac
        return metrics

    def write_outputs(self) -> None:
        if not self.spans:
            return
        write_chrome_trace(self.spans, self.run_dir / "timeline.json")
        render_timeline_png(self.spans, self.run_dir / "timeline.png", title=self.cfg.runner.experiment_name)
        path = self.run_dir / "metrics.jsonl"
        records = read_metrics(path) if path.exists() else []
        if records:
            steps = [r["step"] for r in records]
            series = {k: [r.get(k) or 0.0 for r in records] for k in ("reward/mean", "reward/accuracy")}
            render_curve_png(steps, series, self.run_dir / "reward.png", title="reward")

    def summary(self) -> dict[str, Any]:
        from rlinf_pipe.utils.timeline import analyse, summarise

        records = read_metrics(self.run_dir / "metrics.jsonl")
        head, tail = records[: max(1, len(records) // 4)], records[-max(1, len(records) // 4):]

        def mean(rows: list[dict[str, Any]], key: str) -> float:
            vals = [r[key] for r in rows if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        return {
            "run_dir": str(self.run_dir),
            "steps": len(records),
            "reward_first": mean(head, "reward/mean"),
            "reward_last": mean(tail, "reward/mean"),
            "accuracy_first": mean(head, "reward/accuracy"),
            "accuracy_last": mean(tail, "reward/accuracy"),
            "mean_step_s": mean(records, "timing/step"),
            "tokens_per_s": mean(records, "throughput/tokens_per_s"),
            "timeline": summarise(analyse(self.spans)) if self.spans else {},
        }

    # --- checkpoints -----------------------------------------------------------------------------------------
    def save(self, next_step: int) -> Path:
        """Checkpoint the state before step `next_step`: actor (model, optimizer, scheduler, RNG) and data."""
        c = self.c
        assert c is not None
        ckpt = checkpoint_dir(self.run_dir, next_step)
        with self.tracer.span("checkpoint", step=next_step):
            ckpt.mkdir(parents=True, exist_ok=True)
            c.actor.save_checkpoint(str(ckpt / "actor")).wait()
            sampler = self.sampler_state if self.ahead is not None else c.sampler.state_dict()
            (ckpt / "runner.json").write_text(json.dumps({"next_step": next_step, "sampler": sampler}))
            mark_complete(ckpt, {"next_step": next_step, "time": time.time()})
        return ckpt

    def resume_from(self, ckpt: Path) -> None:
        c = self.c
        assert c is not None
        state = json.loads((ckpt / "runner.json").read_text())
        self.start_step = int(state["next_step"])
        c.actor.load_checkpoint(str(ckpt / "actor"), self.start_step).wait()
        c.sampler.load_state_dict(state["sampler"])
        print(f"[rlinf_pipe] resumed from {ckpt} at step {self.start_step}")


def run(cfg: Config) -> Path:
    """Run `cfg` end to end (starting or joining Ray); returns the run folder."""
    runner = Runner(cfg)
    try:
        return runner.run()
    finally:
        runner.shutdown()
        ray.shutdown()


__all__ = ["Runner", "StepResult", "run"]
