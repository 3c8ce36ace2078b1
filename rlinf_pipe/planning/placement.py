"""GPU-range placement: `cluster.component_placement` -> processes on exact nodes and GPUs.

Pure functions, no Ray: `rlinf-pipe plan` and the runner use the same code. Every broken rule raises a
`PlacementError` that names the YAML key, the value, the rule and a fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from rlinf_pipe.config.schema import COMPONENTS, Config
from rlinf_pipe.errors import PlacementError
from rlinf_pipe.planning.gpu_ids import NodeLayout, format_ids, parse_gpu_ids
from rlinf_pipe.utils.text import closest

CPU_ONLY = "cpu"  # `reward: cpu` runs the reward pool without GPUs

Mode = Literal["collocated", "disaggregated", "hybrid"]
GPU_COMPONENTS = ("rollout", "inference", "actor")  # reward is a CPU component: its GPU ids only pick nodes


@dataclass(frozen=True)
class ProcessPlacement:
    """One worker process: its rank in the component, its node, and its GPUs (node-local and global ids)."""

    rank: int
    node_rank: int
    local_gpus: tuple[int, ...]
    global_gpus: tuple[int, ...]


@dataclass(frozen=True)
class ComponentPlacement:
    """Where one component runs and how it is parallelised (tp x pp x cp ranks a replica, dp replicas; Megatron's
    rank order: tensor-parallel fastest, then context-parallel, then data-parallel, then pipeline)."""

    name: str
    key: str
    gpus: tuple[int, ...]
    tp: int
    pp: int
    processes: tuple[ProcessPlacement, ...]
    cp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel replicas (for a CPU-only component: its process count)."""
        return len(self.gpus) // (self.tp * self.pp * self.cp) if self.gpus else len(self.processes)

    @property
    def gpus_per_process(self) -> int:
        return len(self.processes[0].global_gpus) if self.processes else 0


@dataclass(frozen=True)
class Placement:
    """The validated placement of every component on the cluster."""

    mode: Mode
    gpus_per_node: tuple[int, ...]
    components: dict[str, ComponentPlacement]
    warnings: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return sum(self.gpus_per_node)

    @property
    def rollout_on_actor_gpus(self) -> bool:
        """Rollout and actor are placed on the same GPUs (where they run, they take turns: `RunPlan.turns`)."""
        return self.components["rollout"].gpus == self.components["actor"].gpus

    @property
    def inference_on_rollout_gpus(self) -> bool:
        """Inference is placed on the rollout's GPUs (the actor has others). Whether inference workers run at all is
        the algorithm's (`RunPlan.inference_workers`)."""
        return "inference" in self.components and self.components["inference"].gpus == self.components["rollout"].gpus

    @property
    def inference_placed(self) -> bool:
        """An `inference` entry remains (one on the actor's GPUs is merged into the actor, with a warning); without
        one the actor computes whatever log-probs the algorithm needs (`RunPlan.logprob_component`)."""
        return "inference" in self.components

    def gpu_sets(self) -> list[GpuSet]:
        """The GPU components grouped by the GPU set they hold, in GPU order."""
        sets: dict[tuple[int, ...], list[str]] = {}
        for name in GPU_COMPONENTS:
            if name in self.components:
                sets.setdefault(self.components[name].gpus, []).append(name)
        return [GpuSet(gpus, tuple(names), self.inference_placed) for gpus, names in sorted(sets.items())]

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "gpu_sets": [{"gpus": format_ids(s.gpus), "components": list(s.components), "sharing": s.sharing}
                         for s in self.gpu_sets()],
            "num_nodes": len(self.gpus_per_node),
            "gpus_per_node": list(self.gpus_per_node),
            "components": {
                name: [
                    {
                        "rank": p.rank,
                        "node_rank": p.node_rank,
                        "local_gpus": list(p.local_gpus),
                        "global_gpus": list(p.global_gpus),
                    }
                    for p in comp.processes
                ]
                for name, comp in self.components.items()
            },
            "parallelism": {
                name: {"tp": comp.tp, "pp": comp.pp, "cp": comp.cp, "dp": comp.dp}
                for name, comp in self.components.items()
            },
            "warnings": list(self.warnings),
        }


def reward_placement(placement: Placement) -> ComponentPlacement:
    """The reward component's placement; without a `reward:` key, one CPU process on the head node."""
    if "reward" in placement.components:
        return placement.components["reward"]
    return ComponentPlacement("reward", "reward", (), 1, 1, (ProcessPlacement(0, 0, (), ()),))


@dataclass(frozen=True)
class GpuSet:
    """GPU components that hold the same GPUs. One component has them to itself and streams to the others; several
    take turns on them (rollout phase, then actor phase, under the device locks)."""

    gpus: tuple[int, ...]
    components: tuple[str, ...]
    inference_placed: bool  # (without it, the actor is shown with the log-probs)

    @property
    def sharing(self) -> str:
        """How the set is used, in words (`rlinf-pipe plan`)."""
        roles = [f"{n} (+ log-probs)" if n == "actor" and not self.inference_placed else n for n in self.components]
        if len(self.components) == 1:
            return f"{roles[0]} alone, streaming to the other stages"
        if "actor" in self.components:
            return f"time-shared by {' and '.join(roles)}: rollout phase, then actor phase"
        return f"time-shared by {' and '.join(roles)}: inference takes the GPUs group by group between generations"


def _split_key(key: str, value: object) -> list[str]:
    names = [n.strip() for n in str(key).split(",")]
    while len(names) > 1 and not names[-1]:  # `actor,rollout,`: a trailing comma is tolerated
        names.pop()
    for name in names:
        if name not in COMPONENTS:
            label = f"`{name}`" if name else "an empty name"
            raise PlacementError(
                key,
                value,
                f"{label} is not a component (components: {', '.join(COMPONENTS)})",
                closest(name, COMPONENTS) if name else "remove the stray comma",
            )
    return names


def _parallel_sizes(cfg: Config) -> dict[str, tuple[int, int, int, str]]:
    """Per component: (tp, pp, cp, the config keys that set them)."""
    def megatron(name: str, section: Any) -> tuple[int, int, int, str]:
        keys = f"{name}.tensor_parallel_size x {name}.pipeline_parallel_size"
        if section.context_parallel_size > 1:
            keys += f" x {name}.context_parallel_size"
        return (section.tensor_parallel_size, section.pipeline_parallel_size, section.context_parallel_size, keys)

    return {
        "rollout": (cfg.rollout.tensor_parallel_size, 1, 1, "rollout.tensor_parallel_size"),
        "inference": megatron("inference", cfg.inference),
        "actor": megatron("actor", cfg.actor),
        "reward": (1, 1, 1, ""),
    }


def plan_placement(cfg: Config, gpus_per_node: Sequence[int] | None = None) -> Placement:
    """Validate `cfg.cluster.component_placement` against a cluster and lay out every component's processes.

    `gpus_per_node` defaults to the cluster described in the config; the runner passes the live cluster's.
    """
    layout = NodeLayout(gpus_per_node if gpus_per_node is not None else cfg.gpus_per_node())
    raw = cfg.cluster.component_placement
    if not raw:
        raise PlacementError(
            "component_placement", "{}", "no component is placed", "add e.g. `actor,rollout: all` (collocated)"
        )

    keys: dict[str, str] = {}
    ids: dict[str, tuple[int, ...]] = {}
    values: dict[str, object] = {}
    for key, value in raw.items():
        for name in _split_key(key, value):
            if name in keys:
                raise PlacementError(
                    key,
                    value,
                    f"`{name}` is placed twice (also by `{keys[name]}`)",
                    f"give `{name}` exactly one entry",
                )
            keys[name], values[name] = key, value
            if name == "reward" and str(value).strip().lower() == CPU_ONLY:
                ids[name] = ()
            else:
                ids[name] = parse_gpu_ids(key, value, layout)

    for required in ("actor", "rollout"):
        if required not in keys:
            raise PlacementError(
                required,
                "<missing>",
                f"`{required}` must be placed (actor and rollout are required)",
                "add e.g. `actor,rollout: all` (collocated) or `rollout: 0-3` and `actor: 4-7` (pipeline)",
            )

    warnings: list[str] = []
    mode = _derive_mode(keys, values, ids, warnings)
    sizes = _parallel_sizes(cfg)
    components: dict[str, ComponentPlacement] = {}
    for name in keys:
        tp, pp, cp, size_keys = sizes[name]
        gpus = ids[name]
        if name != "reward" and len(gpus) % (tp * pp * cp):
            raise PlacementError(
                keys[name],
                values[name],
                f"{name} has {len(gpus)} GPU(s), not a multiple of {size_keys} = {tp * pp * cp}",
                f"give {name} a multiple of {tp * pp * cp} GPUs, or change {size_keys}",
            )
        components[name] = ComponentPlacement(name, keys[name], gpus, tp, pp, (), cp)

    if components["rollout"].gpus == components["actor"].gpus:
        actor_tp, rollout_tp = components["actor"].tp, components["rollout"].tp
        if actor_tp % rollout_tp and rollout_tp % actor_tp:
            raise PlacementError(
                keys["rollout"],
                values["rollout"],
                f"collocated: rollout.tensor_parallel_size ({rollout_tp}) and actor.tensor_parallel_size "
                f"({actor_tp}) do not divide one another, so rollout engines cannot line up with actor TP groups",
                f"use a rollout.tensor_parallel_size that divides {actor_tp} (engines strided inside each actor TP "
                f"group) or is a multiple of it (each engine spans whole actor TP groups), e.g. "
                f"{', '.join(map(str, _aligned_sizes(actor_tp, len(components['rollout'].gpus))))}",
            )

    for name, comp in components.items():
        processes = _lay_out_processes(name, comp, components, layout, values[name], warnings)
        components[name] = ComponentPlacement(comp.name, comp.key, comp.gpus, comp.tp, comp.pp, processes, comp.cp)

    samples = cfg.data.rollout_batch_size * cfg.algorithm.group_size
    actor_dp = components["actor"].dp
    if samples % actor_dp:
        raise PlacementError(
            keys["actor"],
            values["actor"],
            f"a step's {samples} samples (data.rollout_batch_size={cfg.data.rollout_batch_size} x "
            f"algorithm.group_size={cfg.algorithm.group_size}) do not split evenly over the actor's "
            f"{actor_dp} data-parallel ranks",
            f"make data.rollout_batch_size x algorithm.group_size a multiple of {actor_dp}, or change the actor's "
            "GPU count / parallel sizes",
        )

    used = set().union(*ids.values())
    unused = [g for g in range(layout.world_size) if g not in used]
    if unused:
        warnings.append(
            f"GPU(s) {format_ids(unused)} are not used by any component (the cluster has {layout.world_size}); "
            "that is allowed, but they sit idle"
        )
    return Placement(mode, layout.gpus_per_node, components, tuple(warnings))


def _derive_mode(keys: dict[str, str], values: dict[str, object], ids: dict[str, tuple[int, ...]],
                 warnings: list[str]) -> Mode:
    """Check how the GPU components share GPUs and name the mode. Components hold the same GPU set or disjoint
    ones; inference on the actor's GPUs is merged into the actor (it computes the log-probs; `ids` loses the
    entry)."""
    gpu = {name: set(ids[name]) for name in GPU_COMPONENTS if name in ids}
    names = list(gpu)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            shared = gpu[first] & gpu[second]
            if shared and gpu[first] != gpu[second]:
                raise PlacementError(
                    keys[second], values[second],
                    f"{first} ({format_ids(ids[first])}) and {second} ({format_ids(ids[second])}) share GPU(s) "
                    f"{format_ids(sorted(shared))} but are not identical: components that share GPUs take turns on "
                    "the whole set, so they hold exactly the same GPUs",
                    f"give both the same GPUs (they take turns, e.g. `{first},{second}: {format_ids(ids[first])}`; "
                    "`actor,rollout: all` is collocated mode) or disjoint GPUs (they stream to each other, e.g. "
                    "`rollout: 0-3`, `inference: 4-5`, `actor: 6-7`)",
                )
    if "inference" in gpu:
        if gpu["inference"] == gpu["actor"]:
            warnings.append(
                "inference shares the actor's GPUs: the actor computes the old and reference log-probs itself "
                "(no separate inference workers, no second copy of the model; inference.* parallel sizes are unused)"
            )
            for table in (keys, values, ids):
                del table["inference"]
    if gpu["actor"] == gpu["rollout"]:
        return "hybrid" if "inference" in ids else "collocated"
    return "hybrid" if "inference" in ids and gpu["inference"] == gpu["rollout"] else "disaggregated"


def _lay_out_processes(
    name: str,
    comp: ComponentPlacement,
    components: dict[str, ComponentPlacement],
    layout: NodeLayout,
    value: object,
    warnings: list[str],
) -> tuple[ProcessPlacement, ...]:
    """Group a component's GPUs into processes and check that none spans two nodes."""
    if name == "reward" and not comp.gpus:  # `reward: cpu`: one CPU process on the head node
        return (ProcessPlacement(0, 0, (), ()),)
    if name == "rollout":
        groups = _rollout_groups(comp, components["actor"])
    else:  # Megatron components and reward workers: one process per GPU
        groups = [(g,) for g in comp.gpus]
        model_parallel = comp.tp * comp.pp
        if name != "reward" and model_parallel > 1:
            for start in range(0, len(comp.gpus), comp.tp):
                tp_group = comp.gpus[start : start + comp.tp]
                if len({layout.node_of(g) for g in tp_group}) > 1:
                    warnings.append(
                        f"{name}: tensor-parallel group on GPUs {format_ids(tp_group)} spans nodes; TP traffic "
                        "will cross the network (slow). Align the range to node boundaries if you can."
                    )
    processes = []
    for rank, group in enumerate(groups):
        nodes = sorted({layout.node_of(g) for g in group})
        if len(nodes) > 1:
            raise PlacementError(
                comp.key, value,
                f"{name} process {rank} would get GPUs {format_ids(group)} on nodes "
                f"{', '.join(map(str, nodes))}; a process never spans nodes{_strided_cause(name, comp, components)}",
                _span_fix(name, comp, components, layout),
            )
        processes.append(
            ProcessPlacement(rank, nodes[0], tuple(layout.local_id(g) for g in group), tuple(group))
        )
    return tuple(processes)


def _strided(name: str, comp: ComponentPlacement, components: dict[str, ComponentPlacement]) -> bool:
    actor = components["actor"]
    return name == "rollout" and comp.gpus == actor.gpus and actor.tp > comp.tp


def _strided_cause(name: str, comp: ComponentPlacement, components: dict[str, ComponentPlacement]) -> str:
    if not _strided(name, comp, components):
        return ""
    actor_tp = components["actor"].tp
    stride = actor_tp // comp.tp
    return (f". Collocated engines are strided inside each actor TP group of {actor_tp} GPUs (engine j takes "
            f"the group's GPUs j, j+{stride}, ...), and this actor TP group spans nodes")


def _span_fix(name: str, comp: ComponentPlacement, components: dict[str, ComponentPlacement],
              layout: NodeLayout) -> str:
    if _strided(name, comp, components):
        smallest = min(layout.gpus_per_node)
        return (f"keep actor TP groups inside a node (actor.tensor_parallel_size <= {smallest}), or use "
                "rollout.tensor_parallel_size 1 (one engine per GPU)")
    return (f"make {name}'s GPUs on each node a multiple of its {comp.tp * comp.pp} GPUs per process "
            f"({layout.describe()})")


def _aligned_sizes(actor_tp: int, gpus: int) -> list[int]:
    """The rollout TP sizes a collocated actor of `actor_tp` accepts on `gpus` GPUs: divisors and multiples."""
    return [n for n in range(1, gpus + 1) if gpus % n == 0 and (actor_tp % n == 0 or n % actor_tp == 0)]


def _rollout_groups(rollout: ComponentPlacement, actor: ComponentPlacement) -> list[tuple[int, ...]]:
    """GPUs of each rollout engine. On GPUs of their own, or on the actor's with a rollout TP that is a multiple of the
    actor's, engines take consecutive GPUs (collocated: each spans whole actor TP groups). Collocated with a
    smaller rollout TP, engines are strided inside each actor TP group so that rollout TP rank r of engine j sits
    on the device of actor TP shard j + r * stride."""
    tp = rollout.tp
    if rollout.gpus != actor.gpus or tp % actor.tp == 0:
        return [rollout.gpus[i : i + tp] for i in range(0, len(rollout.gpus), tp)]
    stride = actor.tp // tp
    groups: list[tuple[int, ...]] = []
    for start in range(0, len(actor.gpus), actor.tp):
        tp_group = actor.gpus[start : start + actor.tp]
        groups.extend(tuple(tp_group[j + r * stride] for r in range(tp)) for j in range(stride))
    return groups
