"""Launching a run's components from its placement: worker groups, channels, data, device locks."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.factory import build_prompt_dataset, build_sampler
from rlinf_pipe.data.sampler import PromptSampler
from rlinf_pipe.data.structs import PromptItem, RolloutGroup, ScoredGroup, TrainBatch
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.models.resolve import resolve_model_path
from rlinf_pipe.scheduler.channel import Channel
from rlinf_pipe.scheduler.cluster import Cluster
from rlinf_pipe.scheduler.placement import ComponentPlacement, Placement, ProcessPlacement, plan_placement
from rlinf_pipe.scheduler.worker_group import WorkerGroup
from rlinf_pipe.workers.rollout.engine import SamplingParams


@dataclass
class Components:
    """Everything a running job holds: groups, channels, data. `shutdown()` stops the workers and Ray."""

    cfg: Config
    cluster: Cluster
    placement: Placement
    model_path: str
    tokenizer: Any
    sampler: PromptSampler
    rollout: WorkerGroup
    reward: WorkerGroup
    actor: WorkerGroup
    inference: WorkerGroup | None
    rollouts: Channel
    scored: Channel
    train: Channel
    locks: Any = None
    adv_options: dict[str, Any] = field(default_factory=dict)
    kept: Channel | None = None  # algorithm.dynamic_sampling: the scored groups the driver keeps

    @property
    def collocated(self) -> bool:
        return self.placement.mode == "collocated"

    @property
    def weight_sync(self) -> str:
        """`runner.weight_sync` resolved for this placement (see `resolve_weight_sync`)."""
        return resolve_weight_sync(self.cfg.runner.weight_sync, self.collocated)

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def logprob_input(self) -> Channel:
        """What the log-prob stage reads: the scored groups, or with dynamic sampling the ones kept."""
        return self.kept if self.kept is not None else self.scored

    @property
    def logprob_group(self) -> WorkerGroup:
        """Who computes old / reference log-probs: the inference workers, or the actor when collocated."""
        return self.inference if self.inference is not None else self.actor

    @property
    def actor_dp(self) -> int:
        return self.actor.dp_size

    def actor_replica(self, dp_rank: int) -> Any:
        """Fan-out over the ranks of one actor data-parallel replica."""
        ranks = [r for r in range(self.actor.size) if self.actor.dp_rank_of(r) == dp_rank]
        return self.actor.execute_on(ranks)

    def next_prompts(self, count: int | None = None) -> list[PromptItem]:
        return self.sampler.next_batch(count)

    def rollout_call(self, step: int, prompts: list[PromptItem], out: Channel) -> Any:
        return self.rollout.call_sharded("generate_step", prompts, step, out)

    def traced_groups(self) -> list[WorkerGroup]:
        groups = [self.rollout, self.reward, self.actor]
        return groups + ([self.inference] if self.inference is not None else [])

    def shutdown(self) -> None:
        for channel in (self.rollouts, self.scored, self.train, *([self.kept] if self.kept else [])):
            channel.abort()  # stop this process's channel threads before Ray goes (they would call into it)
        for group in self.traced_groups():
            group.shutdown()
        self.cluster.shutdown()


def run_model_path(name: str, cfg: Config) -> str:
    """The model folder of a run (`resolve_model_path` with the run's data: `tiny` is the tiny model warm-started
    on it, built once and cached); an unusable name is a `ConfigError`."""
    try:
        return str(resolve_model_path(name, data=cfg.data))
    except ValueError as exc:
        raise ConfigError(f"actor.model_path / rollout.model_path: {exc}") from None


def reward_placement(placement: Placement) -> ComponentPlacement:
    """The reward component's placement; without a `reward:` key, one CPU process on the head node."""
    if "reward" in placement.components:
        return placement.components["reward"]
    return ComponentPlacement("reward", "reward", (), 1, 1, (ProcessPlacement(0, 0, (), ()),))


def advantage_options(cfg: Config) -> dict[str, Any]:
    return {"norm_by_std": cfg.algorithm.norm_by_std} if cfg.algorithm.adv_estimator == "grpo" else {}


def sampling_params(cfg: Config, stop_ids: list[int]) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
        stop_token_ids=stop_ids, n=cfg.algorithm.group_size,
    )


def resolve_weight_sync(setting: str, collocated: bool) -> str:
    """`auto` is `broadcast` in the disaggregated pipeline and `object_store` when collocated."""
    if setting == "auto":
        return "object_store" if collocated else "broadcast"
    return setting


def join_weight_group(actor: WorkerGroup, receivers: list[WorkerGroup], bucket_bytes: int) -> None:
    """Form the weight-broadcast group: the actor's rank 0 (it gathers replica 0's weights) sends, every process
    of `receivers` receives. All members must join at once (the rendezvous waits for the whole group); the
    receivers check the sender's weight layout against their models."""
    addr, port = actor.execute_on([0]).free_port().wait()[0]
    world = 1 + sum(group.size for group in receivers)
    calls = [actor.execute_on([0]).join_weight_group(addr, port, world, bucket_bytes)]
    rank = 1
    for group in receivers:
        for member in range(group.size):
            calls.append(group.execute_on([member]).join_weight_group(addr, port, rank, world))
            rank += 1
    for call in calls:
        call.wait()


def launch_components(cfg: Config) -> Components:
    """Start (or join) Ray, place and launch every group, create the step channels, and build the data."""
    from transformers import AutoTokenizer

    from rlinf_pipe.scheduler.locks import DeviceLocks
    from rlinf_pipe.workers.actor.worker import ActorWorker
    from rlinf_pipe.workers.inference.worker import InferenceWorker
    from rlinf_pipe.workers.reward.worker import RewardWorker
    from rlinf_pipe.workers.rollout.worker import RolloutWorker

    model_path = run_model_path(cfg.actor.model_path, cfg)
    rollout_path = model_path if cfg.rollout.model_path in (None, cfg.actor.model_path) else run_model_path(
        cfg.rollout.model_path, cfg
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = build_prompt_dataset(cfg.data, tokenizer, cfg.runner.seed)
    sampler = build_sampler(cfg.data, dataset, cfg.runner.seed)

    cluster = Cluster(cfg)
    placement = plan_placement(cfg, cluster.gpus_per_node)
    collocated = placement.mode == "collocated"
    locks = DeviceLocks.remote() if collocated else None
    run_id = uuid.uuid4().hex[:8]
    unbounded = {"maxsize": None} if collocated else {}
    comps = placement.components
    rollout_procs = len(comps["rollout"].processes)
    reward_place = reward_placement(placement)

    quiet = {"PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning"}  # apex/TE fallbacks, deprecations
    actor = WorkerGroup.launch(ActorWorker, "actor", comps["actor"], cluster, env=quiet)
    inference = None
    if not collocated:
        inference = WorkerGroup.launch(InferenceWorker, "inference", comps["inference"], cluster, env=quiet)
    rollout = WorkerGroup.launch(
        RolloutWorker, "rollout", comps["rollout"], cluster, rollout_path, cfg.rollout.backend,
        sampling_params(cfg, []), cfg.runner.seed, locks, init_distributed=False,
    )
    reward = WorkerGroup.launch(
        RewardWorker, "reward", reward_place, cluster, num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s, correct_score=cfg.reward.correct_score, wrong_score=cfg.reward.wrong_score,
        format_score=cfg.reward.format_score, answer_pattern=cfg.reward.answer_pattern, init_distributed=False,
    )
    logprob_group = inference if inference is not None else actor
    logprob_replicas = logprob_group.dp_size
    rollouts = Channel.create(f"{run_id}-rollouts", RolloutGroup, num_producers=rollout_procs, **unbounded)
    scored = Channel.create(f"{run_id}-scored", ScoredGroup, num_producers=len(reward_place.processes), **unbounded)
    train = Channel.create(f"{run_id}-train", TrainBatch, num_producers=logprob_replicas, **unbounded)
    kept = Channel.create(f"{run_id}-kept", ScoredGroup, num_producers=1, **unbounded) if (
        cfg.algorithm.dynamic_sampling) else None

    actor.setup(model_path, cfg, "actor", locks).wait()
    if inference is not None:
        inference.setup(model_path, cfg, "inference", None).wait()
    if resolve_weight_sync(cfg.runner.weight_sync, collocated) == "broadcast":
        receivers = [rollout] if inference is None else [rollout, inference]
        join_weight_group(actor, receivers, cfg.runner.weight_bucket_mb << 20)
    return Components(
        cfg=cfg, cluster=cluster, placement=placement, model_path=model_path, tokenizer=tokenizer, sampler=sampler,
        rollout=rollout, reward=reward, actor=actor, inference=inference, rollouts=rollouts, scored=scored, kept=kept,
        train=train, locks=locks, adv_options=advantage_options(cfg),
    )
