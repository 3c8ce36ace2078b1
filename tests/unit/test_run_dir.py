"""Run folders and checkpoint discovery for resume."""

from __future__ import annotations

import json
import math
import os

import pytest

from rlinf_pipe.config import load_config
from rlinf_pipe.errors import ConfigError
from rlinf_pipe.runner.checkpoints import ACTOR_SUBDIR, RUNNER_STATE, check_resume, prune_checkpoints
from rlinf_pipe.runner.run_dir import checkpoint_dir, create_run_dir, find_resume_checkpoint
from rlinf_pipe.utils.metrics import json_safe
from rlinf_pipe.utils.folders import mark_complete


def cfg_with(tmp_path, resume: str | None, *extra: str):
    overrides = [f"runner.output_dir={tmp_path}", "runner.experiment_name=exp", *extra]
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


def test_run_dirs_are_unique_and_resume_auto_picks_the_highest_complete_step(tmp_path):
    cfg = cfg_with(tmp_path, "auto")
    assert find_resume_checkpoint(cfg) is None  # nothing saved yet: start fresh
    old_run, new_run = create_run_dir(cfg), create_run_dir(cfg)
    assert old_run != new_run and old_run.parent == new_run.parent == tmp_path / "exp"
    highest = make_ckpt(old_run, 8, complete=True, mtime=1000)  # the highest step, though an older save
    make_ckpt(new_run, 2, complete=True, mtime=2000)
    make_ckpt(new_run, 12, complete=False, mtime=3000)  # interrupted save: never eligible
    assert find_resume_checkpoint(cfg) == highest
    again = make_ckpt(new_run, 8, complete=True, mtime=4000)  # the same step saved again later: the newer one
    assert find_resume_checkpoint(cfg) == again


def test_resuming_with_nothing_left_to_train_is_refused_before_anything_starts(tmp_path):
    run = create_run_dir(cfg_with(tmp_path, None))
    ckpt = make_ckpt(run, 30, complete=True, mtime=1000)
    (ckpt / RUNNER_STATE).write_text(json.dumps({"next_step": 30, "sampler": {}}))
    (ckpt / ACTOR_SUBDIR).mkdir()
    mark_complete(ckpt / ACTOR_SUBDIR, {"next_step": 30, "step": 60})
    assert check_resume(cfg_with(tmp_path, "auto", "runner.max_steps=31")) == ckpt
    assert check_resume(cfg_with(tmp_path, None, "runner.max_steps=6")) is None
    with pytest.raises(ConfigError, match="continues at step 30, but runner.max_steps is 6: nothing is left"):
        check_resume(cfg_with(tmp_path, "auto", "runner.max_steps=6"))
    mark_complete(ckpt / ACTOR_SUBDIR, {"next_step": 29, "step": 58})  # an actor part of another step
    with pytest.raises(ConfigError, match=r"disagree on the step they hold .*'actor/COMPLETE': 29"):
        check_resume(cfg_with(tmp_path, "auto", "runner.max_steps=31"))
    (ckpt / RUNNER_STATE).unlink()
    with pytest.raises(ConfigError, match="is not a readable checkpoint .*runner.json"):
        check_resume(cfg_with(tmp_path, str(ckpt)))


def test_summary_values_that_json_cannot_hold_become_null():
    summary = {"loss": math.nan, "parts": [1.0, math.inf, {"x": -math.inf}], "steps": 3}
    text = json.dumps(json_safe(summary), allow_nan=False)
    assert json.loads(text) == {"loss": None, "parts": [1.0, None, {"x": None}], "steps": 3}


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


def test_an_output_dir_through_a_file_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"runner.output_dir: the run folder .* cannot be used: .*give "):
        create_run_dir(cfg_with(tmp_path / "file" / "out", None))


def test_a_full_disk_is_refused_before_anything_starts(tmp_path):
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                                 capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        mounted = False
    if not mounted:
        pytest.skip("cannot mount a small tmpfs here (needs root in a namespace that allows it)")
    try:
        with pytest.raises(ConfigError, match=r"its disk has only \d+ MiB free \(at least 256 MiB needed"):
            create_run_dir(cfg_with(mount, None))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_keep_checkpoints_deletes_the_oldest_complete_ones_and_nothing_else(tmp_path):
    run = tmp_path / "exp" / "run"
    for step, complete in [(1, True), (2, True), (3, False), (4, True), (5, True)]:
        make_ckpt(run, step, complete, mtime=step)
    newest = checkpoint_dir(run, 5)
    assert prune_checkpoints(run, 0, newest) == []  # 0: keep all
    assert prune_checkpoints(run, 2, newest) == [checkpoint_dir(run, 1), checkpoint_dir(run, 2)]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000004", "step_000005"]
    assert prune_checkpoints(run, 2, newest) == []  # an incomplete save (step 3) is left to the save that failed
    # `auto` still resumes from the newest
    assert find_resume_checkpoint(cfg_with(tmp_path, "auto")) == checkpoint_dir(run, 5)
    # resumed from step 4 into the same folder, the run saves step 5 again... and one from step 2's branch, above:
    # only what comes before the save counts (the later step 9 of an abandoned branch is not the one to keep)
    branch = make_ckpt(run, 9, complete=True, mtime=9)
    again = checkpoint_dir(run, 5)
    assert prune_checkpoints(run, 1, again) == [checkpoint_dir(run, 4)]
    assert again.exists() and branch.exists()
