"""`RunPlan`: how a run works, decided once from its config and placement, before Ray starts.

Everything that differs between placements is data here (whether the engines take turns with the actor on its
GPUs, whether the actor computes the log-probs, the weight transport, rollout staleness, dynamic sampling); the runner
picks its parts from it at start-up and the step takes them as parameters. Whether a log-prob stage runs at all
depends on the algorithm (`rlinf_pipe.algorithms.logprob_needs`): without one, placed inference workers are not
started (a warning says so) and the scored groups go straight to the actor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlinf_pipe.algorithms.advantages import advantage_scope, registered_advantages
from rlinf_pipe.algorithms.logprob_needs import computes_logprobs, why_no_logprobs
from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.planning.gpu_ids import format_ids
from rlinf_pipe.planning.placement import Placement, plan_placement
from rlinf_pipe.utils.text import closest
from rlinf_pipe.planning.weight_routes import (
    Devices,
    WeightRoute,
    gpu_devices,
    gpu_shared_in_group,
    ipc_unreachable,
    weight_routes,
)
from rlinf_pipe.weights.transport_names import TRANSPORTS, Transport


@dataclass(frozen=True)
class RunPlan:
    """The decided shape of a run (see the module docstring)."""

    placement: Placement
    weight_transport: Transport
    weight_routes: tuple[WeightRoute, ...]
    staleness: int
    dynamic_sampling: bool
    channel_shared_bytes: int  # each producer's shared memory in the step channels (`runner.channel_shared_mb`)
    channel_encrypt: bool = False  # the step channels encrypt their socket traffic (`runner.channel_encryption`)
    logprob_stage: bool = True  # the algorithm needs a log-prob pass (old or reference log-probs)
    idle_inference: str = ""  # why placed inference workers are not started (empty: they are, or none are placed)
    weight_transport_why: str = ""  # why `runner.weight_sync` came to `weight_transport` (`plan` prints it)
    arrival_slots: bool = False  # groups take slots in the order they are scored (dynamic sampling does anyway)
    token_balance: bool = False  # groups go to the actor replica with the fewest tokens (DP > 1)

    @property
    def engines_share_actor(self) -> bool:
        """Rollout and actor take turns on the same GPUs."""
        return self.placement.rollout_on_actor_gpus

    @property
    def inference_workers(self) -> bool:
        """Inference workers run: placed, and the algorithm needs a log-prob pass."""
        return runs_inference(self.placement, self.logprob_stage)

    @property
    def actor_logprobs(self) -> bool:
        """The actor computes the log-probs: a log-prob pass is needed and no inference workers are placed."""
        return self.logprob_component == "actor"

    @property
    def logprob_component(self) -> str | None:
        """Who runs the log-prob stage: `inference`, `actor`, or None (no stage: the reward workers feed the
        actor's train channels)."""
        if not self.logprob_stage:
            return None
        return "inference" if self.placement.inference_placed else "actor"

    @property
    def inference_shares_rollout(self) -> bool:
        """Inference workers run, and take turns with the engines on their GPUs."""
        return self.inference_workers and self.placement.inference_on_rollout_gpus

    @property
    def collocated(self) -> bool:
        """Collocated mode: every GPU component on the same GPUs."""
        return self.engines_share_actor and not self.inference_workers

    @property
    def buffers_steps(self) -> bool:
        """Some consumer may wait for its producer's phase (a time-shared GPU set, or the actor computing the
        log-probs before it trains), or rollout runs ahead (staleness): the channels hold a whole step, so that a
        producer holding the devices never waits for its consumer."""
        return self.engines_share_actor or self.actor_logprobs or self.inference_shares_rollout or self.staleness > 0

    @property
    def turns(self) -> dict[str, tuple[str, ...]]:
        """For each component that takes turns on its GPUs, the components it takes them with (none listed: its
        GPUs are its own). Empty: no GPU set is taken in turns (the job needs no device locks)."""
        pairs = [("rollout", "actor")] if self.engines_share_actor else []
        pairs += [("rollout", "inference")] if self.inference_shares_rollout else []
        turns: dict[str, tuple[str, ...]] = {}
        for a, b in pairs:
            turns[a] = (*turns.get(a, ()), b)
            turns[b] = (*turns.get(b, ()), a)
        return turns

    @property
    def actor_dp(self) -> int:
        return self.placement.components["actor"].dp

    @property
    def weight_receivers(self) -> tuple[str, ...]:
        """The components that load weight versions: the engines, and the inference workers if any run."""
        return weight_receivers(self.placement, self.logprob_stage)

    @property
    def warnings(self) -> tuple[str, ...]:
        """The placement's warnings, and the run's own (inference workers placed but not started)."""
        return (*self.placement.warnings, *((self.idle_inference,) if self.idle_inference else ()))


def sync_calls(plan: RunPlan) -> int:
    """The driver's round trips on a weight version's way (`runner/weight_sync.py`): none where a group transport
    pushes it to receivers on GPUs of their own, one where it moves at the end of the actor's phase (receivers on
    the actor's GPUs), two through the object store (publish, then fetch)."""
    if plan.weight_transport == "object_store":
        return 2
    comps = plan.placement.components
    actor = set(comps["actor"].gpus)
    return int(any(actor & set(comps[n].gpus) for n in plan.weight_receivers if n in comps))


def runs_inference(placement: Placement, logprob_stage: bool) -> bool:
    """Inference workers run: placed, and the algorithm needs a log-prob pass (`logprob_stage`)."""
    return logprob_stage and "inference" in placement.components


def weight_receivers(placement: Placement, logprob_stage: bool) -> tuple[str, ...]:
    """The components that load weight versions: the engines, and the inference workers if any run."""
    return ("rollout", "inference") if runs_inference(placement, logprob_stage) else ("rollout",)


def idle_inference_warning(cfg: Config, placement: Placement) -> str:
    """Why the placed inference workers are not started (empty when they are, or none are placed)."""
    if "inference" not in placement.components or computes_logprobs(cfg):
        return ""
    gpus = format_ids(placement.components["inference"].gpus)
    return (f"inference (GPU(s) {gpus}) has nothing to compute: {why_no_logprobs(cfg)}; no inference workers are "
            "started, the scored groups go straight to the actor and those GPUs sit idle. Remove `inference` from "
            "cluster.component_placement to give them to rollout or actor, or set algorithm.compute_ref_logprobs: "
            "true (the kl metric) or algorithm.n_minibatches > 1 (old log-probs recomputed)")


def resolve_weight_transport(setting: str, placement: Placement, receivers: Sequence[str],
                             devices: Devices = {}) -> tuple[Transport, str]:
    """`runner.weight_sync` and why: `auto` is `broadcast` (NCCL on GPUs, gloo on CPU) when no two members of its
    group (the actor's rank 0 and the receivers) share a GPU (`devices`: placement GPUs that are one device). Otherwise
    (collocated, or a hybrid placement) NCCL could not form the group: `ipc` when every receiver shares a GPU with an
    actor rank that holds a whole replica (CUDA IPC on GPUs, shared memory on CPU; `weight_routes`), else
    `object_store`."""
    if setting in TRANSPORTS:
        return setting, "set by runner.weight_sync"
    if setting != "auto":
        raise ConfigError(f"runner.weight_sync: {setting!r} is not one of auto, {', '.join(TRANSPORTS)}")
    comps = placement.components
    members = {name: comps[name] for name in receivers if name in comps}
    shared = ("actor and rollout take turns on every GPU" if placement.mode == "collocated"
              else gpu_shared_in_group(comps["actor"], members, devices))
    if shared is None:
        return "broadcast", "auto: no two members of the group (actor rank 0 and the receivers) share a GPU"
    unreachable = ipc_unreachable(placement, receivers, devices)
    if unreachable is None:
        return "ipc", (f"auto: {shared}, and a broadcast group (NCCL) takes one rank per GPU; every receiver shares a "
                       "GPU with an actor rank holding a whole replica")
    return "object_store", (f"auto: {shared}, so no broadcast group (NCCL takes one rank per GPU), and {unreachable}, "
                            "so no IPC: the slower object store carries the weights; place the receivers apart from "
                            "the actor, or on the GPUs of its gathering ranks, for a faster transport")


def check_algorithm(cfg: Config) -> None:
    """The advantage estimator is registered, and group-scoped when dynamic sampling assembles the batch."""
    name = cfg.algorithm.adv_estimator
    known = registered_advantages()
    if name not in known:
        raise ConfigError(
            f"algorithm.adv_estimator: no estimator named {name!r}; {closest(name, known)}. Register your own with "
            "rlinf_pipe.algorithms.register_advantage"
        )
    if cfg.algorithm.dynamic_sampling and advantage_scope(name) == "batch":
        raise ConfigError(
            f"algorithm.dynamic_sampling: true needs a group-scoped advantage estimator; {name!r} normalises over "
            "the whole batch, which dynamic sampling assembles round by round: use grpo, dr_grpo or rloo"
        )


def plan_run(cfg: Config, gpus_per_node: Sequence[int] | None = None) -> RunPlan:
    """Check the algorithm, plan the placement (on `gpus_per_node`, default the config's) and check the settings
    that depend on the mode; every refusal is a `ConfigError` or `PlacementError` naming the key and the fix. (The
    reward is checked by `runner.preflight`: a built-in one is an engine's name.)"""
    check_algorithm(cfg)
    placement = plan_placement(cfg, gpus_per_node)
    if cfg.runner.max_staleness and placement.rollout_on_actor_gpus:
        raise ConfigError(
            f"runner.max_staleness: {cfg.runner.max_staleness} needs the rollout on GPUs of its own: rollout and "
            "actor take turns on the same GPUs here, so rollout cannot run ahead; use 0, or place rollout and actor "
            "on different GPUs"
        )
    logprob_stage = computes_logprobs(cfg)
    receivers = weight_receivers(placement, logprob_stage)
    devices = gpu_devices(placement.components.values())  # (placement GPUs on one device: the GPU suite's one-GPU runs)
    transport, why = resolve_weight_transport(cfg.runner.weight_sync, placement, receivers, devices)
    return RunPlan(
        placement=placement, weight_transport=transport, weight_transport_why=why,
        weight_routes=tuple(weight_routes(placement, transport, receivers, devices)),
        staleness=cfg.runner.max_staleness, dynamic_sampling=cfg.algorithm.dynamic_sampling,
        logprob_stage=logprob_stage, idle_inference=idle_inference_warning(cfg, placement),
        channel_shared_bytes=cfg.runner.channel_shared_mb * 1024 * 1024,
        channel_encrypt=cfg.runner.channel_encryption,
        arrival_slots=cfg.algorithm.minibatch_order == "arrival" and not cfg.algorithm.dynamic_sampling,
        token_balance=cfg.algorithm.replica_routing == "tokens" and placement.components["actor"].dp > 1,
    )
