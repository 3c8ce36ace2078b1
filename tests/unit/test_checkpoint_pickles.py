"""A checkpoint's pickled files (optimizer and RNG states) load weights-only: a file that carries a callable is
refused, naming it, before anything of it runs; the states the project writes still load."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from rlinf_pipe.cli import exit_on_user_error
from rlinf_pipe.config import load_config
from rlinf_pipe.errors import UnsafeCheckpointError
from rlinf_pipe.models.state_files import check_state_files, load_state
from rlinf_pipe.runner.checkpoints import ACTOR_SUBDIR, RUNNER_STATE, check_resume
from rlinf_pipe.runner.run_dir import checkpoint_dir
from rlinf_pipe.utils.folders import mark_complete


class Payload:
    """What a hostile checkpoint carries: unpickling it calls os.mkdir (any callable would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _rng_state() -> dict:
    """What `engines.policy.checkpoint._rng_state` saves (the Megatron tracker's states are tensors too)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "megatron_tracker": {"model-parallel-rng": torch.get_rng_state()}}


def _optimizer_state() -> list:
    """What `PolicyOptimizer.state_dict` saves: per inner torch optimizer its state dict and its parameters."""
    param = torch.nn.Parameter(torch.randn(3, 2))
    state = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95)).state_dict()  # (its param groups)
    state["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(3, 2), "exp_avg_sq": torch.rand(3, 2)}}
    return [{"optimizer": state, "params": [param.detach().clone()]}]


def test_a_state_file_carrying_a_pickled_callable_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "rng_rank00000.pt"
    torch.save({**_rng_state(), "extra": Payload(str(marker))}, path)
    with pytest.raises(UnsafeCheckpointError, match=rf"checkpoint file {path} holds .* \(posix.mkdir\); .*refused"):
        load_state(path)
    with pytest.raises(UnsafeCheckpointError, match=rf"{path} .*posix.mkdir"):
        check_state_files([path])
    assert not marker.exists()
    torch.load(path, weights_only=False)  # (the payload is live: the old way of loading ran it)
    assert marker.is_dir()


def test_the_states_the_project_writes_load_as_saved(tmp_path):
    rng, optimizer = _rng_state(), _optimizer_state()
    torch.save(rng, tmp_path / "rng.pt")
    torch.save(optimizer, tmp_path / "optim.pt")
    check_state_files([tmp_path / "rng.pt", tmp_path / "optim.pt"])
    loaded = load_state(tmp_path / "rng.pt")
    assert loaded["python"] == rng["python"] and torch.equal(loaded["torch"], rng["torch"])
    assert loaded["numpy"][0] == "MT19937" and np.array_equal(loaded["numpy"][1], rng["numpy"][1])
    np.random.set_state(loaded["numpy"])  # (usable as it is restored)
    back = load_state(tmp_path / "optim.pt", map_location="cpu")
    assert back[0]["optimizer"]["param_groups"] == optimizer[0]["optimizer"]["param_groups"]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(back[0]["optimizer"]["state"][0][key], optimizer[0]["optimizer"]["state"][0][key])


def test_resuming_from_a_checkpoint_with_a_hostile_file_is_one_line_before_anything_starts(tmp_path, capsys):
    ckpt = checkpoint_dir(tmp_path / "exp" / "run", 2)
    trainer = ckpt / ACTOR_SUBDIR / "trainer"
    trainer.mkdir(parents=True)
    torch.save(_optimizer_state(), trainer / "optim_tp00_pp000_dp000.pt")
    torch.save({**_rng_state(), "extra": Payload(str(tmp_path / "ran"))}, trainer / "rng_rank00001.pt")
    torch.save(_rng_state(), trainer / "rng_rank00000.pt")
    (ckpt / RUNNER_STATE).write_text(json.dumps({"next_step": 2, "sampler": {}}))
    mark_complete(ckpt / ACTOR_SUBDIR, {"next_step": 2})
    mark_complete(ckpt, {"next_step": 2})
    cfg = load_config(overrides=[f"runner.output_dir={tmp_path}", f"runner.resume_dir={ckpt}"])
    assert exit_on_user_error(check_resume, cfg) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: checkpoint file {trainer / 'rng_rank00001.pt'} holds ")
    assert not (tmp_path / "ran").exists()
    torch.save(_rng_state(), trainer / "rng_rank00001.pt")
    assert check_resume(cfg) == ckpt
