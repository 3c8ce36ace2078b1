"""A running job's parts, launched from its `RunPlan`: the worker groups, the channels between them, the prompt
sampler, each GPU set's share (taken in turns, or alone). `Components.shutdown()` stops the workers and releases
the cluster."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rlinf_pipe.config.schema import Config
from rlinf_pipe.data.sampler import PromptSampler
from rlinf_pipe.data.structs import PromptItem
from rlinf_pipe.engines.rollout.factory import sampling_params
from rlinf_pipe.runner.checkpoints import ACTOR_SUBDIR
from rlinf_pipe.runner.cpu_shares import core_pinning, cpu_stages, node_procs
from rlinf_pipe.runner.driver_inputs import DriverInputs, driver_inputs
from rlinf_pipe.planning.run_plan import RunPlan, plan_run
from rlinf_pipe.runtime.cluster import Cluster
from rlinf_pipe.runtime.locks import DeviceLocks, DeviceShare, device_shares
from rlinf_pipe.runtime.node_paths import NodePath, check_node_paths
from rlinf_pipe.planning.placement import reward_placement
from rlinf_pipe.planning.stage_graph import StageGraph, stage_graph
from rlinf_pipe.runtime.worker import Worker, node_procs_env
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.utils.folders import COMPLETE
from rlinf_pipe.utils.net import RESOLVER_ENV, quick_resolver_env
from rlinf_pipe.runner.roles import LogprobComputing
from rlinf_pipe.runner.step_channels import StepChannels, create_channels

if TYPE_CHECKING:  # (the workers' modules import torch and the engines: the driver imports them when it launches)
    from rlinf_pipe.workers.actor import ActorWorker
    from rlinf_pipe.workers.inference import InferenceWorker
    from rlinf_pipe.workers.reward import RewardWorker
    from rlinf_pipe.workers.rollout import RolloutWorker
    from rlinf_pipe.workers.weight_receiver import WeightReceiverWorker

V = TypeVar("V", bound=Worker)

EXIT_GRACE_S = 5.0  # a worker's time to release what a kill leaves behind, before it is killed (`Worker.before_stop`)


def exit_grace_s(cfg: Config, group: str) -> float:
    """How long the workers of `group` may take to release what a kill leaves behind (`Worker.before_stop`): an
    SGLang engine's shutdown waits for the processes it kills (`SHUTDOWN_WAIT_S`: their GPU contexts' teardown)
    before it returns, so its rollout workers get that much more than the others. The wait ends when they are done."""
    if group == "rollout" and cfg.rollout.backend == "sglang":
        from rlinf_pipe.engines.rollout.sglang_host import SHUTDOWN_WAIT_S

        return SHUTDOWN_WAIT_S + EXIT_GRACE_S
    return EXIT_GRACE_S

WORKER_ENV = {"PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning"}  # apex/TE fallbacks, deprecations
NCCL_CUMEM = "NCCL_CUMEM_ENABLE"
NCCL_NVLS = "NCCL_NVLS_ENABLE"
CUDA_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def nccl_env(cfg: Config, transport: str) -> dict[str, str]:
    """One `NCCL_CUMEM_ENABLE` and one `NCCL_NVLS_ENABLE` for every worker of a run whose SGLang engines join the
    actor's `broadcast` group: sglang's Engine sets each to 0 in its process unless it is set (so in its
    schedulers), and the ranks of one NCCL communicator should not disagree on them. The driver's values where it
    has them, else sglang's 0."""
    if cfg.rollout.backend != "sglang" or transport != "broadcast":
        return {}
    return {name: os.environ.get(name, "0") for name in (NCCL_CUMEM, NCCL_NVLS)}


def megatron_env(tensor_parallel_size: int) -> dict[str, str]:
    """`CUDA_DEVICE_MAX_CONNECTIONS=1` for Megatron workers that split layers over GPUs (tensor parallel > 1), unless
    set: megatron-core's tensor-parallel layers issue each backward collective before the gradient kernels it should
    overlap and rely on one hardware queue to run them in that order (its `tensor_parallel/layers.py`); with
    CUDA's default of 8 queues the collective may wait behind them. Read when CUDA starts, so set at launch."""
    if tensor_parallel_size == 1:
        return {}
    return {CUDA_CONNECTIONS: os.environ.get(CUDA_CONNECTIONS, "1")}


RESOLVER_CHOICES: dict[tuple[str, ...], dict[str, str]] = {}  # by the nodes' IPs: a relaunch does not probe again


def resolver_env(node_ips: list[str]) -> dict[str, str]:
    """`RES_OPTIONS` for the workers where reverse DNS lookups of the nodes' IPs stall (`quick_resolver_env`), said
    once with what removes the wait; decided once per driver process for a set of nodes (`RESOLVER_CHOICES`)."""
    key = tuple(sorted(set(node_ips)))
    if key in RESOLVER_CHOICES:
        return RESOLVER_CHOICES[key]
    env, stalled = quick_resolver_env(node_ips, os.environ)
    RESOLVER_CHOICES[key] = env
    if stalled:
        print(f"[rlinf_pipe] reverse DNS lookups of {', '.join(stalled)} did not answer within 1 s (is the nameserver "
              "in /etc/resolv.conf reachable?). torch.distributed waits for one in every worker process, 10 s with "
              f"the resolver's defaults: the workers run with {RESOLVER_ENV}='{env[RESOLVER_ENV]}' (1 s). To remove "
              f"the wait, list the nodes' IPs in /etc/hosts; set {RESOLVER_ENV} yourself to choose", flush=True)
    return env


@dataclass
class Components:
    """Everything a running job holds (see the module docstring). `inference` is None when no inference workers
    run (`RunPlan.inference_workers`)."""

    plan: RunPlan
    graph: StageGraph
    cluster: Cluster
    sampler: PromptSampler
    val_prompts: list[PromptItem]
    rollout: WorkerGroup[RolloutWorker]
    reward: WorkerGroup[RewardWorker]
    actor: WorkerGroup[ActorWorker]
    inference: WorkerGroup[InferenceWorker] | None
    channels: StepChannels
    locks: Any  # the job's `DeviceLocks` (None: no GPU set is taken in turns)
    sampling_rounds: Any
    recipes: GroupRecipes
    arrival_slots: Any = None  # `workers.arrival_slots.ArrivalSlots` with `algorithm.minibatch_order: arrival`
    balancer: Any = None  # `workers.replica_balance.ReplicaBalancer` with `algorithm.replica_routing: tokens`

    def stages(self, names: tuple[str, ...]) -> dict[str, WorkerGroup[Worker]]:
        """The groups of the stages `names` that run in groups of their own (no inference group when the actor
        computes the log-probs)."""
        groups: dict[str, WorkerGroup[Worker] | None] = {"rollout": self.rollout, "inference": self.inference,
                                                        "actor": self.actor}
        return {name: group for name in names if (group := groups[name]) is not None}

    @property
    def logprob_group(self) -> WorkerGroup[LogprobComputing] | None:
        """Who computes old / reference log-probs: the inference workers, the actor, or nobody (no log-prob stage:
        `RunPlan.logprob_component`)."""
        groups: dict[str, WorkerGroup[LogprobComputing] | None] = {"inference": self.inference, "actor": self.actor}
        return groups.get(self.plan.logprob_component or "")

    @property
    def weight_receivers(self) -> dict[str, WorkerGroup[WeightReceiverWorker]]:
        """The groups that load weight versions, by component (`RunPlan.weight_receivers`)."""
        receivers: dict[str, WorkerGroup[WeightReceiverWorker]] = {"rollout": self.rollout}
        if self.inference is not None:
            receivers["inference"] = self.inference
        return receivers

    def groups(self) -> list[WorkerGroup[Worker]]:
        """Every worker group of the job."""
        return [self.rollout, self.reward, self.actor, *([self.inference] if self.inference is not None else [])]

    def group(self, name: str) -> WorkerGroup[Worker]:
        found = {g.name: g for g in self.groups()}
        if name not in found:
            raise ValueError(f"this job has no worker group {name!r} (it has {', '.join(found)})")
        return found[name]

    def renew_channels(self) -> None:
        """New step channels for the driver and every worker alive (after a lost worker: the broken step's items
        stay behind in the old ones, which are aborted here)."""
        self.channels.abort()
        self.channels = create_channels(self.plan, self.graph)

    async def reset_device_locks(self) -> None:
        """Forget every holder of the GPU sets taken in turns (after a lost worker, whose locks would never be
        released); nothing to do where no set is."""
        await DeviceShare(self.locks).reset()

    def relaunch(self, name: str, ranks: list[int]) -> None:
        """Start `ranks` of group `name` again on their GPUs (blocking)."""
        args, kwargs = self.recipes.arguments(name)
        self.group(name).relaunch(ranks, *args, **kwargs)
        if name == "rollout" and self.recipes.share("rollout").in_turns:  # as at launch: the engines sleep until
            from rlinf_pipe.workers.rollout import RolloutWorker  # they generate

            self.rollout.some(ranks).call(RolloutWorker.release_devices).wait()

    def stop_workers(self) -> None:
        """Stop every worker and helper actor of the job and this process's channel ends; the cluster (its
        connection and GPU reservations) stays, for a relaunch (`launch(cfg, cluster=cluster)`)."""
        import ray

        self.channels.abort()
        for group in self.groups():
            group.shutdown(wait_s=30.0, grace_s=exit_grace_s(self.cluster.cfg, group.name))
        for helper in (self.locks, self.sampling_rounds, self.arrival_slots, self.balancer):
            if helper is not None:
                ray.kill(helper, no_restart=True)

    def shutdown(self) -> None:
        self.stop_workers()
        self.cluster.shutdown()


@dataclass
class GroupRecipes:
    """What each group's workers are constructed with (at launch, and again for the ranks relaunched after a lost
    worker); the channels are not among them: every stage call passes its own."""

    cfg: Config
    plan: RunPlan
    model_path: str
    rollout_path: str
    shares: dict[str, DeviceShare]  # the components that take turns on their GPUs (`device_shares`)
    rounds: Any  # what gives the reward workers' groups their slots (None: the prompts' own)
    pad_token_id: int = 0
    balancer: Any = None  # what routes groups to actor replicas by tokens (None: by slot)

    def share(self, name: str) -> DeviceShare:
        """Component `name`'s share of its GPUs (alone: every hold a no-op)."""
        return self.shares.get(name, DeviceShare())

    def arguments(self, name: str) -> tuple[tuple, dict[str, Any]]:
        """The constructor arguments of group `name`'s workers."""
        cfg, plan = self.cfg, self.plan
        if name == "reward":
            return (cfg, plan.actor_dp, self.rounds, self.pad_token_id, self.balancer), {}
        if name == "actor":
            return (cfg, self.model_path, plan.actor_logprobs, self.share("actor"), self.balancer,
                    self.pad_token_id), {}
        if name == "inference":
            return (cfg, self.model_path, plan.actor_dp, self.share("inference"), self.balancer,
                    self.pad_token_id), {}
        if name == "rollout":  # (a small first batch only where the actor trains while the engines generate)
            first = None if plan.engines_share_actor else cfg.rollout.first_batch_size or cfg.actor.micro_batch_size
            return (cfg.rollout, self.rollout_path, sampling_params(cfg.rollout, cfg.algorithm.group_size),
                    cfg.runner.seed, self.share("rollout"), first), {}
        raise ValueError(f"no worker group {name!r}")


def node_paths(plan: RunPlan, inputs: DriverInputs, run_dir: Path, token: str,
               resume_from: Path | None = None) -> dict[int, list[NodePath]]:
    """What each node must see as the driver does: the model folders of the workers it runs and, where actor ranks
    run, the run folder (the file `run_dir/NODE_PROBE` holding `token`) and the actor's part of the checkpoint
    resumed from outside the run folder (`resume_from`)."""
    reads = {"actor": inputs.model_path, "inference": inputs.model_path, "rollout": inputs.rollout_path}
    keys = {"actor": "actor.model_path", "inference": "actor.model_path", "rollout": "rollout.model_path"}
    wants: dict[int, list[NodePath]] = {}
    for name, comp in plan.placement.components.items():
        if name not in reads:
            continue
        for node in sorted({p.node_rank for p in comp.processes}):
            paths = wants.setdefault(node, [])
            paths.append(NodePath(keys[name], reads[name], "model", f"the {name} workers"))
            if name == "actor":
                paths.append(NodePath("runner.output_dir", str(run_dir / NODE_PROBE), "shared",
                                      "the actor's ranks", token))
                if resume_from is not None and not resume_from.is_relative_to(run_dir):
                    paths.append(NodePath("runner.resume_dir", str(resume_from / ACTOR_SUBDIR / COMPLETE), "file",
                                          "the actor's ranks, to resume"))
    return {node: list(dict.fromkeys(paths)) for node, paths in wants.items()}


NODE_PROBE = ".node-probe"


def check_nodes_see_paths(cluster: Cluster, plan: RunPlan, inputs: DriverInputs, run_dir: Path,
                          resume_from: Path | None = None) -> None:
    """`check_node_paths` for this run (a no-op on one node)."""
    if cluster.num_nodes == 1:
        return
    token = uuid.uuid4().hex
    probe = run_dir / NODE_PROBE
    probe.write_text(token)
    try:
        check_node_paths(cluster, node_paths(plan, inputs, run_dir, token, resume_from))
    finally:
        probe.unlink(missing_ok=True)


def launch(cfg: Config, inputs: DriverInputs | None = None, cluster: Cluster | None = None,
           on_connect: Callable[[], None] = lambda: None, run_dir: Path | None = None,
           resume_from: Path | None = None) -> Components:
    """Start (or join) Ray, place and launch every group with its channels, open the weight transport's ends.
    `inputs` are read here unless given. Given a `cluster` (one started beside the driver's preparation, or a
    relaunch after `Components.stop_workers`), the groups go to its nodes and GPUs, and a failure leaves the cluster
    to its owner. `on_connect` runs once Ray is connected. Given the `run_dir`, every node first checks it sees the
    model folders, the run folder and the checkpoint it resumes from (`resume_from`) as the driver does
    (`check_nodes_see_paths`)."""
    from rlinf_pipe.workers.actor import ActorWorker
    from rlinf_pipe.workers.arrival_slots import ArrivalSlots
    from rlinf_pipe.workers.dynamic_sampling import SamplingRounds
    from rlinf_pipe.workers.inference import InferenceWorker
    from rlinf_pipe.workers.logprob_stage import train_routing
    from rlinf_pipe.workers.replica_balance import ReplicaBalancer
    from rlinf_pipe.workers.reward import RewardWorker
    from rlinf_pipe.workers.rollout import RolloutWorker

    inputs = inputs or driver_inputs(cfg)
    owns_cluster = cluster is None
    cluster = cluster or Cluster(cfg)
    on_connect()
    started: list[WorkerGroup[Worker]] = []

    def start(worker_cls: type[V], name: str, *args: Any, env: dict[str, str] | None = None,
              **kwargs: Any) -> WorkerGroup[V]:
        nsight = {"nsight": "default"} if name in cfg.runner.nsight else None  # `runner.nsight`
        group = WorkerGroup.start(worker_cls, name, *args, runtime_env=nsight,
                                  env={**cpus, **nccl, **resolver, **(env or {})}, **kwargs)
        started.append(group)
        return group

    try:
        plan = plan_run(cfg, cluster.gpus_per_node)
        if run_dir is not None:
            check_nodes_see_paths(cluster, plan, inputs, run_dir, resume_from)
        comps = plan.placement.components
        cpus = {**node_procs_env(node_procs(comps[name] for name in cpu_stages(cfg) if name in comps)),
                **core_pinning(cfg, cluster)}
        nccl = nccl_env(cfg, plan.weight_transport)
        resolver = resolver_env([node.ip for node in cluster.nodes])
        graph = stage_graph(plan)
        channels = create_channels(plan, graph)
        # (`@ray.remote` makes these classes actor classes, which mypy does not see: it keeps a class's type)
        locks = DeviceLocks.remote() if plan.turns else None  # type: ignore[attr-defined]
        rounds = SamplingRounds.remote() if plan.dynamic_sampling else None  # type: ignore[attr-defined]
        arrival = ArrivalSlots.remote() if plan.arrival_slots else None
        balancer = ReplicaBalancer.remote(train_routing(cfg, plan.actor_dp)) if plan.token_balance else None
        recipes = GroupRecipes(cfg, plan, inputs.model_path, inputs.rollout_path, device_shares(plan.turns, locks),
                               rounds or arrival,
                               inputs.pad_token_id, balancer)
        # The groups build their models at once; on GPUs taken in turns, the engines start once the actor (or the
        # inference workers) taking turns with them have built their state (and the actor offloaded it).
        reward = start(RewardWorker, "reward", reward_placement(plan.placement), cluster,
                       *recipes.arguments("reward")[0], distributed=False)
        actor = start(ActorWorker, "actor", comps["actor"], cluster, *recipes.arguments("actor")[0],
                      env={**WORKER_ENV, **megatron_env(cfg.actor.tensor_parallel_size)})
        if recipes.share("actor").in_turns:
            actor.ready()
        inference = None if not plan.inference_workers else start(
            InferenceWorker, "inference", comps["inference"], cluster, *recipes.arguments("inference")[0],
            env={**WORKER_ENV, **megatron_env(cfg.inference.tensor_parallel_size)})
        if recipes.share("inference").in_turns and inference is not None:
            inference.ready()
        rollout = start(RolloutWorker, "rollout", comps["rollout"], cluster, *recipes.arguments("rollout")[0],
                        distributed=False)
        for group in started:
            group.ready()
        if recipes.share("rollout").in_turns:  # the engines hold the GPUs only while they generate
            rollout.all.call(RolloutWorker.release_devices).wait()
    except BaseException:
        for group in started:
            group.shutdown()
        if owns_cluster:
            cluster.shutdown()
        raise
    return Components(plan=plan, graph=graph, cluster=cluster, sampler=inputs.sampler, val_prompts=inputs.val_prompts,
                      rollout=rollout,
                      reward=reward, actor=actor, inference=inference, channels=channels, locks=locks,
                      sampling_rounds=rounds, recipes=recipes, arrival_slots=arrival, balancer=balancer)
