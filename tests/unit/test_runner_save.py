"""A checkpoint save that fails in the middle of a run (a full disk): the run stops with one error naming the step,
the cause and the last complete checkpoint to resume from; the partial folder is removed, the complete one kept."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.local_group import LocalGroup

from rlinf_pipe.errors import OutputError, WorkerError
from rlinf_pipe.runner.runner import Runner
from rlinf_pipe.runner.run_dir import checkpoint_dir
from rlinf_pipe.utils.folders import COMPLETE
from rlinf_pipe.utils.tracing import Tracer


class _Actor(LocalGroup):
    """An actor group of one rank, itself, whose `save_checkpoint` writes part of its folder, then fails like a full
    disk (from the worker: `WorkerError` carrying the remote OSError; or an OSError) once `fail` is set."""

    def __init__(self) -> None:
        super().__init__([self])
        self.fail: type[Exception] | None = None

    async def save_checkpoint(self, path: str, step: int, meta: dict) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.pt").write_bytes(b"\0" * 64)
        if self.fail is OSError:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        if self.fail is WorkerError:
            raise WorkerError(  # as `WorkerGroup` words a remote exception
                f"actor rank 0 (node 0, GPUs 2) in save_checkpoint() raised OSError: [Errno 28] No space left on "
                f"device: '{path}/model.pt'\n--- remote traceback ---\nTraceback (most recent call last):\n  ...")


def _runner(run_dir: Path, actor: _Actor) -> SimpleNamespace:
    """The parts of a `Runner` that `save` uses, with no worker lost (health finds none)."""
    async def no_loss() -> list:
        return []

    runner = SimpleNamespace(tracer=Tracer("driver"), run_dir=run_dir, last_checkpoint=None,
                             c=SimpleNamespace(actor=actor), schedule=SimpleNamespace(sampler_state=lambda: {"at": 1}),
                             health=SimpleNamespace(find_lost=no_loss),
                             cfg=SimpleNamespace(runner=SimpleNamespace(keep_checkpoints=1)))
    runner.resume_hint = lambda: Runner.resume_hint(runner)
    runner.save = lambda step: Runner.save(runner, step)
    return runner


@pytest.mark.parametrize("failure", [WorkerError, OSError], ids=["in-the-actor", "in-the-driver"])
def test_a_full_disk_during_a_save_names_the_last_complete_checkpoint(tmp_path, failure):
    actor = _Actor()
    runner = _runner(tmp_path, actor)
    good = asyncio.run(runner.save(1))
    assert (good / COMPLETE).exists() and runner.last_checkpoint == good

    actor.fail = failure
    with pytest.raises(OutputError) as error:
        asyncio.run(runner.save(2))
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(f"cannot save the checkpoint before step 2 in {tmp_path}:")
    assert "No space left on device" in message
    assert message.endswith(f"the last complete checkpoint is {good}: free space, then resume from it")
    assert not checkpoint_dir(tmp_path, 2).exists()  # the partial folder is gone
    assert (good / COMPLETE).exists() and runner.last_checkpoint == good
    assert [s.name for s in runner.tracer.drain()] == ["checkpoint", "checkpoint"]


def test_a_save_before_any_checkpoint_says_there_is_none(tmp_path):
    actor = _Actor()
    actor.fail = OSError
    with pytest.raises(OutputError, match="no checkpoint was saved in this run$"):
        asyncio.run(_runner(tmp_path, actor).save(1))
    assert not checkpoint_dir(tmp_path, 1).exists()
