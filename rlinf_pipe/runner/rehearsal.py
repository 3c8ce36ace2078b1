"""`rlinf-pipe rehearse CONFIG`: a cluster config trained for a few steps on this machine, before the cluster is
booked. A local Ray cluster gets the config's nodes (each a Ray node with its own virtual GPUs and the node-rank
label `ray_utils/start_ray.sh` gives it), the run keeps the config's placement, parallel sizes, channels, weight
transport (its CPU counterpart), staleness and algorithm, and only what this machine cannot run is scaled down
(`scale_down`: the model, the engine, batch, lengths, reward processes). `rehearse.render` says whether every
process started where the placement said, each component's memory and launch time, each stage's busy time, and
which channels and weight routes cross nodes."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ClusterError
from rlinf_pipe.runner.workers_record import WorkerRecord
from rlinf_pipe.runtime.cluster import NODE_RANK_LABEL
from rlinf_pipe.planning.gpu_ids import format_ids
from rlinf_pipe.planning.placement import Placement
from rlinf_pipe.planning.weight_routes import WeightRoute

CAPS = {"algorithm.group_size": 4, "rollout.max_new_tokens": 32, "data.max_prompt_length": 96,
        "reward.num_workers": 2}
"""The most a rehearsal keeps of each (the config's value when lower)."""
BATCH_CAP = 8  # prompts a step at the most, unless the actor's replicas x mini-batches need more
NODE_CPUS = 32  # logical CPUs each rehearsal node declares (Ray's scheduling; the machine's cores are shared)
OBJECT_STORE_BYTES = 256 << 20  # each node's object store (the object-store weight transport's buckets)
HEARTBEAT_S_PER_SHARE = 30.0
"""A rehearsal's heartbeat limit per process sharing each core: on this machine a worker's answer waits its turn
behind every other process's work (the 4 x 8 collocated rehearsal: 65 processes on 2 cores, a load of 200 to 550,
no answer within the default 30 s while every worker was busy)."""


@dataclass(frozen=True)
class Change:
    """One override a rehearsal makes, and why."""

    override: str
    why: str


def tiny_knobs_for(cfg: Config) -> dict[str, int] | None:
    """None when the warm-started tiny model (4 heads, 2 key/value heads, 2 layers) takes the config's Megatron
    parallel sizes; else the knobs of a tiny model that does (heads, key/value heads and layers divisible)."""
    tp = math.lcm(cfg.actor.tensor_parallel_size, cfg.inference.tensor_parallel_size)
    pp = math.lcm(cfg.actor.pipeline_parallel_size, cfg.inference.pipeline_parallel_size)
    if 2 % tp == 0 and 2 % pp == 0:
        return None
    kv = max(2, tp)
    return {"num_kv_heads": kv, "num_heads": 2 * kv, "hidden_size": 32 * kv, "intermediate_size": 64 * kv,
            "num_layers": math.lcm(2, pp)}


def scale_down(cfg: Config, actor_dp: int, steps: int, model: str, output_dir: str, dataset_found: bool,
               processes: int, cores: int) -> list[Change]:
    """The overrides that make `cfg` run here with `model` (see the module docstring); `processes` of the run share
    `cores`."""
    changes = [Change(f"runner.max_steps={steps}", "a few steps"),
               Change(f"runner.output_dir={output_dir}", "the rehearsal's own folder"),
               Change(f"runner.experiment_name=rehearse-{cfg.runner.experiment_name}", "named as a rehearsal"),
               Change("runner.val_interval=0", "no validation"), Change("runner.val_before_train=false", "")]
    if model != cfg.actor.model_path:
        changes.append(Change(f"actor.model_path={model}", "a model this machine runs"))
    if cfg.rollout.model_path not in (None, model):
        changes.append(Change("rollout.model_path=null", "the engines generate with the actor's model"))
    if cfg.rollout.backend != "torch":
        changes.append(Change("rollout.backend=torch", f"{cfg.rollout.backend} needs GPUs"))
    if not dataset_found:
        changes.append(Change("data.dataset=arithmetic", f"{cfg.data.dataset} is not on this machine"))
    for key, cap in CAPS.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) > cap:
            changes.append(Change(f"{key}={cap}", "scaled down"))
    need = cfg.algorithm.n_minibatches * actor_dp  # (a group for every replica in every mini-batch)
    batch = need * max(1, BATCH_CAP // need)
    if cfg.data.rollout_batch_size > batch:
        changes.append(Change(f"data.rollout_batch_size={batch}", "scaled down (every actor replica still gets "
                                                                  "a group in every mini-batch)"))
    if cfg.actor.micro_batch_tokens is not None:
        changes.append(Change("actor.micro_batch_tokens=null", "short samples: micro-batches by rows"))
    heartbeat = HEARTBEAT_S_PER_SHARE * math.ceil(processes / max(1, cores))
    if heartbeat > cfg.runner.heartbeat_timeout_s:
        changes.append(Change(f"runner.heartbeat_timeout_s={heartbeat:g}",
                              f"{processes} processes share {cores} cores: a busy worker answers late"))
    return changes


@contextmanager
def local_nodes(gpus_per_node: Sequence[int]) -> Iterator[tuple[str, dict[int, str]]]:
    """A local Ray cluster of `gpus_per_node` nodes (virtual GPUs, `start_ray.sh`'s node-rank labels); yields its
    address and each node rank's Ray node id, and stops it afterwards."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise ClusterError("rehearse starts a Ray cluster of its own: run it in a process not connected to Ray")
    cluster = Cluster(initialize_head=True, head_node_args=_node_args(0, gpus_per_node[0]))
    try:
        head = cluster.head_node
        assert head is not None  # (started with the cluster: initialize_head)
        nodes = {0: head.node_id}
        for rank, gpus in enumerate(gpus_per_node[1:], start=1):
            nodes[rank] = cluster.add_node(**_node_args(rank, gpus)).node_id
        cluster.wait_for_nodes()
        yield cluster.address, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_args(rank: int, gpus: int) -> dict[str, Any]:
    # no dashboard: on the head it is a process and nine module subprocesses (0.3 GiB PSS) nobody looks at here
    return {"num_cpus": NODE_CPUS, "num_gpus": gpus, "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False, "labels": {NODE_RANK_LABEL: str(rank)}}


def crossings(placement: Placement, transport: str, stages: Sequence[str],
              routes: Sequence[WeightRoute]) -> list[str]:
    """Which of the step's streams cross nodes: each channel between consecutive `stages` (the components that
    run, in step order), and the weights along `routes` (the plan's: one sender for every receiver, or with `ipc`
    each receiver's actor rank on its own GPUs) to each receiving component."""
    nodes = {name: sorted({p.node_rank for p in comp.processes}) for name, comp in placement.components.items()}
    stages = [s for s in stages if s in nodes]  # (unplaced reward workers: on the head node)
    lines = []
    for src, dst in zip(stages, stages[1:], strict=False):
        within = len(nodes[src]) == 1 and nodes[src] == nodes[dst]
        lines.append(f"channel {src} (node {format_ids(nodes[src])}) -> {dst} (node {format_ids(nodes[dst])}): "
                     + ("within one node (shared memory and local sockets)" if within else "crosses nodes (TCP)"))
    actor = placement.components["actor"].processes
    for name in ("rollout", "inference"):
        if name not in stages:
            continue
        pairs = {(actor[r.sender].node_rank, placement.components[name].processes[rank].node_rank)
                 for r in routes for member, rank in r.receivers if member == name}
        senders = sorted({s for s, _ in pairs})
        remote = sorted({d for s, d in pairs if d != s})
        who = f"actor rank {routes[0].sender}" if len(routes) == 1 else f"{len(routes)} actor ranks"
        lines.append(f"weights {who} (node {format_ids(senders)}) -> {name} over {transport}: "
                     + (f"to node {format_ids(remote)} across nodes" if remote else
                        "each within its node" if len(routes) > 1 else "within its node"))
    return lines


def check_placed(placement: Placement, records: Sequence[WorkerRecord], node_ids: dict[int, str],
                 components: Sequence[str]) -> list[str]:
    """Every worker record against the placement of `components` (those that started; a component the placement
    does not name, the reward workers of a run that places none, runs on the head node without GPUs): the Ray node
    (the one with its node-rank label) and the global GPUs. Returns the mismatches, named."""
    placed = [name for name in components if name in placement.components]
    expected = {(name, p.rank): p for name in placed for p in placement.components[name].processes}
    problems, seen = [], set()
    for r in records:
        if r.group not in placed:
            if r.node_id != node_ids.get(0) or r.global_gpus:
                problems.append(f"{r.group} rank {r.rank} (not placed) ran on node {r.node_rank} GPUs "
                                f"{list(r.global_gpus)}, not on the head node without GPUs")
            continue
        seen.add((r.group, r.rank))
        want = expected.get((r.group, r.rank))
        if want is None:
            problems.append(f"{r.group} rank {r.rank} ran but is not in the placement")
        elif node_ids.get(want.node_rank) != r.node_id or tuple(want.global_gpus) != r.global_gpus:
            problems.append(f"{r.group} rank {r.rank}: placed on node {want.node_rank} GPUs "
                            f"{list(want.global_gpus)}, ran on node {r.node_rank} GPUs {list(r.global_gpus)}")
    problems += [f"{name} rank {rank} never started" for name, rank in expected if (name, rank) not in seen]
    return problems
