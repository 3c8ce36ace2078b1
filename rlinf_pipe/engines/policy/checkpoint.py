"""A policy's training checkpoint: model shards, optimizer state, step and every rank's RNG states.

    <folder>/megatron.json, model/tp{t:02d}_pp{p:03d}.safetensors, hf/   the model (readable by `rlinf-pipe convert`)
    <folder>/trainer/state.json                                          step, schedule and parallel layout
    <folder>/trainer/optim_tpXX_ppYYY_dpZZZ.pt                           optimizer state (per DP rank if sharded)
    <folder>/trainer/rng_rankNNNNN.pt                                    RNG states of each rank
                                                                         (both loaded weights-only: `state_files`)
    <folder>/COMPLETE                                                    written last

Written to a temporary sibling and renamed into place by rank 0 after a barrier, so a folder is whole or absent.
The ranks wait for each other's file reads and writes on a gloo group of their own whose timeout
(`FILE_BARRIER_TIMEOUT`) allows for slow file systems: on the world's group (NCCL on GPUs, minutes) a rank 0 that
writes a large unsharded optimizer state to NFS would time the others out, and the job with them. Each wait also
tells every rank how the others' part went (`together`): a rank whose write or read failed (a full disk, a missing
file) makes every rank raise `CheckpointError` naming it, instead of leaving the others waiting for it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from rlinf_pipe.engines.policy.optimizer import PolicyOptimizer
from rlinf_pipe.models.megatron_checkpoint import CheckpointError
from rlinf_pipe.models.state_files import load_state
from rlinf_pipe.utils.folders import COMPLETE, is_complete, mark_complete

TRAINER_SUBDIR = "trainer"
STATE_FILE = "state.json"
FILE_BARRIER_TIMEOUT = timedelta(hours=2)
_file_group_cache: list[Any] = []  # [world group, its gloo group for file barriers] once made


def _file_group() -> Any:
    import torch.distributed as dist

    world = dist.group.WORLD
    if not _file_group_cache or _file_group_cache[0] is not world:  # (collective: every rank makes it at first use)
        _file_group_cache[:] = [world, dist.new_group(backend="gloo", timeout=FILE_BARRIER_TIMEOUT)]
    return _file_group_cache[1]


def file_barrier(failure: str | None = None) -> list[tuple[int, str]]:
    """Wait until every rank of the world got here, however long their files took (`FILE_BARRIER_TIMEOUT`), and
    learn how their part went: each rank gives its `failure` (None: done), and gets every failure as (rank, text)."""
    import torch.distributed as dist

    outcomes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, failure, group=_file_group())
    return [(rank, text) for rank, text in enumerate(outcomes) if text is not None]


@contextmanager
def together(what: str) -> Iterator[None]:
    """Run the block on every rank, then wait for all of them (`file_barrier`). If it raised on any rank, every
    rank raises `CheckpointError` naming the ranks and their errors (the failing rank's own error chained), so no
    rank waits for one that gave up. An exit that is not an error (`SystemExit`) is passed on once the others know."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - passed on to every rank below
        error = exc
    failed = file_barrier(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None and not isinstance(error, Exception):
        raise error
    if failed:
        where = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        raise CheckpointError(f"{what} failed on {len(failed)} rank{'s' if len(failed) > 1 else ''} ({where})"
                              ) from error


class MegatronPolicy(Protocol):
    """What a checkpoint reads from and writes into a policy (`rlinf_pipe.engines.policy.MegatronPolicy`)."""

    model_path: Path
    params_dtype: torch.dtype
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    shard_rank: int
    use_distributed_optimizer: bool

    @property
    def module(self) -> torch.nn.Module: ...

    def require_optimizer(self) -> PolicyOptimizer: ...


def _optim_file(policy: MegatronPolicy) -> str:
    dp = policy.shard_rank if policy.use_distributed_optimizer else 0  # (its shard of DP x CP; DP's without CP)
    return f"optim_tp{policy.tp_rank:02d}_pp{policy.pp_rank:03d}_dp{dp:03d}.pt"


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def _layout(policy: MegatronPolicy) -> dict[str, Any]:
    import torch.distributed as dist

    return {"tp": policy.tp_size, "pp": policy.pp_size, "dp": policy.dp_size, "cp": policy.cp_size,
            "world_size": dist.get_world_size(), "use_distributed_optimizer": policy.use_distributed_optimizer}


def save_checkpoint(policy: MegatronPolicy, folder: str | os.PathLike[str], record: dict[str, Any] | None = None) -> Path:
    """Save `policy` to `folder` (collective over all ranks; on a file system all ranks share). An existing folder
    is replaced. `record` goes into the completion marker."""
    import torch.distributed as dist

    from rlinf_pipe.models.megatron_checkpoint import save_model_shard

    optimizer = policy.require_optimizer()
    final = Path(folder).resolve()
    tmp = final.with_name(f".{final.name}.tmp")
    rank = dist.get_rank()
    try:
        with together(f"saving checkpoint {final}: preparing {tmp}"):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / TRAINER_SUBDIR).mkdir(parents=True)
        with together(f"saving checkpoint {final}: writing its files"):
            first = policy.dp_rank == 0 and policy.cp_rank == 0  # (the model's copies on other DP / CP ranks are equal)
            if first:
                save_model_shard(tmp, policy.tp_rank, policy.pp_rank, policy.module.state_dict())
            if policy.use_distributed_optimizer or first:
                torch.save(optimizer.state_dict(), tmp / TRAINER_SUBDIR / _optim_file(policy))
            torch.save(_rng_state(), tmp / TRAINER_SUBDIR / _rng_file(rank))
        with together(f"saving checkpoint {final}: putting it in place"):
            if rank == 0:
                _complete(policy, optimizer, tmp, final, record)
    except BaseException:  # (a failed rank, or the file group itself: a peer gone)
        if rank == 0 and not is_complete(tmp):  # (a folder left half written would hold disk space)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _complete(policy: MegatronPolicy, optimizer: PolicyOptimizer, tmp: Path, final: Path,
              record: dict[str, Any] | None) -> None:
    """Rank 0, once every rank wrote its files into `tmp`: write the metadata and the marker, swap `tmp` in."""
    from rlinf_pipe.models.megatron_checkpoint import write_megatron_meta

    write_megatron_meta(tmp, policy.tp_size, policy.pp_size, policy.model_path)
    state = {"step": optimizer.steps_taken, "peak_lr": optimizer.peak_lr,
             "lr_warmup_steps": optimizer.lr_warmup_steps, "params_dtype": str(policy.params_dtype),
             **_layout(policy)}
    (tmp / TRAINER_SUBDIR / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    mark_complete(tmp, {**(record or {}), "step": optimizer.steps_taken})
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        if old.exists() and not final.exists():  # (the earlier checkpoint back where it was)
            os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The `trainer/state.json` of a complete checkpoint folder (`FileNotFoundError` naming what is missing)."""
    path = Path(folder)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete actor checkpoint (no {COMPLETE!r} marker)")
    return json.loads((path / TRAINER_SUBDIR / STATE_FILE).read_text())


@dataclass
class TrainerState:
    """A rank's training state in host memory, as a checkpoint holds it: model tensors, optimizer state (fp32
    master weights and moments), optimizer steps taken, RNG states. `capture_state` takes one (a step's rollback
    point), `restore_state` puts it back."""

    model: dict[str, torch.Tensor]
    optimizer: list[dict[str, Any]]
    steps: int
    rng: dict[str, Any]


def _model_tensors(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {k: v for k, v in policy.module.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")}


def capture_state(policy: MegatronPolicy) -> TrainerState:
    """A copy of this rank's training state in host memory (no collective)."""
    optimizer = policy.require_optimizer()
    model = {k: v.detach().to("cpu", copy=True) for k, v in _model_tensors(policy).items()}
    return TrainerState(model, optimizer.state_dict(), optimizer.steps_taken, _rng_state())


def restore_state(policy: MegatronPolicy, state: TrainerState) -> None:
    """Put `state` back into this rank's model and optimizer (the device storage must be in place: not offloaded);
    gradients and the loss terms since the last optimizer step are dropped."""
    optimizer = policy.require_optimizer()
    targets = _model_tensors(policy)
    if set(state.model) != set(targets):
        raise ValueError(f"saved model tensors differ from the model's: missing {sorted(set(targets) - set(state.model))}"
                         f", unexpected {sorted(set(state.model) - set(targets))}")
    with torch.no_grad():
        for name, dst in targets.items():
            dst.data.copy_(state.model[name])
    optimizer.load_state_dict(state.optimizer)
    _set_rng_state(state.rng)
    optimizer.steps_taken = state.steps
    optimizer.zero_grads()


def load_checkpoint(policy: MegatronPolicy, folder: str | os.PathLike[str]) -> None:
    """Restore a folder written by `save_checkpoint` with the same TP / PP / DP layout: weights, optimizer state,
    step and this rank's RNG states. Collective over all ranks. Pickled files holding anything but the types of
    those states are refused (`state_files.load_state`)."""
    import torch.distributed as dist

    from rlinf_pipe.models.megatron_checkpoint import load_model_shard

    path = Path(folder)
    with together(f"loading checkpoint {path}"):
        state = read_trainer_state(path)
        layout = _layout(policy)
        saved = {k: state.get(k, 1 if k == "cp" else None) for k in layout}  # (saved before CP existed: CP 1)
        if saved != layout:
            raise ValueError(f"it was saved with {saved}, this job runs {layout}; resume with the same parallel "
                             "layout")
        restore_state(policy, TrainerState(
            model=load_model_shard(path, policy.tp_rank, policy.pp_rank),
            optimizer=load_state(path / TRAINER_SUBDIR / _optim_file(policy), map_location="cpu"),
            steps=int(state["step"]),
            rng=load_state(path / TRAINER_SUBDIR / _rng_file(dist.get_rank())),
        ))


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
