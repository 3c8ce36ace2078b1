"""A run's checkpoints: `checkpoints/step_NNNNNN/` holds the actor's folder (`actor/`), the runner's state
(`runner.json`: the next step and the prompt sampler's position) and, written last, `COMPLETE`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rlinf_pipe.runner.run_dir import checkpoint_dir
from rlinf_pipe.scheduler.worker_group import WorkerGroup
from rlinf_pipe.utils.folders import mark_complete

ACTOR_SUBDIR = "actor"
RUNNER_STATE = "runner.json"


async def save_checkpoint(run_dir: Path, next_step: int, actor: WorkerGroup, sampler_state: dict[str, Any]) -> Path:
    """Checkpoint the state before step `next_step`: actor (model, optimizer, schedule, RNG) and data order."""
    ckpt = checkpoint_dir(run_dir, next_step)
    ckpt.mkdir(parents=True, exist_ok=True)
    await actor.all.save_checkpoint(str(ckpt / ACTOR_SUBDIR), {"next_step": next_step})
    (ckpt / RUNNER_STATE).write_text(json.dumps({"next_step": next_step, "sampler": sampler_state}))
    mark_complete(ckpt, {"next_step": next_step, "time": time.time()})
    return ckpt


def read_runner_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / RUNNER_STATE).read_text())


async def load_checkpoint(ckpt: Path, actor: WorkerGroup) -> dict[str, Any]:
    """Restore the actor from `ckpt`; returns the runner state (`next_step`, `sampler`)."""
    state = read_runner_state(ckpt)
    await actor.all.load_checkpoint(str(ckpt / ACTOR_SUBDIR), int(state["next_step"]))
    return state
