"""A run's checkpoints: `checkpoints/step_NNNNNN/` holds the actor's folder (`actor/`), the runner's state
(`runner.json`: the next step and the prompt sampler's position) and, written last, `COMPLETE`."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlinf_pipe.config.schema import Config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.runner.run_dir import checkpoint_dir, complete_checkpoints, find_resume_checkpoint
from rlinf_pipe.runtime.worker_group import WorkerGroup
from rlinf_pipe.utils.folders import COMPLETE, absolute, mark_complete

if TYPE_CHECKING:  # (preflight reads checkpoints without loading torch)
    from rlinf_pipe.workers.actor import ActorWorker

ACTOR_SUBDIR = "actor"
RUNNER_STATE = "runner.json"


async def save_checkpoint(run_dir: Path, next_step: int, actor: WorkerGroup[ActorWorker],
                          sampler_state: dict[str, Any]) -> Path:
    """Checkpoint the state before step `next_step`: actor (model, optimizer, schedule, RNG) and data order."""
    ckpt = checkpoint_dir(run_dir, next_step)
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / COMPLETE).unlink(missing_ok=True)  # a step saved again (a resumed run) is incomplete until rewritten
    from rlinf_pipe.workers.actor import ActorWorker

    await actor.all.call(ActorWorker.save_checkpoint, str(ckpt / ACTOR_SUBDIR), next_step,
                         {"next_step": next_step})
    (ckpt / RUNNER_STATE).write_text(json.dumps({"next_step": next_step, "sampler": sampler_state}))
    mark_complete(ckpt, {"next_step": next_step, "time": time.time()})
    return ckpt


def remove_partial(run_dir: Path, next_step: int) -> None:
    """Remove the folder of a save of step `next_step` that failed (best effort: it has no marker, so it is never
    resumed from either way; this gives its space back)."""
    ckpt = checkpoint_dir(run_dir, next_step)
    if not (ckpt / COMPLETE).exists():
        shutil.rmtree(ckpt, ignore_errors=True)


def prune_checkpoints(run_dir: Path, keep: int, saved: Path) -> list[Path]:
    """After `saved`: delete the complete checkpoints of `run_dir` before it beyond the newest `keep` (0: none, and
    `saved` counts); returns them. Checkpoints of later steps (a run resumed into its folder from an earlier one
    left them) are not touched. Each loses its completion marker first, so one whose removal is interrupted is never
    resumed from."""
    if keep < 1:
        return []
    upto = [c for c in complete_checkpoints(run_dir) if step_of(c) <= step_of(saved)]
    old = upto[:-keep]
    for ckpt in old:
        (ckpt / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(ckpt, ignore_errors=True)
    return old


def step_of(ckpt: Path) -> int:
    """The step a `checkpoints/step_N` folder continues at (N)."""
    return int(ckpt.name.rsplit("_", 1)[-1])


def read_runner_state(ckpt: Path) -> dict[str, Any]:
    """The runner's state of a checkpoint, checked against the step its other parts carry (the checkpoint's and
    the actor's completion records): a checkpoint whose parts disagree is refused."""
    try:
        state = json.loads((ckpt / RUNNER_STATE).read_text())
        steps = {
            RUNNER_STATE: state["next_step"],
            COMPLETE: json.loads((ckpt / COMPLETE).read_text()).get("next_step"),
            f"{ACTOR_SUBDIR}/{COMPLETE}": json.loads((ckpt / ACTOR_SUBDIR / COMPLETE).read_text()).get("next_step"),
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"runner.resume_dir: {ckpt} is not a readable checkpoint ({type(exc).__name__}: {exc}); "
                          "it was not written by a finished save of this version: give another checkpoint or start "
                          "fresh") from None
    if len(set(steps.values())) != 1:
        raise ConfigError(
            f"runner.resume_dir: the parts of {ckpt} disagree on the step they hold ({steps}); it was altered after "
            "it was saved: give another checkpoint or start fresh"
        )
    return state


def check_resume(cfg: Config) -> Path | None:
    """The checkpoint the run resumes from (None: it starts fresh), checked to leave steps to train: resuming at
    step N with `runner.max_steps` <= N would train nothing and save a checkpoint whose step contradicts its
    state; and checked to hold no pickled object but the types of the actor's states (`UnsafeCheckpointError`
    names the file before Ray starts; the actor's ranks load them weights-only anyway)."""
    ckpt = find_resume_checkpoint(cfg)
    if ckpt is None:
        return None
    from rlinf_pipe.models.state_files import check_state_files  # (torch: only when resuming)

    ckpt = absolute(ckpt)  # (the actor's ranks read it: they start in other folders)
    check_state_files((ckpt / ACTOR_SUBDIR).rglob("*.pt"))
    next_step = int(read_runner_state(ckpt)["next_step"])
    if next_step >= cfg.runner.max_steps:
        raise ConfigError(
            f"runner.resume_dir: {ckpt} continues at step {next_step}, but runner.max_steps is {cfg.runner.max_steps}: "
            f"nothing is left to train. Set runner.max_steps above {next_step} to train on from it, or drop "
            "runner.resume_dir to start fresh"
        )
    return ckpt


async def load_checkpoint(ckpt: Path, actor: WorkerGroup[ActorWorker]) -> dict[str, Any]:
    """Restore the actor from `ckpt`; returns the runner state (`next_step`, `sampler`)."""
    state = read_runner_state(ckpt)
    from rlinf_pipe.workers.actor import ActorWorker

    await actor.all.call(ActorWorker.load_checkpoint, str(ckpt / ACTOR_SUBDIR), int(state["next_step"]))
    return state
