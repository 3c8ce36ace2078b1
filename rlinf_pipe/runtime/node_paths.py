"""Paths every node must see as the driver does, checked on each node before the workers start.

Workers read the model folders on their own node, and the actor's ranks write their part of each checkpoint into
the run folder the driver made. On several nodes both must be at the same path everywhere (the same copy on each
node, or shared storage); otherwise a worker fails deep in its model loader, or a checkpoint whose actor part went to
another machine's disk cannot be resumed. `check_node_paths` runs one small task on every node other than the
driver's (which checked its own paths already) and raises one `ConfigError` naming every node and path that is
missing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from rlinf_pipe.errors import ConfigError

PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class NodePath:
    """A path a node must see: `model` (an HF folder with config.json), `file` (a file to read, such as a resumed
    checkpoint's completion record) or `shared` (a file whose text is `token`, which the driver wrote: the node sees
    the driver's folder, not a namesake). `key` is the config key behind it, `needed_by` who reads or writes it
    there."""

    key: str
    path: str
    kind: Literal["model", "file", "shared"]
    needed_by: str
    token: str = ""


def missing_here(paths: list[NodePath]) -> list[str]:
    """What of `paths` this process's node does not see as the driver does (one line each)."""
    problems = []
    for want in paths:
        if want.kind == "model":
            if not os.path.isfile(os.path.join(want.path, "config.json")):
                problems.append(f"{want.key}: no model folder with config.json at {want.path} (needed by "
                                f"{want.needed_by})")
            continue
        if want.kind == "file":
            if not os.path.isfile(want.path):
                problems.append(f"{want.key}: no file {want.path} (needed by {want.needed_by})")
            continue
        try:
            with open(want.path) as f:
                seen = f.read()
        except OSError as exc:
            seen = f"unreadable ({exc.strerror or exc})"
        if seen != want.token:
            problems.append(f"{want.key}: the run folder {os.path.dirname(want.path)} is not the driver's here "
                            f"(its probe file is {'missing' if seen.startswith('unreadable') else 'another'}; "
                            f"{want.needed_by} write there)")
    return problems


def check_node_paths(cluster: Any, wants: dict[int, list[NodePath]]) -> None:
    """Check `wants` (node rank -> paths) on every node but the driver's; a `ConfigError` lists what is missing."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    probe = ray.remote(num_cpus=0, max_retries=0)(missing_here)
    pending = {}
    for node_rank, paths in sorted(wants.items()):
        node = cluster.nodes[node_rank]
        if paths and node.node_id != here:
            strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            pending[node_rank] = probe.options(scheduling_strategy=strategy).remote(paths)
    if not pending:
        return
    try:
        found = dict(zip(pending, ray.get(list(pending.values()), timeout=PROBE_TIMEOUT_S), strict=True))
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(f"could not check the model and run folders on node(s) {sorted(pending)} within "
                          f"{PROBE_TIMEOUT_S:g} s (is the node alive? `ray status` lists the nodes)") from None
    lines = [f"  node {rank} ({cluster.nodes[rank].ip}): {problem}"
             for rank, problems in found.items() for problem in problems]
    if lines:
        raise ConfigError(
            "paths that the workers use are not the same on every node:\n" + "\n".join(lines) + "\nEvery worker "
            "reads the model from its own node, and the actor's ranks write their part of each checkpoint into the "
            "run folder and read the checkpoint a run resumes from: put the model folders at the same path on every "
            "node (a copy on each, or shared storage; the built-in models are built in the driver's cache, "
            "$RLINF_PIPE_CACHE, which must then be shared) and runner.output_dir and the checkpoints to resume from "
            "on storage that every node mounts at the same path (docs/multi-node.md)."
        )
