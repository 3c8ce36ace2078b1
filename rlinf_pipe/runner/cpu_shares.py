"""How the stages share each node's CPUs: torch intra-op threads follow the placement.

Every compute process (rollout engine, log-prob worker, actor rank) runs its torch work in one compute thread
(`Worker.compute`) whose intra-op threads are its share of its node's CPUs: the node's CPUs divided by the
compute processes placed there, where processes on the same GPUs count once (they take turns). Within a step the
stages finish one after another; with the rollout in the step (`runner.max_staleness: 0`) a finished stage's CPUs
go to the stages still working on the same node (`CpuLending`), and the next step starts from the placement's
shares again. On 2 cores this gives the actor both cores for the micro-batches left once generation is done.

With `cluster.cores_per_gpu` each GPU's processes are pinned to cores of their own (`rlinf_pipe.runtime.cores`)
and take all of them as intra-op threads; nothing is lent: a virtual GPU pinned to cores stands for a device, and
a stage done with its step cannot lend its device to another.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from rlinf_pipe.config.schema import Config
from rlinf_pipe.planning.placement import ComponentPlacement
from rlinf_pipe.runtime.cluster import Cluster
from rlinf_pipe.runtime.cores import check_driver_host, host_slots, pinning_env
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.algorithms.logprob_needs import computes_logprobs


def cpu_stages(cfg: Config) -> tuple[str, ...]:
    """The stages whose processes share their nodes' CPUs, in pipeline order: the log-prob workers only when they
    compute something (by default they only pass batches on)."""
    return ("rollout", "inference", "actor") if computes_logprobs(cfg) else ("rollout", "actor")


def node_procs(placements: Iterable[ComponentPlacement]) -> dict[int, int]:
    """Compute processes per node among `placements`: processes on the same GPUs take turns and count once, a
    process without GPUs counts alone."""
    seats: dict[int, set[object]] = defaultdict(set)
    for placement in placements:
        for proc in placement.processes:
            seats[proc.node_rank].add(proc.global_gpus or (placement.name, proc.rank))
    return {node: len(s) for node, s in seats.items()}


def core_pinning(cfg: Config, cluster: Cluster) -> dict[str, str]:
    """The environment that pins every worker to its GPUs' cores (`cluster.cores_per_gpu`; empty when null),
    checked first against the cores of the driver's host."""
    k = cfg.cluster.cores_per_gpu
    hosts = [node.ip for node in cluster.nodes]
    here = cluster.driver_node() if k is not None else None
    check_driver_host(k, hosts, cluster.gpus_per_node, None if here is None else hosts[here])
    return pinning_env(k, host_slots(hosts, cluster.gpus_per_node))


def lends_cpus(cfg: Config, staleness: int, engines_share_actor: bool) -> bool:
    """Whether the stages done with a step lend their CPUs to those still working (`CpuLending`): not with rollout
    ahead (no stage is done early), nor where the engines take turns with the actor (the phases have every core
    already), nor with cores pinned to virtual GPUs (`cluster.cores_per_gpu`: a device is not lent)."""
    return not (staleness or engines_share_actor or cfg.cluster.cores_per_gpu is not None)


class CpuLending:
    """Lends the CPUs of the stages that are done with a step to those still working (see the module docstring).
    `stages` maps a stage's name to its group, in pipeline order; the calls go out without waiting (a control
    call each, ordered before the group's next calls)."""

    def __init__(self, stages: dict[str, WorkerGroup[Worker]]) -> None:
        self.stages = stages
        self.busy: list[str] = list(stages)
        self.lent = False  # whether shares differ from the placement's now

    def _share(self, names: list[str]) -> None:
        procs = node_procs(self.stages[name].placement for name in names)
        for name in names:
            self.stages[name].all.call(Worker.share_cpus, procs)

    def start_step(self) -> None:
        """Every stage works again: back to the placement's shares (if they were lent)."""
        self.busy = list(self.stages)
        if self.lent:
            self._share(self.busy)
            self.lent = False

    def done(self, name: str) -> None:
        """Stage `name` is done with this step: its CPUs go to the stages still working on the same nodes."""
        if name not in self.busy:
            return
        self.busy.remove(name)
        if self.busy:
            self._share(self.busy)
            self.lent = True
