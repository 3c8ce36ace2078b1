"""Run folders and checkpoint discovery for resume."""

from __future__ import annotations

import os

import pytest

from rlinf_pipe.config import load_config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.runner.run_dir import checkpoint_dir, create_run_dir, find_resume_checkpoint
from rlinf_pipe.utils.folders import mark_complete


def cfg_with(tmp_path, resume: str | None):
    overrides = [f"runner.output_dir={tmp_path}", "runner.experiment_name=exp"]
    if resume is not None:
        overrides.append(f"runner.resume_dir={resume}")
    return load_config(overrides=overrides)


def make_ckpt(run, step: int, complete: bool, mtime: float):
    ckpt = checkpoint_dir(run, step)
    ckpt.mkdir(parents=True)
    if complete:
        mark_complete(ckpt, {"next_step": step})
        os.utime(ckpt / "COMPLETE", (mtime, mtime))
    return ckpt


def test_run_dirs_are_unique_and_resume_auto_picks_the_newest_complete_checkpoint(tmp_path):
    cfg = cfg_with(tmp_path, "auto")
    assert find_resume_checkpoint(cfg) is None  # nothing saved yet: start fresh
    old_run, new_run = create_run_dir(cfg), create_run_dir(cfg)
    assert old_run != new_run and old_run.parent == new_run.parent == tmp_path / "exp"
    make_ckpt(old_run, 8, complete=True, mtime=1000)  # higher step, but an older save
    newest = make_ckpt(new_run, 2, complete=True, mtime=2000)
    make_ckpt(new_run, 4, complete=False, mtime=3000)  # interrupted save: never eligible
    assert find_resume_checkpoint(cfg) == newest


def test_resume_dir_accepts_a_run_folder_or_a_complete_checkpoint(tmp_path):
    run = create_run_dir(cfg_with(tmp_path, None))
    first = make_ckpt(run, 1, complete=True, mtime=1000)
    second = make_ckpt(run, 2, complete=True, mtime=2000)
    assert find_resume_checkpoint(cfg_with(tmp_path, str(run))) == second
    assert find_resume_checkpoint(cfg_with(tmp_path, str(first))) == first
    partial = make_ckpt(run, 3, complete=False, mtime=0)
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        find_resume_checkpoint(cfg_with(tmp_path, str(partial)))
    with pytest.raises(ConfigError, match="runner.resume_dir"):
        find_resume_checkpoint(cfg_with(tmp_path, str(tmp_path / "missing")))
