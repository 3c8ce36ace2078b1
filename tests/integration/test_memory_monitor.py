"""A worker that Ray's memory monitor kills (its node ran low on host memory) is reported as lost, with why and
what to change, by the call that was running on it and by the heartbeat. Ray raises `OutOfMemoryError` for every
call to such an actor, which is not a `RayActorError`: before, the heartbeat let it escape as Ray's own 40-line
error, and the runner's restart never saw a lost worker. Run in a child process with a Ray of its own, started with
a memory threshold just above what the machine uses now, so that the worker's allocation passes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = r'''
import asyncio, os, sys, time

import psutil

used = psutil.virtual_memory().total - psutil.virtual_memory().available
os.environ["RAY_memory_usage_threshold"] = f"{(used + (2 << 30)) / psutil.virtual_memory().total:.4f}"
os.environ["RAY_memory_monitor_refresh_ms"] = "100"

import ray

from rlinf_pipe.config import Config
from rlinf_pipe.errors import WorkerLost
from rlinf_pipe.runtime.cluster import Cluster
from rlinf_pipe.planning.placement import plan_placement
from rlinf_pipe.runtime.worker import Worker
from rlinf_pipe.runtime.worker_group import WorkerGroup


class Hungry(Worker):
    def eat(self, gib: int) -> None:
        held = b"x" * (gib << 30)  # (filled, so the pages are really used)
        time.sleep(60)


ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
cfg = Config()
cfg.cluster.num_gpus_per_node = 2
cfg.cluster.component_placement = {"rollout": "0", "actor": "1"}
group = WorkerGroup.launch(Hungry, "hungry", plan_placement(cfg).components["actor"], Cluster(cfg),
                           distributed=False)
try:
    group.rank(0).call(Hungry.eat, 4).wait()
except WorkerLost as exc:
    print("CALL", exc.how, "|", str(exc).replace("\n", " "))
(lost,) = asyncio.run(group.unhealthy(timeout_s=30))
print("BEAT", lost.how, "|", str(lost).replace("\n", " "))
'''


@pytest.mark.alone  # (its threshold is the machine's memory use now plus 2 GiB: a test beside it would move it)
def test_a_worker_killed_by_rays_memory_monitor_is_lost_with_why_and_what_to_change():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line for line in proc.stdout.splitlines() if line.startswith(("CALL", "BEAT"))}
    assert set(lines) == {"CALL", "BEAT"}, proc.stdout
    for line in lines.values():
        assert " died |" in line and "worker rlinf_pipe:hungry:0 died: hungry rank 0 (node 0, GPUs 1)" in line
        assert "killed due to the node running low on memory" in line and "RAY_memory_usage_threshold" in line
