"""The Ray cluster a job runs on: connection, deterministic node order, GPU reservation.

Node order: the head node first, then nodes by the RANK given to `ray_utils/start_ray.sh` (Ray node label
`rlinf_pipe/node-rank`), then by IP. Global GPU ids are cumulative GPU counts over that order.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ClusterError
from rlinf_pipe.planning.gpu_ids import NodeLayout

NODE_RANK_LABEL = "rlinf_pipe/node-rank"
HEAD_RESOURCE = "node:__internal_head__"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeInfo:
    """One node of the cluster, in rlinf_pipe's node order."""

    node_rank: int
    node_id: str
    ip: str
    num_gpus: int  # the GPUs the run uses (the config's count)
    is_head: bool
    rank_label: int | None
    ray_gpus: int = 0  # the GPUs Ray knows on the node (all are held for the run: `Cluster.reserve_nodes`)


def order_nodes(ray_nodes: list[dict[str, Any]]) -> list[NodeInfo]:
    """Alive nodes of `ray.nodes()` in rlinf_pipe's deterministic order."""
    alive = [n for n in ray_nodes if n.get("Alive", n.get("alive", False))]
    labelled: dict[int, str] = {}
    infos = []
    for node in alive:
        label = (node.get("Labels") or {}).get(NODE_RANK_LABEL)
        rank_label = int(label) if label is not None and str(label).isdigit() else None
        ip = node["NodeManagerAddress"]
        if rank_label is not None:
            if rank_label in labelled:
                raise ClusterError(
                    f"two nodes were started with RANK={rank_label} ({labelled[rank_label]} and {ip}); give every "
                    "node its own RANK when running ray_utils/start_ray.sh"
                )
            labelled[rank_label] = ip
        infos.append(
            NodeInfo(
                node_rank=-1,
                node_id=node["NodeID"],
                ip=ip,
                num_gpus=int(node.get("Resources", {}).get("GPU", 0)),
                is_head=HEAD_RESOURCE in node.get("Resources", {}),
                rank_label=rank_label,
            )
        )

    def key(n: NodeInfo) -> tuple:
        try:
            ip_key: tuple = (0, int(ipaddress.ip_address(n.ip)))
        except ValueError:
            ip_key = (1, n.ip)
        return (not n.is_head, n.rank_label if n.rank_label is not None else math.inf, ip_key, n.node_id)

    ordered = sorted(infos, key=key)
    return [NodeInfo(i, n.node_id, n.ip, n.num_gpus, n.is_head, n.rank_label) for i, n in enumerate(ordered)]


def head_ip_file() -> Path:
    """Where `ray_utils/start_ray.sh` writes the head's address: RAY_HEAD_IP_FILE, else `ray_utils/ray_head_ip.txt`
    of the checkout this package runs from (where start_ray.sh writes it, wherever the job was started), else of
    the current folder."""
    if "RAY_HEAD_IP_FILE" in os.environ:
        return Path(os.environ["RAY_HEAD_IP_FILE"])
    checkout = Path(__file__).resolve().parents[2] / "ray_utils"
    return (checkout if checkout.is_dir() else Path("ray_utils")) / "ray_head_ip.txt"


@dataclass(frozen=True)
class RayAddress:
    """Where the job's Ray is: `address` (`local`: a cluster of its own; else `IP:PORT` or `ray://...`) and where
    that came from (`source`), for messages."""

    address: str
    source: str


def resolve_address(configured: str) -> RayAddress:
    """`auto` means: RAY_ADDRESS, else the address start_ray.sh wrote, else a local cluster of the job's own (never
    some other cluster Ray's discovery would find on this machine: another user's, or an earlier job's).

    Also adopts start_ray.sh's token authentication (its token file next to the address file) when the
    environment chooses no auth mode itself, or chooses `token` without saying where the token is (as
    `ray_utils/slurm.sbatch` passes `RAY_AUTH_MODE` on to the job).
    """
    if configured != "auto":
        return RayAddress(configured, "cluster.ray_address")
    address_file = head_ip_file()
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_FILE", address_file.parent / "ray_auth_token"))
    mode = os.environ.get("RAY_AUTH_MODE")
    token_given = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    if token_file.is_file() and (mode is None or (mode == "token" and not token_given)):
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file.resolve()))
    if os.environ.get("RAY_ADDRESS"):
        return RayAddress(os.environ["RAY_ADDRESS"], "RAY_ADDRESS")
    if address_file.is_file() and address_file.read_text().strip():
        return RayAddress(address_file.read_text().strip(), f"{address_file} (written by ray_utils/start_ray.sh)")
    return RayAddress("local", "cluster.ray_address=auto: no RAY_ADDRESS and no cluster recorded by start_ray.sh")


def _check_reachable(where: RayAddress) -> None:
    """Fail fast with a clear message when an explicit `IP:PORT` has no Ray head listening (Ray itself retries
    for a long time and then aborts the process)."""
    address = where.address
    if "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"Ray address {address!r} (from {where.source}): expected `auto`, `local` or `IP:PORT`")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        if where.source.endswith("(written by ray_utils/start_ray.sh)"):
            fix = (f"the cluster start_ray.sh recorded there is gone: start it again with `RANK=0 bash "
                   f"ray_utils/start_ray.sh`, or delete {head_ip_file()} to run on a local cluster of the job's own")
        elif where.source == "RAY_ADDRESS":
            fix = "start that cluster, or unset RAY_ADDRESS"
        else:
            fix = ("start it with `RANK=0 bash ray_utils/start_ray.sh` (it records its address in "
                   "ray_utils/ray_head_ip.txt, which cluster.ray_address=auto reads) or use cluster.ray_address=local")
        raise ClusterError(
            f"Ray address {address} (from {where.source}): no Ray head answers there ({exc.strerror or exc}); {fix}"
        ) from None


def cuda_available() -> bool:
    """Whether this process can use CUDA. Never inferred from CUDA_VISIBLE_DEVICES (Ray sets it for virtual GPUs)."""
    import torch

    return torch.cuda.is_available()


class Cluster:
    """A connection to a Ray cluster with `cfg.cluster.num_nodes` nodes in a deterministic order.

    `Cluster(cfg)` joins the running cluster (or starts a local one, declaring virtual GPUs on a machine without
    GPUs), waits for the nodes to join, and checks their GPU counts against the config. In a process already
    connected to Ray it uses that connection (and `shutdown` leaves it open).
    """

    def __init__(self, cfg: Config, *, poll_interval_s: float = 1.0):
        import ray

        self.cfg = cfg
        self.started_ray = False  # a local cluster this Cluster started
        self.connected = not ray.is_initialized()  # this Cluster connected the process (it disconnects at shutdown)
        if self.connected:
            self.started_ray = self._connect_or_start()
        self.nodes = self._wait_for_nodes(poll_interval_s)
        self.layout = NodeLayout([n.num_gpus for n in self.nodes])
        self._reservations: dict[int, Any] = {}

    # --- connection -------------------------------------------------------------------------------------------
    def _connect_or_start(self) -> bool:
        import ray

        from rlinf_pipe.utils.ray_guard import disable_auto_init

        disable_auto_init()  # connected explicitly here; a stray call after shutdown must not start a new Ray
        where = resolve_address(self.cfg.cluster.ray_address)
        if where.address != "local":
            _check_reachable(where)
            try:
                ray.init(address=where.address, log_to_driver=True)
            except ConnectionError as exc:
                raise ClusterError(
                    f"cannot connect to the Ray cluster at {where.address} (from {where.source}): {exc}; start it "
                    "with `RANK=0 bash ray_utils/start_ray.sh` or use cluster.ray_address=local"
                ) from None
            except ray.exceptions.AuthenticationError as exc:
                raise ClusterError(
                    f"the Ray cluster at {where.address} (from {where.source}) refused this job's authentication: "
                    f"{str(exc).strip().splitlines()[0]}. Use the cluster's auth mode (RAY_AUTH_MODE, the same on "
                    "every node and for the job) and, with `token`, its token: RAY_AUTH_TOKEN_PATH (start_ray.sh "
                    "writes it next to the head's address file) or RAY_AUTH_TOKEN (docs/multi-node.md)"
                ) from None
            print(f"[rlinf_pipe] Ray: joined the cluster at {where.address} (from {where.source})", flush=True)
            return False
        if self.cfg.cluster.num_nodes > 1:
            raise ClusterError(
                f"cluster.num_nodes={self.cfg.cluster.num_nodes} but no running Ray cluster was given ({where.source}); "
                "start one with `RANK=n bash ray_utils/start_ray.sh` on every node (RANK=0 on the head) and run the "
                "job on the head node (see docs/multi-node.md)"
            )
        num_gpus = None if cuda_available() else self.cfg.gpus_per_node()[0]
        ray.init(address="local", num_gpus=num_gpus, include_dashboard=False, labels={NODE_RANK_LABEL: "0"})
        print(f"[rlinf_pipe] Ray: started a local cluster for this job ({where.source})", flush=True)
        return True

    def _wait_for_nodes(self, poll_interval_s: float) -> list[NodeInfo]:
        import ray

        wanted = self.cfg.cluster.num_nodes
        deadline = time.monotonic() + self.cfg.cluster.join_timeout_s
        last_report = 0.0
        while True:
            nodes = order_nodes(ray.nodes())
            if len(nodes) >= wanted:
                break
            now = time.monotonic()
            if now >= deadline:
                raise ClusterError(
                    f"only {len(nodes)} of cluster.num_nodes={wanted} Ray nodes joined within "
                    f"{self.cfg.cluster.join_timeout_s:g} s: {self._describe(nodes)}. Start the missing nodes with "
                    "`RANK=n bash ray_utils/start_ray.sh`, or lower cluster.num_nodes"
                )
            if now - last_report >= 10:
                log.warning("waiting for Ray nodes: %d of %d joined", len(nodes), wanted)
                last_report = now
            time.sleep(poll_interval_s)
        if len(nodes) > wanted:
            log.warning("the cluster has %d nodes; using the first %d in node order", len(nodes), wanted)
            nodes = nodes[:wanted]
        self._check_gpu_counts(nodes)
        return [
            NodeInfo(n.node_rank, n.node_id, n.ip, self.cfg.gpus_per_node()[n.node_rank], n.is_head, n.rank_label,
                     ray_gpus=n.num_gpus)
            for n in nodes
        ]

    def _check_gpu_counts(self, nodes: list[NodeInfo]) -> None:
        for node, wanted in zip(nodes, self.cfg.gpus_per_node(), strict=True):
            if node.num_gpus < wanted:
                raise ClusterError(
                    f"node {node.node_rank} ({node.ip}, RANK label {node.rank_label}) has {node.num_gpus} GPU(s) but "
                    f"the config expects {wanted} (cluster.num_gpus_per_node); fix the config or start the node with "
                    "more GPUs (RAY_NUM_GPUS=N for virtual GPUs on CPU machines)"
                )
            if node.num_gpus > wanted:
                log.warning("node %d has %d GPUs; the config uses %d of them (the run holds all of them: another Ray "
                            "job could be handed the ones it uses)", node.node_rank, node.num_gpus, wanted)

    @staticmethod
    def _describe(nodes: list[NodeInfo]) -> str:
        if not nodes:
            return "none"
        return ", ".join(f"node {n.node_rank} {n.ip} (RANK {n.rank_label}, {n.num_gpus} GPUs)" for n in nodes)

    # --- queries --------------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def gpus_per_node(self) -> list[int]:
        return [n.num_gpus for n in self.nodes]

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def driver_node(self) -> int | None:
        """The rank of the node this process (the driver) runs on; None when it is none of the job's nodes."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        return next((n.node_rank for n in self.nodes if n.node_id == here), None)

    def node_of(self, global_gpu: int) -> NodeInfo:
        return self.nodes[self.layout.node_of(global_gpu)]

    # --- reservation ----------------------------------------------------------------------------------------
    def reserve_nodes(self, node_ranks: list[int], timeout_s: float = 60.0) -> dict[int, Any]:
        """Hold every GPU of the given nodes with one placement group pinned to each node (idempotent).

        Whole nodes are held because Ray does not let a job choose *which* GPU ids it holds: with the whole node
        held, no other Ray job can be handed a GPU that a placed process uses. Returns node rank -> group.
        """
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        new = {}
        for node_rank in node_ranks:
            if node_rank in self._reservations:
                continue
            node = self.nodes[node_rank]
            new[node_rank] = placement_group(
                [{"GPU": max(node.num_gpus, node.ray_gpus)}],  # every GPU of the node, the unused ones too
                strategy="STRICT_PACK",
                bundle_label_selector=[{"ray.io/node-id": node.node_id}],
            )
        ready, _ = ray.wait([g.ready() for g in new.values()], num_returns=len(new), timeout=timeout_s)
        if len(ready) < len(new):
            for group in new.values():
                remove_placement_group(group)
            raise ClusterError(
                f"could not reserve the GPUs of node(s) {sorted(new)} within {timeout_s:g} s; another Ray job "
                "probably holds some of them (see `ray status`). Stop it, or place components on other nodes"
            )
        self._reservations.update(new)
        return {rank: self._reservations[rank] for rank in node_ranks}

    def release(self) -> None:
        """Give the reserved GPUs back."""
        from ray.util.placement_group import remove_placement_group

        for group in self._reservations.values():
            remove_placement_group(group)
        self._reservations.clear()

    def shutdown(self) -> None:
        """Release reservations and leave Ray as this Cluster found it: disconnect if it connected (which stops a
        local cluster it started); a connection made before it stays."""
        import ray

        self.release()
        if self.connected:
            ray.shutdown()
